"""The fairness figures' windows: each window's in-flight records, found by placing each record
in the windows it spans, equal the brute-force test of every record against every window."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.figures.records import RequestRecord
from pdtb.figures.service import _in_flight, _windows

times = st.floats(0.0, 50.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(times, st.one_of(st.none(), times)), max_size=30),
       st.sampled_from([0.25, 0.5, 1.0, 3.0]), st.floats(0.1, 60.0))
def test_windows_equal_brute_force(spans, window, duration):
    records = []
    for i, (send, end) in enumerate(spans):
        r = RequestRecord(f"t{i % 3}", "x", 1, 1, send_time=send)
        r.end_time = None if end is None else send + end
        records.append(r)
    got = _windows(records, window, duration)
    n = len(got)
    assert n == math.ceil(duration / window)
    for k in range(n):
        a, b = k * window, min((k + 1) * window, duration)
        assert got[k] == [r for r in records if _in_flight(r, a, b)]
