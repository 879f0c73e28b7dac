"""The decode read cache keeps rows across membership changes (moved, not re-gathered) and
always holds exactly what the pool holds for its rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_greedy, make_prompts
from conftest import make_engine as _make_engine
from pdtb.engine.read_cache import DecodeReadCache
from pdtb.engine.sequence import SamplingParams


def make_engine(model_dir: str, **kw):
    """An engine whose decode rows take the torch path: the read cache is what these tests test
    (the C kernel, where it applies, reads pages in place and keeps no read cache)."""
    return _make_engine(model_dir, decode_attention="torch", **kw)


def _cache() -> DecodeReadCache:
    return DecodeReadCache(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def _ids(t):
    return None if t is None else t.tolist()


def test_plan_keeps_rows_in_their_slots_and_gathers_the_rest():
    rc = _cache()
    p = rc.plan(("a", "b", "c"), [10, 20, 30], 32, 32)
    assert p.rebuild and rc.row_capacity >= 3 and rc.key == ("a", "b", "c")
    p = rc.plan(("a", "c"), [11, 31], 32, 32)  # b left from the middle: c moves into its row
    assert not p.rebuild and _ids(p.move_src) == [2] and _ids(p.move_dst) == [1] and p.fresh is None
    assert p.order is None and rc.key == ("a", "c")
    p = rc.plan(("c", "d"), [32, 5], 48, 48)  # a left, d is new: d takes a's row, c stays put
    assert _ids(p.fresh) == [0] and p.move_src is None and p.order.tolist() == [1, 0]
    assert rc.key == ("d", "c") and _ids(p.pos) == [5, 32]
    p = rc.plan(("c", "d"), [33, 6], 48, 0)  # same rows in another order: nothing to copy
    assert p.fresh is None and p.move_src is None and p.order.tolist() == [1, 0]
    p = rc.plan(("d", "c"), [7, 34], 48, 0)  # steady, in row order: append only
    assert p.order is None and p.fresh is None and p.move_src is None and not p.rebuild
    p = rc.plan(("d", "c"), [8, 36], 48, 0)  # c skipped a step (e.g. recomputed): gathered afresh
    assert _ids(p.fresh) == [1] and p.move_src is None and p.order is None
    assert rc.plan(("c", "d", "e", "f", "g"), [37, 9, 1, 1, 1], 48, 48).rebuild  # more rows than laid out
    assert rc.plan(("c",), [38], rc.capacity + 16, 0).rebuild  # longer than the rows hold


def test_rows_new_to_the_cache_take_free_slots_in_step_order():
    rc = _cache()
    rc.plan(("a", "b", "c"), [10, 20, 30], 32, 32)
    p = rc.plan(("d", "e", "f"), [4, 5, 6], 32, 0)  # a whole new batch, as after a finished one
    assert _ids(p.fresh) == [0, 1, 2] and p.order is None and rc.key == ("d", "e", "f")


def test_plan_gives_up_past_the_byte_budget():
    rc = DecodeReadCache(2, 1, 4, torch.float32, torch.device("cpu"), max_bytes=4096)
    assert rc.plan(("a",), [500], 512, 512) is None and rc.key is None


def _check_rows_match_pool(engine) -> None:
    """Every cached row holds, for every layer, exactly the K/V its pages hold."""
    kv, ps = engine.pool.kv, engine.pool.spec.page_size
    for rc in engine.runner.read_cache.buckets:
        for i, rid in enumerate(rc.key or ()):
            pages = engine.pool.pages_of(rid)
            if not pages:
                continue  # finished this step: its pages are free, its row is dead
            n = int(rc.covered[i])
            want = kv[:, :, pages].flatten(2, 3)[:, :, :n]  # [layers, 2, n, kvh, hd]
            for layer in range(kv.shape[0]):
                got = rc.layer(layer)[:, i, :, :n].transpose(1, 2)  # [2, n, kvh, hd]
                assert torch.equal(got, want[layer]), (rid, layer, n)


def _run_staggered(engine, seqs, every: int) -> None:
    """Add one request every `every` steps and run until all end, checking after each step
    that pages are conserved and cached rows equal the pool's."""
    pending, steps = list(seqs), 0
    while pending or engine.has_work():
        if pending and steps % every == 0:
            engine.add(pending.pop(0))
        engine.step()
        engine.pool.check()
        _check_rows_match_pool(engine)
        steps += 1


def test_rows_joining_and_leaving_stay_identical_to_generate(llama_dir, hf_models):
    engine = make_engine(llama_dir, page_size=16, max_num_batched_tokens=64)
    lens = (40, 9, 70, 23, 55, 3, 31)
    outs = (30, 8, 25, 12, 20, 16, 10)  # rows leave from the middle of the batch
    prompts = make_prompts(lens, engine.info.vocab_size, seed=21)
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, outs)]
    kinds = {"whole": 0, "moved": 0, "gathered": 0, "reordered": 0}
    for rc in engine.runner.read_cache.buckets:
        def spy(*a, _plan=rc.plan):
            p = _plan(*a)
            if p is not None:
                kinds["whole"] += p.rebuild
                kinds["moved"] += p.move_src is not None
                kinds["gathered"] += p.fresh is not None
                kinds["reordered"] += p.order is not None
            return p
        rc.plan = spy
    _run_staggered(engine, seqs, every=4)
    for p, n, s in zip(prompts, outs, seqs):
        assert s.output_token_ids == hf_greedy(hf_models["llama"], p, n, ignore_eos=True)
    print(kinds)
    assert kinds["moved"] >= 1 and kinds["gathered"] >= 2 and kinds["reordered"] >= 1, kinds
    assert np.all(engine.pool.num_free == engine.pool.num_pages)


def test_rows_stay_true_to_the_pool_through_preemption(llama_dir, hf_models):
    """A pool too small for the batch preempts and recomputes rows; a row that comes back is
    never served from what the cache held before."""
    engine = make_engine(llama_dir, page_size=4, num_pages=40)
    prompts = make_prompts((30, 25, 20, 12), engine.info.vocab_size, seed=5)
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
    for s in seqs:
        engine.add(s)
    while engine.has_work():
        engine.step()
        _check_rows_match_pool(engine)
    assert sum(s.num_preemptions for s in seqs) > 0
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(hf_models["llama"], p, 40, ignore_eos=True)


def test_a_newcomer_in_one_bucket_does_not_regather_steady_rows_of_another(llama_dir, hf_models):
    """Two long rows decode steadily in one length bucket; short requests join and leave the
    short bucket. The long rows are gathered from their pages once, when they start decoding,
    never again (a step that plans the long bucket as steady must not plan it twice)."""
    engine = make_engine(llama_dir, page_size=16, max_num_batched_tokens=512)
    long_p = make_prompts((300, 280), engine.info.vocab_size, seed=8)
    short_p = make_prompts((9, 14, 6), engine.info.vocab_size, seed=9)
    longs = [engine.make_sequence(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in long_p]
    shorts = [engine.make_sequence(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in short_p]
    long_ids = {s.request_id for s in longs}
    gathered: list[str] = []  # request ids whose long row came from pages, not from the cache
    rc = engine.runner.read_cache.buckets[1]  # 257-1024 keys

    def spy(key, positions, length, page_len, _plan=rc.plan):
        p = _plan(key, positions, length, page_len)
        if p is not None:
            rows = range(len(key)) if p.rebuild else (p.fresh.tolist() if p.fresh is not None else [])
            gathered.extend(rc.key[r] for r in rows)
        return p

    rc.plan = spy
    for s in longs:
        engine.add(s)
    steps = 0
    while engine.has_work():
        if steps in (6, 14, 22):
            engine.add(shorts[(steps - 6) // 8])
        engine.step()
        _check_rows_match_pool(engine)
        steps += 1
    assert sorted(gathered) == sorted(long_ids), gathered  # each long row gathered exactly once
    for p, s in zip(long_p, longs):
        assert s.output_token_ids == hf_greedy(hf_models["llama"], p, 40, ignore_eos=True)
    for p, s in zip(short_p, shorts):
        assert s.output_token_ids == hf_greedy(hf_models["llama"], p, 5, ignore_eos=True)


def test_a_step_that_fails_after_planning_forgets_the_read_cache(llama_dir, monkeypatch):
    """Planning counts the step's appends in `covered`; if the step then fails before the
    forward (here while building its tensors), the caches are dropped, not left claiming
    positions they never received."""
    engine = make_engine(llama_dir, page_size=16)
    for p in make_prompts((20, 30), engine.info.vocab_size, seed=3):
        engine.add(engine.make_sequence(p, SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(4):
        engine.step()
    runner = engine.runner
    assert any(rc.key for rc in runner.read_cache.buckets)  # steady decode: cached rows

    def boom(a):
        raise RuntimeError("injected")
    monkeypatch.setattr(runner, "_t", boom)  # fails after _steady_decode planned its buckets
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert all(rc.key is None and not len(rc.covered) for rc in runner.read_cache.buckets)


def test_steady_steps_feed_rows_in_slot_order_and_return_logits_in_step_order(llama_dir, hf_models):
    """Rows that join, leave and cross a length bucket end up in cache slots that differ from
    the scheduler's order. Steady steps then feed the model bucket by bucket in slot order,
    every group a contiguous span of the flat rows, and gather the logits back into the step's
    order: the tokens still equal `generate` for every request."""
    engine = make_engine(llama_dir, page_size=16, max_num_batched_tokens=512)
    lens = (240, 12, 230, 30, 7, 19, 250, 5)
    outs = (40, 10, 35, 30, 14, 25, 20, 30)
    prompts = make_prompts(lens, engine.info.vocab_size, seed=31)
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, outs)]
    runner, seen = engine.runner, {"permuted": 0, "two_groups": 0}
    real = runner._steady_decode

    def spy(chunks):
        got = real(chunks)
        if got is not None:
            groups = got[2].groups
            spans = [g.span for g in groups]
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert spans[-1][1] == len(chunks) and all(g.span is not None for g in groups)
            order = torch.arange(len(chunks)) if got[3] is None else got[3]
            assert sorted(order.tolist()) == list(range(len(chunks)))
            # the flat row that feeds chunk i carries chunk i's token and position
            assert got[0][0, order].tolist() == [c.token_ids[0] for c in chunks]
            assert got[1][0, order].tolist() == [c.start_pos for c in chunks]
            seen["permuted"] += got[3] is not None
            seen["two_groups"] += len(groups) > 1
        return got

    runner._steady_decode = spy
    _run_staggered(engine, seqs, every=3)
    for p, n, s in zip(prompts, outs, seqs):
        assert s.output_token_ids == hf_greedy(hf_models["llama"], p, n, ignore_eos=True)
    assert seen["permuted"] >= 3 and seen["two_groups"] >= 3, seen
