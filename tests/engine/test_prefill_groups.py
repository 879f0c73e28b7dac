"""The runner's grouping of prefill rows into attention calls (runner.prefill_groups)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.engine.runner import CAUSAL_ALONE, PAD_SLACK, prefill_groups

rows = st.lists(st.tuples(st.integers(2, 3000), st.integers(0, 3000)), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(rows)
def test_every_row_once_and_padding_bounded(spec):
    lens = np.array([q for q, _ in spec], np.int64)
    starts = np.array([s for _, s in spec], np.int64)
    npages = (starts + lens + 15) // 16
    groups = prefill_groups(lens, starts, npages)
    got = np.concatenate(groups) if groups else np.zeros(0, np.int64)
    assert sorted(got.tolist()) == list(range(len(spec)))
    for g in groups:
        if len(g) == 1:
            continue
        assert not ((starts[g] == 0) & (lens[g] >= CAUSAL_ALONE)).any()  # a long first chunk is alone
        padded = len(g) * lens[g].max() * npages[g].max()
        assert padded <= PAD_SLACK * (lens[g] * npages[g]).sum()


def test_long_first_chunks_alone_short_ones_together():
    lens = np.array([1500, 24, 30, 28, 900, 40], np.int64)
    starts = np.array([0, 0, 0, 0, 0, 600], np.int64)
    npages = (starts + lens + 15) // 16
    groups = [sorted(g.tolist()) for g in prefill_groups(lens, starts, npages)]
    assert [0] in groups and [4] in groups
    assert [1, 2, 3] in groups  # three minnows' prompts of one page pad to one shape: one call
    assert [5] in groups
