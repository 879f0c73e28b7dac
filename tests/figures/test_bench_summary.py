"""Summary and fairness figures against hand-computed values on small synthetic records."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pdtb.figures.records import RequestRecord
from pdtb.figures.service import ServiceWeights, jain_index
from pdtb.figures.slo_misses import format_lines
from pdtb.figures.summary import meets_slos, percentile, summarize


def make_record(tenant, klass, prompt, send, tokens, end, status="ok", requested=None, error=None):
    """Factory: a finished request whose tokens arrived at `tokens` (s)."""
    return RequestRecord(tenant, klass, prompt, requested if requested is not None else len(tokens),
                         output_tokens=len(tokens), scheduled_time=send, send_time=send,
                         first_token_time=tokens[0] if tokens else None, token_times=list(tokens),
                         end_time=end, status=status, error=error)


def records():
    """A (short):  r1 sent 0.0, tokens 0.1 0.2 0.4          -> TTFT 100, ITL 100 200, TPOT 150, E2E 400
                   r2 sent 1.0, token 1.3 (one token)        -> TTFT 300, no ITL, no TPOT, E2E 300
    B (long):      r3 sent 0.5, tokens 0.7 0.8 0.9 1.5       -> TTFT 200, ITL 100 100 600, TPOT 800/3, E2E 1000
                   r4 sent 0.6, token 0.9, then failed at 1.0 (asked for 4)
    C (long):      r5 sent 0.2, failed at 0.3 with no token (asked for 2): no completed request."""
    return [make_record("A", "short", 10, 0.0, [0.1, 0.2, 0.4], 0.4),
            make_record("A", "short", 5, 1.0, [1.3], 1.3),
            make_record("B", "long", 20, 0.5, [0.7, 0.8, 0.9, 1.5], 1.5),
            make_record("B", "long", 8, 0.6, [0.9], 1.0, "failed", requested=4, error="boom"),
            make_record("C", "long", 6, 0.2, [], 0.3, "failed", requested=2, error="HTTP 500")]


def approx_pct(got, mean, p50, p90, p95, p99, mx):
    assert got == pytest.approx({"mean": mean, "p50": p50, "p90": p90, "p95": p95, "p99": p99, "max": mx})


def test_percentile_matches_numpy_linear():
    rng = random.Random(3)
    for n in (1, 2, 5, 17):
        xs = sorted(rng.uniform(0, 100) for _ in range(n))
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_overall_latencies_by_hand():
    s = summarize(records(), duration=2.0)["overall"]
    assert (s["count"], s["failed"]) == (5, 2)
    # TTFT over ok requests: 100, 200, 300 ms
    approx_pct(s["ttft_ms"], 200, 200, 280, 290, 298, 300)
    # ITL: 100 200 | 100 100 600  -> sorted 100 100 100 200 600
    approx_pct(s["itl_ms"], 220, 100, 440, 520, 584, 600)
    # TPOT: 150 and 800/3 (r2 has one token: none)
    t = 800 / 3
    approx_pct(s["tpot_ms"], (150 + t) / 2, (150 + t) / 2, 150 + 0.9 * (t - 150), 150 + 0.95 * (t - 150),
               150 + 0.99 * (t - 150), t)
    approx_pct(s["e2e_ms"], 1700 / 3, 400, 880, 940, 988, 1000)
    # rates over first send (r1, 0.0) to last completion (r3, 1.5), not the run's 2.0 s
    assert s["output_tok_s"] == pytest.approx((3 + 1 + 4) / 1.5)  # ok requests only
    assert s["goodput_rps"] == pytest.approx(3 / 1.5)  # no SLOs: every ok request


def test_groups_and_edge_cases():
    s = summarize(records(), duration=2.0)
    assert set(s["per_tenant"]) == {"A", "B", "C"} and set(s["per_class"]) == {"short", "long"}
    c = s["per_tenant"]["C"]  # nothing completed: every figure is None, rates are 0
    assert (c["count"], c["failed"], c["output_tok_s"], c["goodput_rps"]) == (1, 1, 0.0, 0.0)
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(c[key].values()) == {None}
    a = s["per_tenant"]["A"]
    approx_pct(a["tpot_ms"], 150, 150, 150, 150, 150, 150)  # r2's single token adds no TPOT
    approx_pct(a["itl_ms"], 150, 150, 190, 195, 199, 200)  # ...and no ITL
    long = s["per_class"]["long"]
    assert (long["count"], long["failed"]) == (3, 2)
    approx_pct(long["itl_ms"], 800 / 3, 100, 500, 550, 590, 600)
    assert long["output_tok_s"] == pytest.approx(4 / 1.5)


def test_goodput_under_slos():
    s = lambda **slos: summarize(records(), 2.0, slos)["overall"]["goodput_rps"]
    # r1 (TTFT 100, TPOT 150) meets both; r2 misses TTFT 250; r3 misses TPOT 200
    assert s(ttft_ms=250, tpot_ms=200) == pytest.approx(1 / 1.5)
    assert s(e2e_ms=350) == pytest.approx(1 / 1.5)  # only r2 (300 ms)
    assert s(tpot_ms=1) == pytest.approx(1 / 1.5)  # only r2: a one-token request has no TPOT to miss
    with pytest.raises(ValueError):
        summarize(records(), 2.0, {"latency_ms": 1})


def test_fairness_by_hand():
    f = summarize(records(), duration=2.0, window=1.0)["fairness"]
    # service = prompt x1 at the first token + 2 per token (failed requests keep what they got)
    # A: r1 10+3*2 = 16, r2 5+2 = 7;  B: r3 20+4*2 = 28, r4 8+2 = 10;  C: 0
    assert f["service"] == pytest.approx({"A": 23, "B": 38, "C": 0})
    # demand uses the requested output: A 16+7, B 28+(8+4*2), C 6+2*2
    assert f["demand"] == pytest.approx({"A": 23, "B": 44, "C": 10})
    assert f["normalized_service"] == pytest.approx({"A": 1.0, "B": 19 / 22, "C": 0.0})
    # Jain over 1, 19/22, 0 = (41/22)^2 / (3 * (1 + (19/22)^2)) = 1681 / 2535
    assert f["jain_index"] == pytest.approx(1681 / 2535)
    # windows (0,1]: A, B, C backlogged; A earned 16, B 22+2+2+10 = 36, C 0 -> gap 36
    #         (1,2]: A (r2) and B (r3) backlogged; A 7, B 2 -> gap 5
    assert f["max_service_gap"] == pytest.approx(36)


def test_water_fill_is_max_min_fair():
    from pdtb.figures.service import water_fill

    assert water_fill(60, [100, 10]) == pytest.approx([50, 10])  # the small claim is met in full
    assert water_fill(30, [100, 100, 5]) == pytest.approx([12.5, 12.5, 5])
    assert water_fill(10, [100, 100]) == pytest.approx([5, 5])


def _whale_and_minnow(minnow_served_at: float):
    """Tenant W: one request (prompt 40, 30 output tokens asked), its first token at 0.1 and one
    token every 0.1 s to 3.0; tenant M: one request (prompt 4, 3 tokens) sent at 0.05, served
    at `minnow_served_at`."""
    whale = make_record("W", "whale", 40, 0.0, [0.1 * (i + 1) for i in range(30)], 3.0)
    m = minnow_served_at
    return [whale, make_record("M", "minnow", 4, 0.05, [m, m + 0.01, m + 0.02], m + 0.02)]


def test_fair_share_index_sees_who_waited():
    """Served at once, the minnow gets its (small) fair share in the first window: 1.0. Made to
    wait behind the whale for 2 s, it earns nothing in two windows in which its claim was
    open and the whale took the whole service; by hand, window (0, 1]: S = 40 + 2 x 10 = 60,
    caps W 100, M 10, fair shares 50 / 10, earned 60 / 0: Jain (1.2, 0) = 0.5."""
    fair = summarize(_whale_and_minnow(0.15), duration=3.0, window=1.0)["fairness"]
    late = summarize(_whale_and_minnow(2.5), duration=3.0, window=1.0)["fairness"]
    assert fair["share_jain_min"] == pytest.approx(1.0) and fair["share_jain_mean"] == pytest.approx(1.0)
    assert late["share_jain_min"] == pytest.approx(0.5)
    assert fair["jain_index"] == pytest.approx(1.0) and late["jain_index"] == pytest.approx(1.0)  # blind to order


def test_a_request_refused_as_invalid_is_no_demand_but_a_refusal_for_load_is():
    """The minnow served at once is fair (1.0); add a whale-tenant request the server refused
    with a 400 in 4 ms: nothing changes. The same refusal as a 503 is demand the server did not
    meet: tenant X's open claim in window (0, 1] earns nothing."""
    def refused(error: str):
        return make_record("X", "whale", 400, 0.2, [], 0.204, "failed", requested=8, error=error)
    base = summarize(_whale_and_minnow(0.15), duration=3.0, window=1.0)["fairness"]
    invalid = summarize(_whale_and_minnow(0.15) + [refused("HTTP 400: too long")], duration=3.0, window=1.0)["fairness"]
    load = summarize(_whale_and_minnow(0.15) + [refused("HTTP 503: no node")], duration=3.0, window=1.0)["fairness"]
    for key in ("share_jain_min", "share_jain_mean", "jain_index", "max_service_gap"):
        assert invalid[key] == pytest.approx(base[key]), key
    assert "X" not in invalid["demand"] and load["demand"]["X"] > 0
    assert load["share_jain_min"] < base["share_jain_min"] and load["jain_index"] < base["jain_index"]


def test_max_service_gap_half_second_windows():
    f = summarize(records(), duration=2.0, window=0.5)["fairness"]
    # (0,.5]: A and C backlogged (B's first request is sent at 0.5): 16 vs 0
    # (.5,1]: only B;  (1,1.5]: A 7 vs B 2;  (1.5,2]: nobody
    assert f["max_service_gap"] == pytest.approx(16)
    weighted = summarize(records(), 2.0, service_weights=ServiceWeights(0.0, 1.0), window=0.5)["fairness"]
    assert weighted["service"] == pytest.approx({"A": 4, "B": 5, "C": 0})
    assert weighted["max_service_gap"] == pytest.approx(3)  # (0,.5]: A got 3 tokens, C none


def test_jain_edge_cases():
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None
    assert jain_index([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)


def test_empty_and_single_tenant():
    s = summarize([], duration=1.0)
    assert s["overall"]["count"] == 0 and s["overall"]["ttft_ms"]["p50"] is None
    assert s["fairness"]["jain_index"] is None and s["fairness"]["max_service_gap"] is None
    one = summarize([make_record("A", "x", 4, 0.0, [0.5], 0.5)], duration=1.0)
    assert one["fairness"]["max_service_gap"] is None  # a gap needs two backlogged tenants
    assert one["fairness"]["jain_index"] == pytest.approx(1.0)
    assert math.isclose(one["overall"]["ttft_ms"]["p99"], 500)


def test_tokens_arriving_together_share_the_gap_before_them():
    """SGLang's convention: a first chunk of 2 tokens, then chunks of 3, 1 and 2 tokens 0.3,
    0.1 and 0.4 s apart: gaps 0.1 x 3, 0.1, 0.2 x 2 (the first chunk's second token adds none)."""
    from pdtb.figures.summary import itls_s

    r = make_record("A", "c", 4, 0.0, [0.5, 0.5, 0.8, 0.8, 0.8, 0.9, 1.3, 1.3], 1.3)
    assert itls_s(r) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.2, 0.2])
    assert sum(itls_s(r)) == pytest.approx(1.3 - 0.5)
    assert itls_s(make_record("A", "c", 4, 0.0, [0.2, 0.2], 0.2)) == []


def test_a_record_without_a_first_token_meets_no_ttft_slo():
    """An ok record with no token (an old results file, or a server that sent nothing) has no
    TTFT: it fails a TTFT SLO; only TPOT may be undefined and pass (one output token)."""
    none = make_record("a", "c", 4, 0.0, [], 5.0)
    one = make_record("a", "c", 4, 0.0, [0.2], 0.3)
    assert not meets_slos(none, {"ttft_ms": 500}) and meets_slos(none, {"e2e_ms": 6000})
    assert meets_slos(one, {"ttft_ms": 500, "tpot_ms": 1})
    s = summarize([none, one], 5.0, {"ttft_ms": 500})["overall"]
    assert s["goodput_rps"] == pytest.approx(1 / 5.0) and s["slo_attainment"] == 0.5


def _timed(tenant, klass, comps, missed=(), cause=None, status="ok"):
    r = make_record(tenant, klass, 4, 0.0, [0.1, 0.2], 0.3, status=status)
    r.server_timing = {"prefill_s": 0.05, "slo": {"components": comps, "missed": list(missed), "cause": cause}}
    return r


def test_slo_attribution_is_summed_by_hand():
    recs = [_timed("w", "whale", {"queue": 0.010, "prefill": 0.090, "turn_wait": 2.0}, ["tpot"], "turn_wait"),
            _timed("w", "whale", {"queue": 0.030, "prefill": 0.110, "turn_wait": 1.0}, ["ttft", "tpot"], "turn_wait"),
            _timed("m", "minnow", {"queue": 0.004, "prefill": 0.002}),
            _timed("m", "minnow", {"queue": 9.0}, ["ttft"], "queue", status="failed"),  # failed: not counted
            make_record("m", "minnow", 4, 0.0, [0.1], 0.2)]  # no timing (a stop string ended it)
    recs[-1].server_timing = {"slo": "garbage"}  # malformed: skipped
    a = summarize(recs, 1.0)["slo_attribution"]
    w, m = a["per_class"]["whale"], a["per_class"]["minnow"]
    assert w["requests"] == 2 and w["missed"] == {"tpot": 2, "ttft": 1} and w["causes"] == {"turn_wait": 2}
    assert w["mean_ms"] == pytest.approx({"queue": 20.0, "prefill": 100.0, "turn_wait": 1500.0})
    assert m == {"requests": 1, "missed": {}, "causes": {}, "mean_ms": pytest.approx({"queue": 4.0, "prefill": 2.0})}
    assert a["overall"]["requests"] == 3 and a["per_tenant"]["w"] == w
    lines = format_lines(a)
    assert lines[0].startswith("  class minnow: 1 attributed, missed none")
    assert "causes turn_wait 2" in lines[1] and "turn_wait 1500.0" in lines[1]
