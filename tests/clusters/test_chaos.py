"""Chaos on real clusters (processes on loopback, scripts/launch_cluster.sh): nodes killed with
kill -9 while streams are in flight, clients that go away mid-stream, a node restarted on its old
control port, a request larger than the decode pool (refused at once), a busy decode pool (held,
then failed after the hold timeout or served). What must hold every time:

  - every request ends within END_S: finished, or failed with a reason (HTTP 503, or an error
    event in the stream followed by [DONE]); none hangs, none ends without a word;
  - the router goes on serving through the nodes that are left;
  - once idle, every surviving node has all its pages free.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import subprocess
import urllib.request

import psutil
import pytest

from chaos_util import END_S, Outcome, check_ended_well, prompt, http_client, stream, until
from cluster_util import (ROOT, get_json, healthy_nodes_free, kill9, launched, node, ready_info, router_healthy, vocab_of,
                          wait_until)

pytestmark = pytest.mark.slow
FREE_S = 30.0  # pages return to all-free within this bound once idle


def metric(metrics_addr: str, name: str, **labels) -> float:
    """Sum of a Prometheus counter's samples on a node's /metrics (label filter optional)."""
    with urllib.request.urlopen(f"{metrics_addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def chaos_run(url: str, vocab: int, fault, *, n_long: int, long_tokens: int, prompt_len: int,
                    n_during: int, every_s: float, fault_after: int) -> tuple[list[Outcome], list[Outcome]]:
    """`n_long` streams in flight; `fault()` once `fault_after` of them have tokens; meanwhile and
    after, `n_during` more requests, one every `every_s`. Returns (long outcomes, later outcomes)."""
    rng = random.Random(7)
    started: list = []
    async with http_client() as s:
        longs = [asyncio.ensure_future(stream(s, url, prompt(vocab, prompt_len, rng), long_tokens, started=started))
                 for _ in range(n_long)]
        await until(lambda: len(started) >= fault_after, END_S, "streams to start")
        await asyncio.to_thread(fault)
        during = []
        for _ in range(n_during):
            during.append(asyncio.ensure_future(stream(s, url, prompt(vocab, prompt_len, rng), 16)))
            await asyncio.sleep(every_s)
        outs = await asyncio.wait_for(asyncio.gather(*longs, *during), END_S)
    return outs[:n_long], outs[n_long:]


async def all_complete(url: str, vocab: int, n: int, max_tokens: int = 12) -> list[Outcome]:
    rng = random.Random(11)
    async with http_client() as s:
        return await asyncio.wait_for(
            asyncio.gather(*(stream(s, url, prompt(vocab, 24, rng), max_tokens) for _ in range(n))), END_S)


# ---- clusters of their own ---------------------------------------------------------------------------
def test_prefill_killed_mid_work(llama_dir, tmp_path):
    with launched(tmp_path / "c2p1d", llama_dir, "--mode", "disagg", "--prefill", "2", "--decode", "1",
                  "--kv-pages", "600") as (url, run_dir):
        vocab = vocab_of(url)
        name = "prefill-0"
        # Long prompts, so that the kill finds prompts still queued or in prefill on prefill-0.
        longs, during = asyncio.run(chaos_run(url, vocab, lambda: kill9(run_dir, name), n_long=12, long_tokens=100,
                                              prompt_len=2000, n_during=16, every_s=0.2, fault_after=1))
        check_ended_well(longs + during)
        # those on the killed node are recomputed through the other one (the router's --recompute-retries)
        assert all(o.ok for o in longs + during), [o for o in longs + during if not o.ok][:3]
        wait_until(lambda: not node(url, name)["healthy"], 15, what="the router to see the node gone")
        outs = asyncio.run(all_complete(url, vocab, 6))
        assert all(o.ok for o in outs), outs  # served by the surviving prefill node
        wait_until(lambda: healthy_nodes_free(url), FREE_S, what="surviving nodes' pages free")


def test_request_larger_than_decode_pool_is_refused_at_once(llama_dir, tmp_path):
    # An 8-page decode pool (128 tokens). Both requests need 13 pages at their longest: the first
    # does not even arrive in 8 pages, the second does (7 pages) but could never finish. Neither
    # may be held until --hold-timeout (300 s, far past END_S): the router knows the pool's size
    # from the node's stats and refuses both with a 400 before any node sees them (the decode
    # node's own refusal at the transfer header, for a router that did not, is
    # tests/nodes/test_node_admission.py).
    with launched(tmp_path / "cbig", llama_dir, "--mode", "disagg", "--kv-pages", "8",
                  "--prefill-kv-pages", "256", "--", "--hold-timeout", "300") as (url, run_dir):
        vocab = vocab_of(url)

        async def go():
            rng = random.Random(5)
            async with http_client() as s:
                big = [stream(s, url, prompt(vocab, 200, rng), 4), stream(s, url, prompt(vocab, 100, rng), 100)]
                outs = await asyncio.wait_for(asyncio.gather(*big), END_S)
                return outs, await asyncio.wait_for(stream(s, url, prompt(vocab, 24, rng), 8), END_S)

        outs, small = asyncio.run(go())
        for o in outs:
            assert o.status == 400 and o.tokens == 0, o
            assert "needs up to 13 KV pages for prompt + max_tokens" in o.error, o.error
        assert small.ok and small.tokens == 8, small  # a request that fits is served as usual
        deferred = metric(ready_info(run_dir, "prefill-0")["metrics"], "pdtb_kv_transfers_total", outcome="deferred")
        assert deferred == 0, "the prefill node held a request that can never fit"
        wait_until(lambda: healthy_nodes_free(url), FREE_S, what="pages free after the refusals")


def test_busy_decode_pool_holds_then_fails_after_hold_timeout_or_serves(llama_dir, tmp_path):
    # A 32-page decode pool. Request A (25 pages at its longest) occupies it; the decode node reads
    # at most 800 KB/s of KV per tenant (a token bucket), and one step of A reads 19-25 pages of
    # 32 KiB, so A makes about one step a second and outlasts the hold timeout whatever the
    # machine's speed. B and C (16 pages each) fit the pool but not beside A: held.
    # B is held until --hold-timeout, then failed; C is held until A goes away, then served.
    hold = 4.0  # < fairness HELD_TTL_S (5 s): a held arrival B left behind would fail C (see DecodeNode.on_abort)
    with launched(tmp_path / "chold", llama_dir, "--mode", "disagg", "--kv-pages", "32", "--prefill-kv-pages",
                  "256", "--prefill-args", f"--hold-timeout {hold}", "--decode-args", "--tenant-bw-cap 800000") as (url, rd):
        vocab = vocab_of(url)
        held: list[int] = []
        pre_metrics = ready_info(rd, "prefill-0")["metrics"]

        def deferrals() -> float:  # live, unlike /cluster (the last ping)
            return metric(pre_metrics, "pdtb_kv_transfers_total", outcome="deferred")

        def held_pages() -> int:
            held.append(next(n for n in get_json(f"{url}/cluster") if n["role"] == "prefill")["extra"]["held_pages"])
            return held[-1]

        async def go():
            rng, started = random.Random(5), []
            async with http_client() as s:
                a = asyncio.ensure_future(stream(s, url, prompt(vocab, 300, rng), 100, started=started, user="a"))
                await until(lambda: started, END_S, "A to reach the decode node")
                b_task = asyncio.ensure_future(stream(s, url, prompt(vocab, 250, rng), 4, user="b"))
                while not b_task.done():  # the prefill node reports the held hand-off meanwhile
                    await asyncio.to_thread(held_pages)
                    await asyncio.sleep(0.25)
                b = await asyncio.wait_for(b_task, END_S)
                before = await asyncio.to_thread(deferrals)
                c_task = asyncio.ensure_future(stream(s, url, prompt(vocab, 250, rng), 4, user="c"))
                await until(lambda: deferrals() > before, END_S, "C to be held")
                assert not a.done(), "A should still hold the decode pool"
                a.cancel()  # the client goes away: A is aborted and its pages are freed
                with contextlib.suppress(asyncio.CancelledError):
                    await a
                return b, await asyncio.wait_for(c_task, END_S)

        b, c = asyncio.run(go())
        assert b.failed_with_reason and b.status == 200, b
        assert "decode" in b.error and "no_pages" in b.error, b.error
        assert b.tokens == 1  # the first token came from the prefill node before the hold
        assert max(held) > 0, "the prefill node never reported holding the pages"
        assert c.ok and c.tokens == 4, c  # held, not failed: served once A left
        wait_until(lambda: healthy_nodes_free(url), FREE_S, what="pages free after the hold")
        assert get_json(f"{url}/health")["status"] == "ok"


# ---- one 1 prefill + 2 decode cluster for the disconnect, decode-kill and rejoin tests -----------
@pytest.fixture(scope="module")
def cluster_1p2d(llama_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chaos") / "c1p2d"
    with launched(run_dir, llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  "--kv-pages", "600") as (url, rd):
        yield url, rd
        # After the kills, every node left must still stop on SIGTERM, without the SIGKILL fallback.
        r = subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(rd), "--timeout", "20"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "did not exit" not in r.stderr, r.stderr


def test_client_disconnects_mid_stream_free_pages(cluster_1p2d):
    url, run_dir = cluster_1p2d
    vocab = vocab_of(url)
    decodes = [ready_info(run_dir, f"decode-{i}")["metrics"] for i in range(2)]
    gen_before = sum(metric(m, "pdtb_generation_tokens_total") for m in decodes)
    n, max_tokens = 8, 2000

    async def go():
        rng = random.Random(3)
        async with http_client() as s:
            return await asyncio.wait_for(asyncio.gather(
                *(stream(s, url, prompt(vocab, 20, rng), max_tokens, close_after=3) for _ in range(n))), END_S)

    outs = asyncio.run(go())
    assert all(o.status == 200 and o.tokens >= 3 and not o.done for o in outs), outs
    wait_until(lambda: healthy_nodes_free(url), FREE_S, what="pages free after the clients left")
    # The requests were aborted, not run to their end: far fewer tokens than asked for were made.
    generated = sum(metric(m, "pdtb_generation_tokens_total") for m in decodes) - gen_before
    assert generated < n * max_tokens / 2, generated
    assert get_json(f"{url}/health")["status"] == "ok"
    assert all(o.ok for o in asyncio.run(all_complete(url, vocab, 4)))


def test_decode_killed_mid_stream_then_rejoins(cluster_1p2d):
    url, run_dir = cluster_1p2d
    vocab = vocab_of(url)
    name = "decode-0"
    pid = int((run_dir / f"{name}.pid").read_text())
    cmdline = psutil.Process(pid).cmdline()
    ctrl_port = ready_info(run_dir, name)["ctrl"].rsplit(":", 1)[1]

    longs, during = asyncio.run(chaos_run(url, vocab, lambda: kill9(run_dir, name), n_long=16, long_tokens=300,
                                          prompt_len=24, n_during=12, every_s=0.3, fault_after=6))
    check_ended_well(longs + during)
    # streams on the killed decode node are recomputed through the survivor and finish too
    assert all(o.ok for o in longs + during), [o for o in longs + during if not o.ok][:3]
    wait_until(lambda: not node(url, name)["healthy"], 15, what="the router to see the node gone")
    outs = asyncio.run(all_complete(url, vocab, 6))
    assert all(o.ok for o in outs), outs  # served by the surviving decode node
    wait_until(lambda: healthy_nodes_free(url), FREE_S, what="surviving nodes' pages free")

    # Restart on the same control port: the router reconnects by itself.
    addr_file = run_dir / f"{name}.restart.json"
    log = open(run_dir / f"{name}.restart.log", "w")
    proc = subprocess.Popen([*cmdline, "--ctrl-port", ctrl_port, "--addr-file", str(addr_file)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        (run_dir / f"{name}.pid").write_text(str(proc.pid))  # stop_cluster.sh stops it with the rest
        wait_until(lambda: addr_file.exists() or proc.poll() is not None, 120, what="restarted node ready")
        assert proc.poll() is None, (run_dir / f"{name}.restart.log").read_text()[-2000:]
        info = json.loads(addr_file.read_text())
        assert info["ctrl"].endswith(f":{ctrl_port}")

        wait_until(lambda: router_healthy(url), 30, what="/health 200 again")
        outs = asyncio.run(all_complete(url, vocab, 8))
        assert all(o.ok for o in outs), outs
        assert metric(info["metrics"], "pdtb_requests_finished_total", reason="length") > 0, \
            "no request finished on the restarted node"
        wait_until(lambda: healthy_nodes_free(url), FREE_S, what="pages free after the rejoin")
        assert len([n for n in get_json(f"{url}/cluster") if n["healthy"]]) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        log.close()
