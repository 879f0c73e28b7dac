"""memfair's share of the step's time: beside another owner's decode rows a prompt's chunk adds
at most what those rows cost alone (STEP_STRETCH), priced by SchedState.step_s; and the node's
own fit of its steps (engine/step_cost.py) that gives the price."""
from __future__ import annotations

import numpy as np
import pytest

from fairness.memfair import STEP_STRETCH, MemFairPolicy
from pdtb.engine.step_cost import MIN_STEPS, StepCostFit
from pdtb.engine.step_shape import StepShape
from sched_sim import apply_step, make_request, make_scheduler, sim_step


class Price:
    """5 ms a step, 0.1 ms a decode row, 0.1 ms a prompt token: a chunk of k tokens beside n
    decode rows may take k <= 50 + n (the rows alone cost 5 + 0.1 n ms)."""

    ready = True

    def step_s(self, shape: StepShape) -> float:
        return 5e-3 + 1e-4 * shape.decode_rows + 1e-4 * shape.prefill_tokens


def whale_chunks(price, minnows: int, same_owner: bool = False) -> list[int]:
    """The whale's prompt chunks, step by step, while `minnows` rows of another owner (or of
    its own) decode beside it."""
    sched = make_scheduler(MemFairPolicy(), num_pages=4000, budget=512)
    sched.step_cost = price
    for i in range(minnows):
        sched.add(make_request(8, 2000, tenant="whale" if same_owner else "minnow", rid=f"m{i}"))
    sim_step(sched)  # the minnows' prompts: from here on they decode
    whale = make_request(1200, 4, tenant="whale", rid="w")
    sched.add(whale)
    chunks = []
    while whale.num_computed_tokens < 1200:
        out = sched.schedule()
        chunks += [c.num_new_tokens for c in out.chunks if c.seq is whale]
        for c in out.chunks:
            assert c.seq is whale or c.num_new_tokens == 1  # every minnow decodes every step
        apply_step(sched, out)
    return chunks


def test_a_chunk_beside_anothers_decode_rows_keeps_the_step_within_the_stretch():
    chunks = whale_chunks(Price(), minnows=4)
    limit = round((STEP_STRETCH - 1) * (5e-3 + 4e-4) / 1e-4)  # 54 tokens
    assert max(chunks) <= limit and chunks[0] == limit and sum(chunks) == 1200


def test_no_other_owner_decoding_no_limit():
    assert whale_chunks(Price(), minnows=0)[0] == 512
    assert whale_chunks(Price(), minnows=4, same_owner=True)[0] == 508  # the budget less its own rows' tokens


def test_unpriced_no_limit_and_a_page_at_least():
    assert whale_chunks(None, minnows=4)[0] == 508

    class Dear(Price):
        def step_s(self, shape):
            return 5e-3 + 1.0 * shape.prefill_tokens  # any prompt token is dearer than the step

    assert set(whale_chunks(Dear(), minnows=4)) == {4}  # a page (of 4 tokens here) a step: the prompt still moves


def test_the_fit_finds_the_coefficients_of_its_steps():
    rng = np.random.default_rng(0)
    true = dict(a=4e-3, rows=5e-5, ctx=2e-7, tok=8e-5, pairs=3e-8)
    fit = StepCostFit()
    shapes = []
    for i in range(400):
        rows, ctx = int(rng.integers(0, 64)), 0
        ctx = int(rows * rng.integers(20, 2000))
        tok = int(rng.integers(0, 512)) if i % 3 == 0 else 0
        start = int(rng.integers(0, 2000))
        shape = StepShape(rows, ctx, int(tok > 0), tok, tok * start + tok * (tok + 1) // 2)
        secs = true["a"] + true["rows"] * rows + true["ctx"] * ctx + true["tok"] * tok + true["pairs"] * shape.prefill_attn
        if i == MIN_STEPS - 2:
            assert not fit.ready and fit.step_s(shape) == 0.0
        fit.observe(shape, secs * (1 + 0.02 * rng.standard_normal()))
        shapes.append((shape, secs))
    assert fit.ready
    for shape, secs in shapes[-50:]:
        assert fit.step_s(shape) == pytest.approx(secs, rel=0.1)


def test_the_fit_never_prices_a_feature_below_zero():
    fit = StepCostFit()
    for i in range(200):  # more decode context, shorter steps: a negative slope alone
        fit.observe(StepShape(8, 1000 * (i % 10)), 0.01 - 1e-7 * 1000 * (i % 10) + 1e-4 * (i % 2))
    assert (fit.coef >= 0).all() and fit.step_s(StepShape(8, 10**6)) >= fit.step_s(StepShape(8, 0))
