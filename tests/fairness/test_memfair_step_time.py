"""memfair's bound on the step's time: beside another owner's decode rows a prompt's chunk keeps
the step within an ordinary one (the same rows beside the budget's worth of fresh prompt
tokens), priced by SchedState.step_s; and the node's own fit of its steps (engine/step_cost.py)
that gives the price."""
from __future__ import annotations

import numpy as np
import pytest

import math

from fairness.memfair import MemFairPolicy
from pdtb.engine.step_cost import MIN_STEPS, StepCostFit
from pdtb.engine.step_shape import StepShape
from sched_sim import apply_step, make_request, make_scheduler, sim_step


class Price:
    """5 ms a step, 0.1 ms a decode row, 0.1 ms a prompt token, 1 us a query-key pair of the
    prompts' attention."""

    ready = True

    def step_s(self, shape: StepShape) -> float:
        return 5e-3 + 1e-4 * shape.decode_rows + 1e-4 * shape.prefill_tokens + 1e-6 * shape.prefill_attn


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


def test_a_chunk_deep_into_its_prompt_keeps_the_step_an_ordinary_one():
    chunks = whale_chunks(Price(), minnows=4)
    # The ordinary step: 4 rows beside 508 fresh tokens, 0.1 ms * 508 + 1 us * 508 * 509 / 2 =
    # 180.1 ms over the rows. From offset 0 the whale's first chunk is all of that; from offset
    # 508, k tokens cost 0.1 ms k + 1 us (508 k + k (k + 1) / 2): at most 246 of them.
    extra = 1e-4 * 508 + 1e-6 * 508 * 509 / 2
    a, b = 0.5e-6, 1e-4 + 1e-6 * 508.5
    second = math.floor((-b + math.sqrt(b * b + 4 * a * extra)) / (2 * a))
    assert second == 246 and chunks[:2] == [508, second] and sum(chunks) == 1200
    start = 0
    for k in chunks:  # and no later chunk makes its step dearer than the ordinary one
        assert 1e-4 * k + 1e-6 * (k * start + k * (k + 1) / 2) <= extra + 1e-12
        start += k


def test_no_other_owner_decoding_no_limit():
    assert whale_chunks(Price(), minnows=0)[0] == 512
    assert whale_chunks(Price(), minnows=4, same_owner=True)[0] == 508  # the budget less its own rows' tokens


def test_unpriced_no_limit_and_a_page_at_least():
    assert whale_chunks(None, minnows=4)[0] == 508

    class Dear(Price):
        def step_s(self, shape):  # priced by the chunks' mean offset: past the ordinary step's, any chunk is dearer
            return 5e-3 + shape.prefill_attn / max(1, shape.prefill_tokens)

    chunks = whale_chunks(Dear(), minnows=4)  # from offset 0 the budget, then a page (of 4 tokens here) a step
    assert chunks[0] == 508 and set(chunks[1:]) == {4}  # the prompt still moves


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
