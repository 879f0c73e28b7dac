"""Every policy, driven step by step with a fake clock and no processes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fairness import POLICIES, FairnessConfig, Placement, eviction, make_policy
from fairness.mcsf import McsfPolicy, feasible
from fairness.memfair_settings import MemFairSettings
from fairness.priority import PriorityPolicy, PrioritySettings
from fairness.vtc import VtcPolicy
from pdtb.engine.sequence import SeqStatus
from sched_sim import (FakeClock, apply_step, check_conservation, make_request, make_scheduler, sim_step,
                       state)


def pages_of_tenant(sched, tenant):
    return sum(len(sched.pool.pages_of(s.request_id)) for s in sched.running if s.tenant == tenant)


def whales_running(policy: str, clock=None):
    """A 40-page pool (80 host pages) where tenant w's two whales (19 pages each) have run
    three steps alone: (the policy, the scheduler, the whales)."""
    pol = make_policy(policy)
    sched = make_scheduler(pol, num_pages=40, host_pages=80, budget=512, clock=clock)
    whales = [make_request(72, 50, tenant="w", arrival=i) for i in range(2)]
    for w in whales:
        sched.add(w)
    for _ in range(3):
        sim_step(sched)
    return pol, sched, whales


def test_memfair_reclaims_borrowed_pages_for_a_returning_tenant():
    _, sched, whales = whales_running("memfair")
    assert pages_of_tenant(sched, "w") > 20  # alone, the whale tenant borrows beyond half
    minnows = [make_request(8, 20, tenant="m", arrival=10 + i) for i in range(3)]
    for m in minnows:
        sched.add(m)
    sim_step(sched)
    check_conservation(sched)
    assert all(m.status == SeqStatus.RUNNING for m in minnows)  # admitted at once
    assert any(w.status == SeqStatus.PARKED for w in whales)  # paid for by the over-quota tenant
    assert pages_of_tenant(sched, "w") <= 20 + 1


@pytest.mark.parametrize("retried_s_ago", [0.0, 2.0])
def test_memfair_reclaims_for_a_held_arrival_only_while_it_is_retried_here(retried_s_ago):
    """A borrower is demoted for an arrival held at prefill while the prefill side retries it
    here; one last retried 2 s ago has landed elsewhere (a fallback took it): demoting for it
    would only bounce the borrower between tiers, step after step."""
    from fairness.base import Arrival

    clock = FakeClock()
    pol, sched, whales = whales_running("memfair", clock)
    assert pages_of_tenant(sched, "w") > 20  # alone, the whale tenant borrows beyond half
    clock.t = 5.0
    pol.held["m1"] = Arrival("m1", "m", 0, 18, 4.0 - retried_s_ago, clock.t - retried_s_ago, 70, 20)
    sim_step(sched)
    check_conservation(sched)
    demoted = any(w.status == SeqStatus.PARKED for w in whales)
    assert demoted == (retried_s_ago == 0.0)


def test_fcfs_makes_minnows_wait_behind_whales():
    _, sched, whales = whales_running("fcfs")
    minnows = [make_request(8, 20, tenant="m", arrival=10 + i) for i in range(3)]
    for m in minnows:
        sched.add(m)
    sim_step(sched)
    check_conservation(sched)
    assert all(w.status == SeqStatus.RUNNING for w in whales)
    assert sum(m.status == SeqStatus.RUNNING for m in minnows) < 3


def test_memfair_quota_blocks_a_tenant_beyond_its_share_when_others_wait():
    pol = make_policy("memfair")
    sched = make_scheduler(pol, num_pages=20, budget=512)
    a1, b1 = make_request(30, 4, tenant="a", arrival=0), make_request(4, 30, tenant="b", arrival=1)
    a2 = make_request(30, 4, tenant="a", arrival=2)
    for r in (a1, b1, a2):
        sched.add(r)
    sim_step(sched)
    # a holds 8 pages of its 10-page share; a2 (8 more) would exceed it while b has work
    assert a1.status == SeqStatus.RUNNING and b1.status == SeqStatus.RUNNING
    assert a2.status == SeqStatus.WAITING


def test_memfair_borrows_leaving_one_typical_request_of_each_other_owner():
    """Pool 40, shares 20 each. While b waits within its share nobody borrows; once it does
    not, a may borrow beyond its 20 but leaves free one typical request of b's (3 pages, its
    12-token prompt), which b's unused share (20 - 2) covers: 35 pages yes, 36 no."""
    pol = make_policy("memfair")
    a, b1, b2 = make_request(40, 4, tenant="a"), make_request(8, 4, tenant="b"), make_request(12, 4, tenant="b")
    b1.num_computed_tokens = 8
    st0 = state({b1.request_id: 2}, device_total=40, device_free=38)
    pol.refresh([b1], [a, b2], st0)
    assert not pol.may_admit(a, 25, st0)
    pol.refresh([b1], [a], st0)  # b2 went elsewhere
    assert not pol.may_admit(a, 36, st0)
    assert pol.may_admit(a, 35, st0)


def test_class_reservation_keeps_pages_for_urgent_requests():
    pol = make_policy("fcfs", FairnessConfig(class_reservations={0: 0.5}))
    low, high = make_request(4, 4, priority=5), make_request(4, 4, priority=0)
    st_ = state(device_total=20, device_free=12)
    pol.reclaim([], [low, high], st_)
    assert not pol.may_admit(low, 4, st_)  # 10 of 12 free pages are reserved for class 0
    assert pol.may_admit(high, 4, st_)


@pytest.mark.parametrize("name, expect", [("lru", "cold"), ("newest", "new"), ("least_progress", "young")])
def test_eviction_victims(name, expect):
    cold, new, young = make_request(rid="cold", arrival=1), make_request(rid="new", arrival=9), make_request(rid="young", arrival=5)
    cold.last_step, new.last_step, young.last_step = 1, 5, 5
    cold.token_ids += [7] * 5
    new.token_ids += [7] * 3
    young.token_ids += [7] * 1
    assert eviction.VICTIMS[name]([cold, new, young], state()).request_id == expect


def test_footprint_victim_is_largest_of_most_over_tenant():
    a_big, a_small, b_big = (make_request(rid=r, tenant=t) for r, t in (("a_big", "a"), ("a_small", "a"), ("b_big", "b")))
    st_ = state(pages={"a_big": 10, "a_small": 2, "b_big": 12})
    assert eviction.footprint([a_big, a_small, b_big], st_, {"a": 1.5, "b": 1.2}).request_id == "a_big"
    assert eviction.footprint([a_big, a_small, b_big], st_, {"a": 0.5, "b": 1.2}).request_id == "b_big"


def test_vtc_counter_lift_for_returning_tenant():
    pol = VtcPolicy()
    pol.counters = {"a": 100.0, "b": 40.0, "c": 5.0}
    pol.active = {"a", "b"}
    pol.lift({"a", "b", "c"})
    assert pol.counters["c"] == 40.0  # lifted to the smallest active counter: no banking of idle time
    pol.counters["c"] = 70.0
    pol.lift({"a", "b", "c"})
    assert pol.counters["c"] == 70.0  # an active tenant is never lifted


def test_vtc_serves_the_smallest_counter_and_charges_tokens():
    pol = VtcPolicy()
    sched = make_scheduler(pol, num_pages=64, budget=16)
    a = make_request(8, 4, tenant="a", arrival=0)
    sched.add(a)
    sim_step(sched)
    assert pol.counters["a"] == 8 * 1.0 + 2.0  # 8 input tokens + the first output token
    b1, a2 = make_request(8, 2, tenant="b", arrival=1), make_request(8, 2, tenant="a", arrival=0.5)
    order = pol.admission_order([a2, b1], sched.state())
    assert order[0] is b1  # b was lifted to a's counter only if a had work; b < a here


def _fits_every_step(items, total, ps) -> bool:
    horizon = max((r for _, r in items), default=0)
    return all(sum(-(-(c + t) // ps) for c, r in items if r >= t) <= total for t in range(horizon + 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.integers(1, 50)), max_size=30), st.integers(1, 400),
       st.sampled_from([1, 4, 7, 16]))
def test_mcsf_fast_feasibility_equals_the_direct_sum(items, total, ps):
    from fairness.mcsf import feasible_direct

    assert feasible(items, total, ps) == feasible_direct(items, total, ps) == _fits_every_step(items, total, ps)


def brute_force_prefix(running, waiting, total, ps):
    """Largest prefix of `waiting` (sorted shortest first) whose memory fits at every time step."""
    def ok(items):
        horizon = max((r for _, r in items), default=0)
        return all(sum(-(-(c + t) // ps) for c, r in items if r >= t) <= total for t in range(horizon + 1))
    best = 0
    for k in range(len(waiting) + 1):
        if ok(running + waiting[:k]):
            best = k
        else:
            break
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), max_size=4),
       st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), max_size=5),
       st.integers(4, 30))
def test_mcsf_admits_the_brute_force_prefix(running, waiting, total):
    ps = 4
    waiting = sorted(waiting, key=lambda x: x[1])
    if not _fits_every_step(running, total, ps):
        return  # the running set itself does not fit (checked by brute force, not by `feasible`)
    pol = McsfPolicy()
    pol.planned = list(running)
    pol.running, pol.candidates = [], []
    admitted = 0
    for c, r in waiting:
        seq = make_request(c, r)
        st = state(device_total=total, device_free=total)
        if not pol.may_admit(seq, 0, st):
            break
        pol.admitted(seq, 0, st)
        admitted += 1
    assert admitted == brute_force_prefix(running, waiting, total, ps)


def test_priority_aging_prevents_starvation():
    clock = FakeClock()
    pol = PriorityPolicy(FairnessConfig(), PrioritySettings(aging_s=1.0))
    low = make_request(4, 4, priority=5, arrival=0.0)
    high = make_request(4, 4, priority=0, arrival=9.0)
    clock.t = 10.0
    assert pol.admission_order([low, high], state(now=clock.t))[0] is low  # waited 10 s: boosted past class 0


def test_priority_rows_of_one_class_go_in_arrival_order_not_by_turns():
    """Aging by fractions of a class would put the row served last behind its equals: prompts
    of one class whose chunks fill the step budget would take turns, each holding its pages
    until all are done (a disaggregated run's prefill node: 551 steps where fcfs takes 142).
    Whole classes keep arrival order until a row has waited aging_s (2 s)."""
    from pdtb.engine.scheduler import ScheduledChunk

    pol = make_policy("priority")
    first, second = make_request(256, 2, arrival=0.0), make_request(256, 2, arrival=0.001)
    pol.refresh([first, second], [], state(now=0.99))
    pol.on_step([ScheduledChunk(second, 64)], state(now=0.99))
    pol.on_step([ScheduledChunk(first, 64)], state(now=1.0))
    assert pol.step_order([second, first], state(now=1.01)) == [first, second]
    pol.on_step([ScheduledChunk(first, 64)], state(now=3.0))  # second passed over for 2.5 s: a class up
    assert pol.step_order([first, second], state(now=3.5)) == [second, first]


OPS = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(1, 60), st.integers(1, 30),
                         st.sampled_from("abc")), min_size=1, max_size=40)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=25, deadline=None)
@given(ops=OPS)
def test_page_conservation_under_random_operations(name, ops):
    sched = make_scheduler(make_policy(name), num_pages=24, host_pages=12, budget=32, max_num_seqs=6)
    live = []
    for i, (op, plen, mt, tenant) in enumerate(ops):
        if op == "add":
            r = make_request(plen % 40 + 1, mt, tenant=tenant, arrival=float(i))
            try:
                sched.add(r)
                live.append(r)
            except ValueError:
                pass
        elif op == "abort" and live:
            sched.abort(live.pop(plen % len(live)).request_id)
        else:
            sim_step(sched)
        check_conservation(sched)
    for _ in range(2000):
        if not sched.has_work():
            break
        sim_step(sched)
        check_conservation(sched)
    assert not sched.has_work(), "every request must finish"
    assert sched.pool.num_free == 24 and sched.host_pool.num_free == 12


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_held_arrival_is_admitted_once_pages_free_up(name):
    """A deferred arrival must not queue behind its own earlier offer."""
    from fairness.interface import Arrival

    pol = make_policy(name)
    full = state(device_total=40, device_free=2)
    assert pol.place_arrival(Arrival("w", "whale", 0, 30, 0.0, 0.0), 0, full) is Placement.DEFER
    minnow = pol.place_arrival(Arrival("m", "minnow", 0, 1, 1.0, 1.0), 0, full)
    assert minnow in (Placement.DEVICE, Placement.DEFER)
    free = state(device_total=40, device_free=40, now=2.0)
    assert pol.place_arrival(Arrival("w", "whale", 0, 30, 2.0, 2.0), 0, free) is Placement.DEVICE
    assert "w" not in pol.held


def _whale_prefilling_then_minnows(policy, minnows: int):
    """Factory: a scheduler (1,000 pages of 4 tokens, budget 512) whose whale (tenant w, a
    2,000-token prompt) had one step alone, and `minnows` 40-token prompts of tenant m added."""
    sched = make_scheduler(policy, num_pages=1000, budget=512, max_num_seqs=100)
    whale = make_request(2000, 4, tenant="w")
    sched.add(whale)
    sim_step(sched)
    assert whale.num_computed_tokens == 512  # alone, the whole step is its own
    ms = [make_request(40, 4, tenant="m", arrival=1.0 + i) for i in range(minnows)]
    for m in ms:
        sched.add(m)
    return sched, whale, ms


@pytest.mark.parametrize("minnows, whale_chunk", [(3, 392), (20, 64)])
def test_memfair_splits_the_step_lightest_owner_first_above_a_floor(minnows, whale_chunk):
    """By hand, budget 512, owners w (1,488 prompt tokens left, 128 pages held) and m (40 per
    prompt, none held). Max-min split: m wants 120 of its 256 with 3 prompts, so w's share is
    392; with 20 prompts (800 wanted) both shares are 256. The floor is a quarter of each
    share; the rest goes to m first (it holds less memory), then to w. 3 prompts: m 120, w
    64 + ... = 392. 20 prompts: w keeps its floor of 64, m takes the other 448 (11 whole prompts
    and 8 tokens of a 12th). fcfs gives the whale the whole step."""
    sched, whale, ms = _whale_prefilling_then_minnows(make_policy("memfair"), minnows)
    out = sched.schedule()
    got = {c.seq.request_id: c.num_new_tokens for c in out.chunks}
    assert got[whale.request_id] == whale_chunk
    assert sum(n for r, n in got.items() if r != whale.request_id) == 512 - whale_chunk
    check_conservation(sched)
    sched, whale, ms = _whale_prefilling_then_minnows(make_policy("fcfs"), minnows)
    out = sched.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(whale, 512)]


def test_memfair_gives_a_lone_owner_the_whole_step_and_decode_rows_their_token():
    """With one owner prefilling there is nothing to split; decode rows of another owner take
    a token each out of the step, and the prompt the rest."""
    sched, whale, ms = _whale_prefilling_then_minnows(make_policy("memfair"), 1)
    sim_step(sched)  # the minnow's 40 tokens and the whale's 472
    assert ms[0].num_output_tokens == 1 and not ms[0].in_prefill
    out = sched.schedule()
    got = {c.seq.request_id: c.num_new_tokens for c in out.chunks}
    assert got == {ms[0].request_id: 1, whale.request_id: 511}


def test_water_fill_by_hand():
    """a wants 100, b and c 1,000, weights 1, 1, 2, 900 to split: a quarter each for a and b
    and half for c would be 225/225/450; a takes its 100, and the 800 left go 1:2 to b and c."""
    from fairness.quotas import water_fill

    got = water_fill({"a": 100, "b": 1000, "c": 1000}, {"a": 1, "b": 1, "c": 2}, 900)
    assert got == pytest.approx({"a": 100, "b": 800 / 3, "c": 1600 / 3})
    assert water_fill({"a": 10, "b": 20}, {"a": 1, "b": 1}, 100) == {"a": 10, "b": 20}  # all sated
    assert water_fill({"a": 0, "b": 5}, {"a": 1, "b": 1}, 4) == {"b": 4}


def test_memfair_victim_loses_the_least_work_or_demotes_the_largest():
    """The most over-share owner gives pages back. Without a host tier its request with the
    fewest computed tokens is dropped (a recompute redoes them); with room in the host tier its
    largest footprint is demoted (no work lost)."""
    pol = make_policy("memfair")
    # big is the oldest: without a host tier the progress guarantee spares it a recompute, with
    # one it may be demoted (arrivals apart, so that the oldest does not hang on request ids)
    big, small = make_request(60, 4, tenant="w", arrival=0.0), make_request(20, 4, tenant="w", arrival=1.0)
    big.num_computed_tokens, small.num_computed_tokens = 60, 20
    other = make_request(8, 4, tenant="m", arrival=2.0)
    other.num_computed_tokens = 8
    pages = {big.request_id: 15, small.request_id: 5, other.request_id: 2}
    no_host = state(pages, device_total=24, device_free=2)
    pol.refresh([big, small, other], [], no_host)
    assert pol.over["t:w"] > pol.over["t:m"]
    assert pol.pick_victim([big, small, other], other, no_host) is small
    host = state(pages, device_total=24, device_free=2, host_total=40, host_free=40)
    pol.refresh([big, small, other], [], host)
    assert pol.pick_victim([big, small, other], other, host) is big


def test_memfair_prompt_chunk_waits_rather_than_drop_computed_work():
    """Nobody can be demoted (no host tier): a decode row that cannot grow drops the least work,
    but a prompt's next chunk waits (None) while someone decodes, unless it is the oldest."""
    pol = make_policy("memfair")
    old = make_request(40, 8, tenant="w", arrival=0.0)
    old.num_computed_tokens = 40
    old.token_ids.append(7)  # decoding
    mid = make_request(64, 4, tenant="w", arrival=1.0)
    mid.num_computed_tokens = 32  # half its prompt
    late = make_request(64, 4, tenant="w", arrival=2.0)
    late.num_computed_tokens = 16
    pages = {old.request_id: 3, mid.request_id: 2, late.request_id: 1}
    st_ = state(pages, device_total=6, device_free=0)
    running = [old, mid, late]
    pol.refresh(running, [], st_)
    assert pol.pick_victim([old, late], mid, st_) is None  # mid's chunk waits
    assert pol.pick_victim([mid, late], old, st_) is late  # a decode row: the least work goes
    pol.refresh([mid, late], [], st_)  # nobody decodes: waiting could last forever
    assert pol.pick_victim([late], mid, st_) is late
    pol.refresh(running, [], state(pages, device_total=6, device_free=0, host_total=8, host_free=8))
    assert pol.pick_victim([old, late], mid, state(pages, device_total=6, device_free=0, host_total=8,
                                                   host_free=8)) is not None  # demotable: no work lost


def _redone_prompt_tokens(policy: str, pages: int, budget: int, tenants: str) -> int:
    sched = make_scheduler(make_policy(policy), num_pages=pages, budget=budget)
    reqs = [make_request(40, 6, tenant=t, arrival=float(i)) for i, t in enumerate(tenants)]
    for r in reqs:
        sched.add(r)
    prefilled = 0
    for _ in range(500):
        if not sched.has_work():
            break
        out = sched.schedule()
        prefilled += sum(c.num_new_tokens for c in out.chunks if c.seq.in_prefill)
        apply_step(sched, out)
        check_conservation(sched)
    assert not sched.has_work() and all(r.num_output_tokens == 6 for r in reqs)  # every request ends
    return prefilled - sum(r.num_prompt_tokens for r in reqs)


def test_memfair_admits_no_more_than_the_prompts_growth_leaves_room_for():
    """A pool too small for everyone at once and no host tier: fcfs admits prompts by their first
    chunk and drops one for recompute when the running prompts grow into each other (40 prompt
    tokens redone here); memfair counts what the running prompts, and the candidate's own, still
    take before a borrower is let in, and a borrower's prompt does not grow into the pages a
    request within its share waits for: nothing is redone, and every request still ends."""
    assert _redone_prompt_tokens("fcfs", 16, 8, "wmwmwm") == 40
    assert _redone_prompt_tokens("memfair", 16, 8, "wmwmwm") == 0
    assert _redone_prompt_tokens("memfair", 16, 8, "wwwwww") == 0


def test_vtc_idle_time_is_not_banked_when_everyone_returns_at_once():
    """Tenant b was served a little long ago, a a lot since; after a moment with no work both
    return in the same step. b must be lifted to where a stood, not be served first for its
    whole backlog (banked, all 30 of b's requests would go before any of a's)."""
    from fairness.vtc import VtcPolicy

    pol = VtcPolicy()
    sched = make_scheduler(pol, num_pages=400, budget=64, max_num_seqs=1)  # one at a time: pure order
    sched.add(make_request(8, 2, tenant="b", arrival=0.0))
    while sched.has_work():
        sim_step(sched)
    for i in range(20):
        sched.add(make_request(8, 20, tenant="a", arrival=1.0 + i))
    while sched.has_work():
        sim_step(sched)
    sim_step(sched)  # a step with no work at all
    for i in range(10):
        sched.add(make_request(8, 2, tenant="a", arrival=100.0 + i))
        sched.add(make_request(8, 2, tenant="b", arrival=100.5 + i))
    order = []
    while sched.has_work():
        out = sched.schedule()
        order += [c.seq.tenant for c in out.chunks if c.seq.num_computed_tokens == 0]
        apply_step(sched, out)
    # b is lifted to where a's counter stood when a's queue last emptied (the paper's l): a's
    # last request then ran alone, 8 + 20 x 2 = 48 units, and b (12 a request) is owed those
    # 4 requests, no more (before the lift existed: all 10 of b's before any of a's)
    assert order[:5] == list("bbbba"), "".join(order)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), max_size=3),
       st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=5),
       st.integers(8, 40))
def test_mcsf_through_the_scheduler_admits_the_brute_force_prefix(running, waiting, total):
    """The same check through a real scheduler step, with requests already running and
    holding pages (the base watermark must not shrink MC-SF's admitted set)."""
    ps = 4
    sched = make_scheduler(McsfPolicy(), num_pages=total, budget=4096)
    run_items = []
    for j, (plen, left) in enumerate(running):
        s = make_request(plen, left + 1, rid=f"R{j}", arrival=float(j))
        s.num_computed_tokens = plen
        s.token_ids.append(7)  # decoding, one output token so far
        if sched.pool.allocate(s.request_id, -(-(plen + 1) // ps)) is None:
            break
        sched.add_running(s)
        run_items.append((s.num_tokens, left))
    if not feasible(run_items, total, ps):
        return
    seqs = []
    for j, (plen, mt) in enumerate(waiting):
        s = make_request(plen, mt, rid=f"W{j}", arrival=10.0 + j)
        try:
            sched.add(s)
        except ValueError:  # never fits this pool
            continue
        seqs.append(s)
    order = sorted(seqs, key=lambda s: (s.params.max_tokens, s.arrival_time))
    want = brute_force_prefix(run_items, [(s.num_tokens, s.params.max_tokens) for s in order], total, ps)
    out = sched.schedule()
    got = {c.seq.request_id for c in out.chunks if c.seq.request_id.startswith("W")}
    assert got == {s.request_id for s in order[:want]}


@pytest.mark.parametrize("victim, expect", [("lru", "cold"), ("newest", "young"), ("least_progress", "fresh"),
                                            ("footprint", "whale")])
def test_each_victim_choice_can_be_selected(victim, expect):
    """--victim swaps the eviction choice of any policy; every choice, newest and
    least_progress included, is reachable."""
    pol = make_policy("fcfs", FairnessConfig(victim=victim))
    reqs = {"cold": make_request(8, 9, tenant="a", arrival=1.0), "young": make_request(8, 9, tenant="a", arrival=9.0),
            "fresh": make_request(8, 9, tenant="a", arrival=2.0), "whale": make_request(80, 9, tenant="w", arrival=3.0)}
    for name, s in reqs.items():
        s.last_step = {"cold": 1, "young": 5, "fresh": 6, "whale": 7}[name]
        s.token_ids += [7] * {"cold": 3, "young": 2, "fresh": 0, "whale": 4}[name]
    pages = {reqs["cold"].request_id: 2, reqs["young"].request_id: 2, reqs["fresh"].request_id: 2,
             reqs["whale"].request_id: 30}
    st = state(pages=pages, device_total=40)
    pol.reclaim([], [], st)
    oldest = make_request(4, 4, arrival=0.0)  # the progress guarantee spares it; it is not a candidate here
    pol.running = [oldest, *reqs.values()]
    assert pol.pick_victim(list(reqs.values()), reqs["cold"], st) is reqs[expect]


@pytest.mark.parametrize("name", POLICIES)
def test_the_bandwidth_cap_holds_for_admissions_too(name):
    """A capped tenant with a deep backlog reads at most cap x time plus one window of burst,
    counting the reads of newly admitted prompts (filtering only running rows, and only once
    already over, lets it read 103x the cap)."""
    from sched_sim import FakeClock, SPEC

    page = SPEC.bytes_per_page
    cap, window = 4 * page, 1.0  # 4 pages a second
    clock = FakeClock()
    sched = make_scheduler(make_policy(name, FairnessConfig(tenant_bw_cap=cap, bw_window_s=window)),
                           num_pages=400, budget=512, max_num_seqs=400, clock=clock)
    for i in range(200):
        sched.add(make_request(40, 5, tenant="a", arrival=i * 1e-3))  # 10-11 pages each: a row exceeds a window
    read = 0
    seconds = 10.0
    for i in range(100):
        clock.t = i * 0.1
        out = sched.schedule()
        read += sum(len(sched.pool.pages_of(c.seq.request_id)) * page for c in out.chunks)
        apply_step(sched, out)
    assert read <= cap * seconds + 11 * page  # the cap, plus one row of burst
    assert read >= cap * seconds * 0.5  # and it does progress


def test_vtc_lift_floor_is_the_smallest_counter_among_tenants_with_waiting_work():
    """The reference lifts a tenant whose queue becomes non-empty to the smallest counter among
    tenants with waiting work. Counting running requests too, a tenant with one long request
    running would set a low floor, and its own new burst would never be lifted: 150 requests of
    the returning tenants would go before the backlogged tenant's next one. It is served within
    a few admissions."""
    from fairness.vtc import VtcPolicy

    pol = VtcPolicy()
    sched = make_scheduler(pol, num_pages=400, budget=64, max_num_seqs=2)
    sched.add(make_request(8, 1000, tenant="r", arrival=0.0, rid="r-long"))  # one long request, nothing queued
    for i in range(300):
        sched.add(make_request(8, 2, tenant="a", arrival=0.1 + i * 1e-3, rid=f"a{i}"))  # a's backlog
    for _ in range(300):
        apply_step(sched, sched.schedule())
    for i in range(100):  # c returns with a burst; r (running, its queue empty) sends one too
        sched.add(make_request(8, 2, tenant="c", arrival=100 + i * 1e-3, rid=f"c{i}"))
        sched.add(make_request(8, 2, tenant="r", arrival=100.0005 + i * 1e-3, rid=f"r{i}"))
    order = []
    for _ in range(60):
        out = sched.schedule()
        order += [c.seq.tenant for c in out.chunks if c.seq.num_computed_tokens == 0]
        apply_step(sched, out)
    assert "a" in order[:3], "".join(order)
    assert abs(order[:60].count("a") - order[:60].count("c")) <= 3, "".join(order)
