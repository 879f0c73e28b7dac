"""Prefix caching on real clusters: a 1P+1D cluster and a colocated node give generate's
tokens with the cache on and off; the hand-off sends only the pages the decode node lacks."""
from __future__ import annotations

import random

import pytest

from cluster_util import all_pages_free, get_json, launched, wait_until
from conftest import hf_greedy

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
EXTRA = {"return_token_ids": True, "ignore_eos": True}


def shared_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts on one 96-token base: cut at many lengths (mid-page too), each with a tail of
    its own, and one repeated whole."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(96)]
    out = [base[:c] + [rng.randrange(3, vocab) for _ in range(7)] for c in (96, 40, 16, 17, 96, 71, 0)]
    return out + [list(out[0])]


def page_bytes(model_dir: str, page_size: int = 16) -> int:
    """Bytes of one float32 KV page of the checkpoint: layers x (K, V) x tokens x heads x dim."""
    import json
    from pathlib import Path

    c = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * page_size * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4


def run_prompts(url: str, prompts, max_tokens: int = 8) -> list[list[int]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                      extra_body=EXTRA).choices[0].token_ids for p in prompts]


def node(url: str, role: str) -> dict:
    return next(n for n in get_json(f"{url}/cluster") if n["role"] == role)


@pytest.mark.parametrize("cache", ["on", "off"])
def test_disagg_1p1d_with_shared_prefixes(llama_dir, hf_models, tmp_path, cache):
    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--kv-pages", "300", "--",
                  "--prefix-cache", cache) as (url, _):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        prompts = shared_prompts(vocab)
        got = run_prompts(url, prompts)
        assert got == [hf_greedy(hf_models["llama"], p, 8, ignore_eos=True) for p in prompts]
        if cache == "on":
            wait_until(lambda: node(url, "decode")["prefix_query_tokens"] >= sum(map(len, prompts)), 10,
                       what="stats with every hand-off")
        total = sum(-(-len(p) // 16) for p in prompts) * page_bytes(llama_dir)  # every prompt's pages
        # every hand-off's pages are sent or left out (read once the stats show them all)
        pre = wait_until(lambda: (lambda n: n if n["extra"]["kv_bytes_sent"] + n["extra"]["kv_bytes_not_sent"]
                                  == total else None)(node(url, "prefill")), 10, what="stats with every hand-off")
        dec = node(url, "decode")
        sent, not_sent = pre["extra"]["kv_bytes_sent"], pre["extra"]["kv_bytes_not_sent"]
        if cache == "off":
            assert pre["prefix_hit_tokens"] == dec["prefix_hit_tokens"] == not_sent == 0
        else:
            # later prompts start from the base's pages on both sides: not computed, not sent
            assert pre["prefix_hit_tokens"] > 0 and dec["prefix_hit_tokens"] > 0 and not_sent > 0
            tenant_bytes = dec["extra"]["kv_bytes"]["default"]
            assert tenant_bytes["cached"] == not_sent and tenant_bytes["received"] == sent
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")


def test_colocated_with_shared_prefixes_and_a_small_pool(llama_dir, hf_models, tmp_path):
    """A pool that holds few requests at once: sharers are preempted and recomputed from the cache."""
    with launched(tmp_path / "c", llama_dir, "--mode", "colocated", "--kv-pages", "40", "--",
                  "--max-num-batched-tokens", "64") as (url, _):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        prompts = shared_prompts(vocab, seed=3)
        got = run_prompts(url, prompts, 24)
        assert got == [hf_greedy(hf_models["llama"], p, 24, ignore_eos=True) for p in prompts]
        wait_until(lambda: node(url, "colocated")["prefix_hit_tokens"] > 0, 10, what="hits in stats")
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")
