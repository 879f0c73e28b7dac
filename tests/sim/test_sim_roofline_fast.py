"""The roofline's per-step fast paths equal its term-by-term figure on any step, and a decode step's
shortcut equals the general one to the bit."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.sim.cost import StepShape
from pdtb.sim.roofline import RooflineCost

COSTS = [RooflineCost.of("h100-sxm", "llama-3-8b"), RooflineCost.of("a100-80gb", "llama-3-70b", tp=4),
         RooflineCost.of("h200", "qwen2-7b", tp=2)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 256), st.integers(0, 1 << 20), st.integers(0, 4), st.integers(1, 4096), st.integers(0, 1 << 16),
       st.sampled_from(range(len(COSTS))))
def test_step_s_equals_the_terms(rows, ctx, chunks, tokens, offset, which):
    cost = COSTS[which]
    per = max(1, tokens // chunks) if chunks else 0  # a chunk feeds one token at least
    shape = StepShape(rows, ctx if rows else 0, chunks, per * chunks, chunks * (per * offset + per * (per + 1) // 2))
    expect = cost.terms(shape).total_s if shape.tokens else 0.0
    assert abs(cost.step_s(shape) - expect) <= 1e-12 * max(1.0, expect)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 512), st.integers(1, 1 << 24), st.sampled_from(range(len(COSTS))))
def test_decode_s_is_step_s_of_a_decode_step_to_the_bit(rows, ctx, which):
    cost = COSTS[which]
    assert cost.decode_s(rows, ctx) == cost.step_s(StepShape(rows, ctx))
