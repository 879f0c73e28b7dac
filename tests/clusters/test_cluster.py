"""Real clusters through the router, checked against transformers.generate."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster_util import all_pages_free, alive, get_json, launched, wait_until
from conftest import hf_greedy

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
EXTRA = {"return_token_ids": True, "ignore_eos": True}


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check_against_hf(url: str, hf_model, prompts, max_tokens: int = 12) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    for p in prompts:
        want = hf_greedy(hf_model, p, max_tokens, ignore_eos=True)
        r = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body=EXTRA)
        assert r.choices[0].token_ids == want
        assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(p)
        text, ids = "", []
        for chunk in client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body=EXTRA):
            if chunk.choices:
                text += chunk.choices[0].text
                ids += getattr(chunk.choices[0], "token_ids", None) or []
        assert ids == want
        assert text == r.choices[0].text


def check_chat_against_hf(url: str, model_dir: str, hf_model, max_tokens: int = 10) -> None:
    """/v1/chat/completions: greedy output equals generate on transformers' rendering of the
    conversation by the checkpoint's chat template."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What is a page?"}]
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    want = hf_greedy(hf_model, prompt, max_tokens, ignore_eos=True)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                       max_completion_tokens=max_tokens, temperature=0, extra_body=EXTRA)
    assert r.model_extra["prompt_token_ids"] == prompt and r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)


def check_stop_token(url: str, hf_model, prompt: list[int], max_tokens: int = 12) -> None:
    """A stop token id ends the output at its first occurrence; its id is in token_ids and
    stop_reason, its text is not in the text (as vLLM)."""
    import transformers

    want = hf_greedy(hf_model, prompt, max_tokens, ignore_eos=True)
    stop = want[4]
    k = want.index(stop)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={**EXTRA, "stop_token_ids": [stop]})
    c = r.choices[0]
    assert c.token_ids == want[:k + 1] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    tok = transformers.AutoTokenizer.from_pretrained(hf_model.name_or_path)
    assert c.text == tok.decode(want[:k], skip_special_tokens=True)


def check_stop_string(url: str, hf_model, prompt: list[int], max_tokens: int = 16) -> None:
    """A stop string ends the output at the router while the node still runs: the output is cut
    before it, and the last response still carries the node's timeline with its SLO attribution
    (the abort asks the node holding the request for it), streaming or not."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_model.name_or_path)
    want = hf_greedy(hf_model, prompt, max_tokens, ignore_eos=True)
    text = tok.decode(want, skip_special_tokens=True)
    stop = next(s for k in range(6, 12) if (s := tok.decode(want[k:k + 2], skip_special_tokens=True).strip())
                and text.index(s) > 0)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=[stop], extra_body=EXTRA)
    r = client.completions.create(**kw)
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].model_extra["stop_reason"] == stop
    timing = r.model_extra["pdtb_timing"]
    assert "first_token" in timing["stamps"] and "decode_s" in timing and "components" in timing["slo"], timing
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop" and "slo" in chunks[-1].model_extra["pdtb_timing"]


async def _many_streams(url: str, prompts, max_tokens: int) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
    model = (await client.models.list()).data[0].id

    async def one(p, n):
        got = 0
        async for chunk in await client.completions.create(model=model, prompt=p, max_tokens=n, stream=True,
                                                           extra_body=EXTRA):
            if chunk.choices:
                got += len(getattr(chunk.choices[0], "token_ids", None) or [])
        return got

    return await asyncio.wait_for(asyncio.gather(*(one(p, max_tokens + i % 5) for i, p in enumerate(prompts))), 400)


def test_disagg_1p1d_matches_generate_and_frees_pages(llama_dir, hf_models, tmp_path):
    with launched(tmp_path / "c1", llama_dir, "--mode", "disagg", "--kv-pages", "600") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        check_against_hf(url, hf_models["llama"], prompts_for(vocab, (1, 17, 130)))
        check_chat_against_hf(url, llama_dir, hf_models["llama"])
        check_stop_token(url, hf_models["llama"], prompts_for(vocab, (9,), seed=7)[0])
        check_stop_string(url, hf_models["llama"], prompts_for(vocab, (9,), seed=8)[0])
        lens = [random.Random(i).choice((3, 20, 60, 150)) for i in range(64)]
        got = asyncio.run(_many_streams(url, prompts_for(vocab, lens, seed=1), 8))
        assert got == [8 + i % 5 for i in range(64)]
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")
        pids = [int(p.read_text()) for p in run_dir.glob("*.pid")]
    assert not [p for p in pids if alive(p)], "processes left after stop_cluster.sh"


def test_disagg_2p2d_and_colocated_side_by_side(llama_dir, hf_models, tmp_path):
    with launched(tmp_path / "c2", llama_dir, "--mode", "disagg", "--prefill", "2", "--decode", "2",
                  "--kv-pages", "400") as (url, _):
        with launched(tmp_path / "c3", llama_dir, "--mode", "colocated", "--kv-pages", "400") as (url2, _):
            assert url != url2
            vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
            prompts = prompts_for(vocab, (5, 40, 200, 2), seed=2)
            check_against_hf(url2, hf_models["llama"], prompts)
            check_chat_against_hf(url2, llama_dir, hf_models["llama"])
            check_against_hf(url, hf_models["llama"], prompts)
            nodes = get_json(f"{url}/cluster")
            assert sorted(n["role"] for n in nodes) == ["decode", "decode", "prefill", "prefill"]
            wait_until(lambda: all_pages_free(url) and all_pages_free(url2), 30, what="all pages free")


def test_a_hand_off_bound_to_a_dead_decode_node_moves_to_the_other(llama_dir, hf_models, tmp_path):
    """Decode node 0 is killed; requests sent before the router notices are still bound to it
    by the router (equal pools: it alternates between the two). Their prefill node moves the
    hand-offs to decode node 1, a fallback the router named, when the transfer fails or the
    router reports the node down. Every request completes with generate's tokens, the ones
    bound to the dead node included."""
    import os
    import signal

    with launched(tmp_path / "cf", llama_dir, "--mode", "disagg", "--decode", "2", "--kv-pages", "400") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        prompts = prompts_for(vocab, (5, 30, 70, 12), seed=9)
        check_against_hf(url, hf_models["llama"], prompts[:1], max_tokens=4)  # both links in use
        os.kill(int((run_dir / "decode-0.pid").read_text()), signal.SIGKILL)

        async def all_of_them():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
            model = (await client.models.list()).data[0].id
            rs = await asyncio.gather(*(client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0,
                                                                  extra_body=EXTRA) for p in prompts))
            return [r.choices[0].token_ids for r in rs]

        got = asyncio.run(asyncio.wait_for(all_of_them(), 100))
        assert got == [hf_greedy(hf_models["llama"], p, 6, ignore_eos=True) for p in prompts]
        assert "hand-off moves from decode node" in (run_dir / "prefill-0.log").read_text()
        wait_until(lambda: all(n["pages_free"] == n["pages_total"] for n in get_json(f"{url}/cluster")
                               if n["healthy"]), 30, what="pages free on the live nodes")


def test_disagg_with_the_torch_transport(llama_dir, hf_models, tmp_path):
    """--transport torch from the launch script: one gloo process group of the prefill and
    decode nodes (file rendezvous in the run dir); a 300-token prompt's KV (19 pages, over
    the inline limit) moves by send/recv. Outputs equal generate; pages all come back."""
    import psutil

    with launched(tmp_path / "ct", llama_dir, "--mode", "disagg", "--transport", "torch",
                  "--kv-pages", "600") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        check_against_hf(url, hf_models["llama"], prompts_for(vocab, (17, 300), seed=4), max_tokens=6)
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")
        # every listening socket, gloo's included, on loopback (gloo follows the hostname otherwise)
        for pid_file in run_dir.glob("*.pid"):
            for c in psutil.Process(int(pid_file.read_text())).net_connections(kind="inet"):
                assert c.status != psutil.CONN_LISTEN or c.laddr.ip in ("127.0.0.1", "::1"), (pid_file.name, c)


def test_disagg_over_shared_memory(llama_dir, hf_models, tmp_path):
    """--transport shm: the prefill node gathers every hand-off over the inline limit into its
    export arena and the decode node reads it from there into its pages (19 pages of a
    300-token prompt). Outputs equal generate; pages all come back; the prefill node counts the
    transfers read (none written one-sided), the decode node its verdicts."""
    with launched(tmp_path / "cs", llama_dir, "--mode", "disagg", "--transport", "shm",
                  "--kv-pages", "600", "--host-kv-pages", "64") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        check_against_hf(url, hf_models["llama"], prompts_for(vocab, (17, 300, 260), seed=5), max_tokens=6)
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")

        def extra(role: str) -> dict:
            return [n for n in get_json(f"{url}/cluster") if n["role"] == role][0]["extra"]
        # (stats arrive with the router's next ping.) Each prompt goes twice (plain, then
        # streamed); the second time only its last page moves (the rest is in the decode
        # node's prefix cache) and rides inline: the 300- and 260-token prompts' first
        # hand-offs (19 and 17 pages of 32 KiB) are the ones read from the arena.
        wait_until(lambda: extra("decode")["admissions"].get("accept") == 6, 10, what="six hand-offs accepted")
        wait_until(lambda: extra("prefill")["kv_transfers_read"] == 2, 10, what="two hand-offs read")
        assert extra("prefill")["kv_transfers_one_sided"] == 0
