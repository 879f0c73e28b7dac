"""The literature's baselines, each replaying its rule on a small example computed by hand:
deficit round robin over classes (fairness/drr.py) and the memory-time counter
(fairness/memtime.py)."""
from __future__ import annotations

from fairness.drr import DrrPolicy, DrrSettings, Ring
from fairness.memtime import MemTimePolicy
from pdtb.engine.sched_policy import SchedState
from sched_sim import make_request


def state(now=0.0, pages=None, host_pages=None, free=1000):
    return SchedState(now, 0, 4, 64, 1000, free, 100, 100, pages or {}, host_pages or {})


def test_drr_orders_classes_by_deficit_round_robin():
    """quantum 100; class 0 asks 150 then 50 tokens, class 1 three times 60.
    Turn 1, class 0: deficit 100 < 150, nothing. Class 1: 100, admits 60 (40 left), 60 > 40.
    Turn 2, class 0: 200, admits 150 and 50 (0 left, queue empty: leaves). Class 1: 140, admits
    60 and 60 (20 left, empty). Order: 1a, 0a, 0b, 1b, 1c."""
    pol = DrrPolicy(settings=DrrSettings(quantum=100))
    c0 = [make_request(150, priority=0, arrival=0.0, rid="0a"), make_request(50, priority=0, arrival=1.0, rid="0b")]
    c1 = [make_request(60, priority=1, arrival=2.0 + i, rid=f"1{'abc'[i]}") for i in range(3)]
    order = pol.admission_order([*c1, *c0], state())
    assert [s.request_id for s in order] == ["1a", "0a", "0b", "1b", "1c"]


def test_drr_resumes_the_rounds_where_admission_stopped():
    """Only 1a and 0a fit this step: the state is class 0 up, already topped, deficit 50, and
    class 1 with 40. The next step continues the same play: 0b, then 1b and 1c."""
    pol = DrrPolicy(settings=DrrSettings(quantum=100))
    reqs = {r: make_request(n, priority=p, arrival=a, rid=r)
            for r, n, p, a in (("0a", 150, 0, 0.0), ("0b", 50, 0, 1.0), ("1a", 60, 1, 2.0), ("1b", 60, 1, 3.0),
                               ("1c", 60, 1, 4.0))}
    pol.admission_order(list(reqs.values()), state())
    for rid in ("1a", "0a"):  # as the scheduler asks: may_admit (no side effect), then admitted on a yes
        assert pol.may_admit(reqs[rid], 1, state())
        pol.admitted(reqs[rid], 1, state())
    assert pol.ring == Ring((0, 1), ((0, 50), (1, 40)), True)
    rest = pol.admission_order([reqs["0b"], reqs["1b"], reqs["1c"]], state())
    assert [s.request_id for s in rest] == ["0b", "1b", "1c"]


def test_drr_charges_parked_requests_nothing():
    pol = DrrPolicy(settings=DrrSettings(quantum=10))
    parked = make_request(500, priority=0, arrival=0.0, rid="p")
    parked.num_computed_tokens = 500
    big = make_request(500, priority=1, arrival=1.0, rid="w")
    assert [s.request_id for s in pol.admission_order([big, parked], state())] == ["p", "w"]


def test_memtime_charges_page_seconds_and_admits_the_least_charged():
    """a holds 8 pages, b 2. Steps at t=0 (nothing to charge yet), 0.5 and 1.5 s: a is charged
    8 x 0.5 + 8 x 1.0 = 12 page-seconds, b 2 x 1.5 = 3. b's waiting request goes first, though
    a's arrived earlier; the largest counter's newest request is the victim."""
    pol = MemTimePolicy()
    ra, rb = make_request(32, tenant="a", rid="ra"), make_request(8, tenant="b", rid="rb")
    for s in (ra, rb):
        s.num_computed_tokens = s.num_tokens
    wa, wb = make_request(4, tenant="a", arrival=0.0, rid="wa"), make_request(4, tenant="b", arrival=1.0, rid="wb")
    pages = {"ra": 8, "rb": 2}
    for now in (0.0, 0.5, 1.5):
        st = state(now, pages)
        pol.reclaim([ra, rb], [wa, wb], st)
        pol.on_step([], st)
    assert pol.counters == {"a": 12.0, "b": 3.0}
    assert [s.request_id for s in pol.admission_order([wa, wb], state(1.5, pages))] == ["wb", "wa"]
    assert pol.choose_victim([ra, rb], wb, state(1.5, pages)).request_id == "ra"


def test_memtime_lifts_a_returning_tenant_to_the_floor():
    """c, new with waiting work while a (12) and b (3) wait, starts at the smallest of theirs: 3."""
    pol = MemTimePolicy()
    pol.counters = {"a": 12.0, "b": 3.0}
    pol.active = {"a", "b"}
    waiting = [make_request(4, tenant=t, rid=f"w{t}") for t in "abc"]
    pol.reclaim([], waiting, state(2.0))
    assert pol.counters["c"] == 3.0


def dlpm_state(hits=None, now=0.0):
    hits = hits or {}
    return SchedState(now, 0, 4, 64, 1000, 1000, 0, 0, {}, {}, cached_pages=lambda s: hits.get(s.request_id, 0))


def test_dlpm_admits_within_deficits_longest_prefix_first():
    """quantum 50, weights 1. A waits with a1 (50 tokens, 0 cached) and a2 (50, 0 cached), B with
    b1 (50, 0 cached), b2 (40 tokens, 8 of them in 2 cached pages), arriving a1, a2, b1, b2.
    Nobody has deficit: both gain 50. LPM picks b2 (2 pages): B 50 - 32 = 18. Then a1 (ties by
    arrival): A 0. A may not go; b1: B 18 - 50 = -32. Nobody may: both gain 50 (A 50, B 18):
    a2, A 0. Order b2, a1, b1, a2 (FCFS would be a1, a2, b1, b2)."""
    from fairness.dlpm import DlpmPolicy, DlpmSettings

    pol = DlpmPolicy(settings=DlpmSettings(quantum=50, input_weight=1, output_weight=1))
    reqs = [make_request(n, tenant=t, arrival=a, rid=r)
            for r, n, t, a in (("a1", 50, "a", 0.0), ("a2", 50, "a", 1.0), ("b1", 50, "b", 2.0), ("b2", 40, "b", 3.0))]
    st = dlpm_state({"b2": 2})
    assert [s.request_id for s in pol.admission_order(reqs, st)] == ["b2", "a1", "b1", "a2"]
    # b2 and a1 admitted: their charges are committed, the rest is not
    for s in (reqs[3], reqs[0]):  # as the scheduler asks: may_admit, then admitted on a yes
        assert pol.may_admit(s, 1, st)
        pol.admitted(s, 1, st)
    assert pol.deficit == {"a": 0.0, "b": 18.0}


def test_dlpm_charges_generated_tokens():
    """Two tokens generated for a's request at output weight 2: a's counter falls by 4."""
    from fairness.dlpm import DlpmPolicy
    from pdtb.engine.scheduler import ScheduledChunk

    pol = DlpmPolicy()
    seq = make_request(4, tenant="a", rid="x")
    seq.num_computed_tokens = 3
    for _ in range(2):
        pol.on_step([ScheduledChunk(seq, 1)], dlpm_state())
    assert pol.deficit == {"a": -4.0}
