"""The prefix cache in the engine: token-identical to transformers.generate with the cache on
and off, for shared prefixes of many lengths, concurrent sharers, preemption and tier moves."""
from __future__ import annotations

import random

import pytest

from conftest import hf_greedy, make_engine, make_prompts
from pdtb.engine.sequence import SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def shared_prompts(vocab: int, cuts, base_len: int = 100, tail: int = 9, seed: int = 0) -> list[list[int]]:
    """Prompts that start with the first `cut` tokens of one base prompt, then a tail of their own."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(base_len)]
    return [base[:c] + [rng.randrange(3, vocab) for _ in range(tail)] for c in cuts]


def check_against_generate(model, prompts, seqs, max_tokens=12):
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(model, p, max_tokens, ignore_eos=True), f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("page_size", [16, 7])
def test_shared_prefixes_of_many_lengths_one_after_another(llama_dir, hf_models, page_size):
    """Each prompt runs after the ones before it: later ones start from their cached pages,
    including prefixes that end mid-page and a prompt that is entirely cached."""
    cuts = (100, 0, 5, 15, 16, 17, 31, 32, 33, 64, 99, 100)
    on = make_engine(llama_dir, page_size=page_size, num_pages=512)
    prompts = shared_prompts(on.info.vocab_size, cuts)
    prompts.append(list(prompts[0]))  # the same prompt again: all but its last token cached
    seqs = [on.generate([p], PARAMS)[0] for p in prompts]
    check_against_generate(hf_models["llama"], prompts, seqs)
    ps = page_size
    for c, s in zip(cuts[1:], seqs[1:]):  # pages of the base every later prompt shares
        assert s.num_cached_tokens == (min(c, 100 + 9 - 1) // ps) * ps or c == 100
    assert seqs[-1].num_cached_tokens == ((len(prompts[-1]) - 1) // ps) * ps
    assert on.scheduler.prefix.hit_tokens == sum(s.num_cached_tokens for s in seqs) > 0
    assert on.scheduler.prefix.query_tokens == sum(map(len, prompts))
    off = make_engine(llama_dir, page_size=page_size, num_pages=512, prefix_cache=False)
    off_seqs = [off.generate([p], PARAMS)[0] for p in prompts]
    assert [s.output_token_ids for s in off_seqs] == [s.output_token_ids for s in seqs]
    assert off.scheduler.prefix.hit_tokens == 0
    on.pool.check()
    assert on.pool.num_free == on.pool.num_pages and on.pool.num_cached > 0


def test_concurrent_sharers_in_one_batch(llama_dir, hf_models):
    """A first request computes the prefix; the rest arrive while it decodes and share its pages
    while it still holds them (reference counts above one)."""
    engine = make_engine(llama_dir, page_size=16, num_pages=512)
    prompts = shared_prompts(engine.info.vocab_size, (100, 80, 64, 48, 100, 33), seed=2)
    seqs = [engine.make_sequence(p, PARAMS) for p in prompts]
    engine.add(seqs[0])
    engine.step()  # the first prompt's prefill: its pages are registered
    for s in seqs[1:]:
        engine.add(s)
    peak_shared = 0
    while engine.has_work():
        engine.step()
        engine.pool.check()
        peak_shared = max(peak_shared, max(engine.pool.shared_counts().values(), default=0))
    check_against_generate(hf_models["llama"], prompts, seqs)
    assert peak_shared >= 3
    assert all(s.num_cached_tokens > 0 for s in seqs[1:])


@pytest.mark.parametrize("host_pages", [0, 64])
def test_preemption_and_tier_moves_of_requests_that_share_pages(llama_dir, hf_models, host_pages):
    """A pool too small for every sharer at once: requests holding shared pages are demoted to
    the host tier and promoted back (host_pages > 0) or preempted and recomputed (0)."""
    engine = make_engine(llama_dir, page_size=8, num_pages=40, max_num_batched_tokens=64,
                         host_kv_pages=host_pages)
    prompts = shared_prompts(engine.info.vocab_size, (64, 64, 56, 48, 64, 40), tail=20, seed=4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seqs = [engine.make_sequence(p, params) for p in prompts]
    for s in seqs:
        engine.add(s)
    moves = set()
    while engine.has_work():
        engine.step()
        engine.pool.check()
        moves |= {m.kind for m in engine.last_output.moves}
    check_against_generate(hf_models["llama"], prompts, seqs, 40)
    assert ("demote" in moves and "promote" in moves) if host_pages else "preempt" in moves
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.host_pool is None or engine.host_pool.num_free == engine.host_pool.num_pages


def test_random_prompts_share_nothing(llama_dir):
    engine = make_engine(llama_dir, page_size=16, num_pages=512)
    prompts = make_prompts((40, 70, 33), engine.info.vocab_size, seed=9)
    engine.generate(prompts, PARAMS)
    assert engine.scheduler.prefix.hit_tokens == 0
    assert engine.scheduler.prefix.query_tokens == 143
