"""Recompute on failure: a request whose node dies is sent anew (its prompt plus the tokens
already streamed) to live nodes, and the client's stream goes on with no token lost or repeated."""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from cluster_util import get_json, launched, wait_until
from conftest import assert_greedy_matches
from pdtb.nodes.protocol import TokenEvent
from pdtb.router.registry import RequestFailed


class ScriptedRegistry:
    """Each submitted request gets the next script: TokenEvents and exceptions, in order."""

    def __init__(self, scripts):
        self.scripts, self.sent, self.aborted, self.released = list(scripts), [], [], []

    def submit(self, greq):
        if not self.scripts:
            raise RequestFailed(503, "no healthy prefill node available")
        self.sent.append(greq)
        return SimpleNamespace(entry=SimpleNamespace(node_id="n0"), prefix_overlap_tokens=0, script=self.scripts.pop(0),
                               request_id=greq.request_id)

    async def next_event(self, handle, timeout, merge=True):
        item = handle.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def abort(self, handle, reason, final=False):
        self.aborted.append(handle.request_id)

    def release(self, handle):
        self.released.append(handle.request_id)


def run_with(llama_dir, scripts, max_tokens=6, retries=2):
    from pdtb.router.completions import CompletionRun, RouterState
    from pdtb.router.config import NodeSpec, RouterConfig, load_served_model
    from pdtb.router.metrics import RouterMetrics
    from pdtb.router.openai_api import parse_completion_request

    reg = ScriptedRegistry(scripts)
    config = RouterConfig((NodeSpec("colocated", "tcp://127.0.0.1:1"),), recompute_retries=retries)
    model = load_served_model(llama_dir)
    req = parse_completion_request(json.dumps({"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True})
                                   .encode(), model.name, model.vocab_size)
    run = CompletionRun(RouterState(config, model, reg, RouterMetrics()), req, [5, 6, 7], max_tokens)
    run.submit()

    async def drain():
        got = []
        async for p in run.pieces():
            got.append(p)
        return got

    return run, reg, asyncio.run(drain())


def lost(what="decode node d0 stopped answering"):
    return RequestFailed(503, what, node_lost=True)


def test_a_lost_node_sends_the_prompt_and_the_streamed_tokens_anew(llama_dir):
    run, reg, pieces = run_with(llama_dir, [
        [TokenEvent("x", [40]), TokenEvent("x", [41, 42]), lost()],
        [TokenEvent("x", [43]), lost("prefill node p0 stopped answering")],
        [TokenEvent("x", [44, 45], True, "length")]])
    assert [t for p in pieces for t in p.token_ids] == [40, 41, 42, 43, 44, 45]
    assert pieces[-1].finish_reason == "length"
    assert [g.prompt_token_ids for g in reg.sent] == [[5, 6, 7], [5, 6, 7, 40, 41, 42], [5, 6, 7, 40, 41, 42, 43]]
    assert [g.params.max_tokens for g in reg.sent] == [6, 3, 2]
    assert len({g.request_id for g in reg.sent}) == 3 and run.recomputes == 2
    assert reg.released[:2] == [reg.sent[0].request_id, reg.sent[1].request_id]  # the old ones let go
    # the nodes' timeline covers the last attempt: what came before is said beside it
    rec = pieces[-1].timing["recomputed"]
    assert rec["times"] == 2 and rec["tokens_before"] == 4 and rec["lost_s"] >= 0
    # and each attempt after a loss carries what the ones before it took, for its attribution
    first, second, third = (g.earlier for g in reg.sent)
    assert first is None and (second.tokens, third.tokens) == (3, 4)
    assert second.valid() and third.valid() and second.first_token_s == third.first_token_s
    assert second.last_token_s <= third.last_token_s and second.lost_s <= third.lost_s


def test_retries_are_bounded_and_other_failures_are_not_retried(llama_dir):
    with pytest.raises(RequestFailed, match="d0 stopped"):
        run_with(llama_dir, [[lost()], [lost()], [lost()], [TokenEvent("x", [1], True, "length")]])
    with pytest.raises(RequestFailed, match="no response"):
        run_with(llama_dir, [[RequestFailed(503, "no response from the nodes for 600 s")], []])
    with pytest.raises(RequestFailed, match="d0 stopped"):
        run_with(llama_dir, [[TokenEvent("x", [1]), lost()], []], retries=0)


@pytest.mark.slow
def test_decode_node_killed_under_40_greedy_streams(llama_dir, hf_models, tmp_path):
    """kill -9 of one of two decode nodes while 40 greedy streams run: every stream completes with
    generate's tokens, the survivors' pages are all free after, and a recomputed stream's SLO
    attribution counts the time the loss cost."""
    import os
    import signal

    from chaos_util import http_client, stream, until

    # The decode nodes' KV read is capped (40 MB/s: about 10 steps of 20 rows a second), so the
    # streams decode for seconds: the kill finds decode-0 with streams in flight whatever the
    # machine's speed (uncapped, all 48 tokens could be out before the kill landed).
    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  "--kv-pages", "800", "--decode-args", "--tenant-bw-cap 4e7") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        rng = random.Random(3)
        prompts = [[rng.randrange(16, vocab) for _ in range(rng.choice((8, 24, 40)))] for _ in range(40)]

        async def go():
            started: list = []
            async with http_client() as s:
                tasks = [asyncio.ensure_future(stream(s, url, p, 48, started=started)) for p in prompts]
                await until(lambda: len(started) >= 20, 60, "streams to start")
                os.kill(int((run_dir / "decode-0.pid").read_text()), signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        outs = asyncio.run(go())
        assert all(o.ok for o in outs), [o for o in outs if not o.ok][:3]
        for p, o in zip(prompts, outs):
            assert_greedy_matches(hf_models["llama"], p, o.token_ids, 48)  # (a recompute may break a tie)
        recomputed = [o.timing for o in outs if "recomputed" in o.timing]
        assert recomputed
        for t in recomputed:  # (the router measured `earlier` just before it sent the last attempt)
            assert 0 < t["stamps"]["earlier"]["lost_s"] <= t["recomputed"]["lost_s"]
            assert t["stamps"]["earlier"]["tokens"] == t["recomputed"]["tokens_before"]
            assert t["slo"]["components"]["node_lost"] > 0
        metrics = get_json_text(f"{url}/metrics")
        assert "pdtb_router_recomputes_total" in metrics and not metrics_zero(metrics, "pdtb_router_recomputes_total")
        wait_until(lambda: all(n["pages_free"] == n["pages_total"] for n in get_json(f"{url}/cluster") if n["healthy"]),
                   30, what="survivors' pages free")


def get_json_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metrics_zero(text: str, name: str) -> bool:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1]) == 0.0
    return True


def test_a_seeded_request_recomputed_midway_draws_the_same_tokens(llama_dir):
    """The resent request (prompt + the first k tokens, first_index k) samples what the
    uninterrupted one sampled after its k-th token."""
    from conftest import make_engine, make_prompts
    from pdtb.engine.sequence import SamplingParams

    engine = make_engine(llama_dir, page_size=16, num_pages=256, prefix_cache=False)
    prompt = make_prompts((30,), engine.info.vocab_size, seed=5)[0]
    whole = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True))[0]
    out = whole.output_token_ids
    for k in (1, 9, 19):
        rest = engine.generate([prompt + out[:k]], SamplingParams(max_tokens=20 - k, temperature=0.9, seed=7,
                                                                  ignore_eos=True, first_index=k))[0]
        assert rest.output_token_ids == out[k:], k
    other = engine.generate([prompt + out[:9]], SamplingParams(max_tokens=11, temperature=0.9, seed=7,
                                                               ignore_eos=True))[0]
    assert other.output_token_ids != out[9:]  # without the index the draws start over
