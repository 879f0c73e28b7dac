"""Liveness under memory pressure: every policy drains every workload, no request is preempted
forever, and reclaim never throws computed KV away."""
from __future__ import annotations

import random

import pytest

from fairness import POLICIES, FairnessConfig, Placement, make_policy
from fairness.config import QUOTA_BY
from fairness.memfair import MemFairPolicy
from fairness.memfair_settings import QUOTA_SHARES, MemFairSettings
from fairness.priority import PriorityPolicy, PrioritySettings
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from sched_sim import FakeClock, apply_step, check_conservation, make_request, make_scheduler, sim_step


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_two_requests_that_fit_one_at_a_time_both_finish(name):
    """16 pages, no host tier; each request fits alone (14 and 12 pages at their longest), not
    together. They must not preempt each other in turn forever (a livelock: 3000 steps, ~300
    preemptions each)."""
    a = make_request(31, 24, tenant="a", arrival=6.0, rid="a")
    b = make_request(20, 28, tenant="b", arrival=9.0, rid="b")
    _run_pair(make_policy(name), a, b, name)


def _run_pair(policy, a, b, name: str) -> None:
    """`a` arrives at step 6 and `b` at step 9 on 16 pages with no host tier; both must finish
    (24 and 28 tokens) within 400 steps with at most two preemptions between them."""
    sched = make_scheduler(policy, num_pages=16, budget=64)
    for i in range(400):
        if i == 6:
            sched.add(a)
        if i == 9:
            sched.add(b)
        apply_step(sched, sched.schedule())
        check_conservation(sched)
        if i > 9 and not sched.has_work():
            break
    assert not sched.has_work(), f"{name}: not drained after 400 steps"
    assert a.num_output_tokens == 24 and b.num_output_tokens == 28
    assert a.num_preemptions + b.num_preemptions <= 2


def _random_run(name: str, seed: int, cfg: FairnessConfig | None = None, args: tuple = ()):
    rng = random.Random(seed)
    sched = make_scheduler(make_policy(name, cfg, args), num_pages=rng.choice([16, 24, 40]),
                           host_pages=rng.choice([4, 12, 40]), budget=rng.choice([8, 32, 64]),
                           max_num_seqs=rng.choice([3, 8]))
    for i in range(120):
        op = rng.random()
        if op < 0.3:
            r = make_request(rng.randint(1, 40), rng.randint(1, 20), tenant=rng.choice("abc"),
                             priority=rng.randint(0, 2), arrival=float(i), slo_tier=("", "gold", "std")[i % 3])
            try:
                sched.add(r)
            except ValueError:  # can never fit this pool
                pass
        elif op < 0.4 and sched.all_requests():
            live = sched.all_requests()
            pick = [s for s in live if s.status == SeqStatus.PARKED or s.num_preemptions] or live
            sched.abort(rng.choice(pick).request_id)
        else:
            sim_step(sched)
        check_conservation(sched)
    return sched


def _drains(name: str, seeds: range, cfg: FairnessConfig | None = None, args: tuple = ()) -> list:
    """(seed, most preemptions) of the random runs not drained in 3000 steps (`args`: the
    policy's own settings, (key, value) pairs)."""
    stuck = []
    for seed in seeds:
        sched = _random_run(name, seed, cfg, args)
        for _ in range(3000):
            if not sched.has_work():
                break
            sim_step(sched)
            check_conservation(sched)
        if sched.has_work():
            stuck.append((seed, max(s.num_preemptions for s in sched.all_requests())))
    return stuck


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_drains_random_pressure(name):
    """Random arrivals, aborts (of parked and preempted requests too) and steps on small pools
    with small host tiers and step budgets; then no more arrivals: everything must finish.
    Before the fix memfair failed to drain 51 of 120 such seeds in 3000 steps."""
    stuck = _drains(name, range(24))
    assert not stuck, f"{name}: (seed, most preemptions) not drained in 3000 steps: {stuck}"


@pytest.mark.parametrize("shares", QUOTA_SHARES)
@pytest.mark.parametrize("quota_by", QUOTA_BY)
def test_memfair_drains_random_pressure_under_every_quota_owner(quota_by, shares):
    """The same under memfair keyed by each quota owner, with dynamic and static shares (the
    scheduler's clock stands still here: a static share never leaves its window)."""
    stuck = _drains("memfair", range(8), FairnessConfig(quota_by=quota_by), (("quota_shares", shares),))
    assert not stuck, f"{quota_by}/{shares}: (seed, most preemptions) not drained in 3000 steps: {stuck}"


@pytest.mark.parametrize("shares", QUOTA_SHARES)
@pytest.mark.parametrize("quota_by", QUOTA_BY)
def test_memfair_two_requests_that_fit_one_at_a_time_finish_under_every_quota_owner(quota_by, shares):
    a = make_request(31, 24, tenant="a", priority=0, arrival=6.0, rid="a", slo_tier="gold")
    b = make_request(20, 28, tenant="b", priority=1, arrival=9.0, rid="b")
    _run_pair(MemFairPolicy(FairnessConfig(quota_by=quota_by), MemFairSettings(quota_shares=shares)), a, b,
              f"memfair {quota_by} {shares}")


def _whale_borrowing_then_minnow(host_pages: int):
    """Factory: memfair on 32 device pages; a whale that prefilled 4 steps alone (borrowing most
    of the pool), then a minnow of another tenant added. Returns (scheduler, whale)."""
    sched = make_scheduler(make_policy("memfair"), num_pages=32, host_pages=host_pages, budget=64)
    whale = make_request(100, 20, tenant="w", arrival=0.0, rid="whale")
    sched.add(whale)
    for _ in range(4):
        sim_step(sched)
    sched.add(make_request(40, 4, tenant="m", arrival=1.0, rid="minnow"))
    return sched, whale


def test_memfair_reclaim_drops_no_more_than_was_lent():
    """With the host tier full, a returning under-share tenant cannot have the borrower demoted,
    and dropping it would take back more than it borrowed (the whale's tenant would be left
    below its share, and reclaim in turn): the borrower keeps its pages (and its computed KV)
    and the newcomer waits for free pages."""
    sched, whale = _whale_borrowing_then_minnow(host_pages=4)
    assert sched.pool.num_held("whale") >= 26  # borrowed most of the pool
    out = sched.schedule()
    assert not [m for m in out.moves if m.kind == "preempt"] and whale.num_preemptions == 0
    apply_step(sched, out)
    check_conservation(sched)


@pytest.mark.parametrize("drop", ["any", "off"])
def test_memfair_without_a_host_tier_drops_a_borrower_for_a_waiter_within_its_share(drop):
    """No host tier; tenant w borrows with three streams of 10 pages (30 of 32, its share 16 once
    m is here). m's request within its share takes one of w's back by recompute under
    reclaim_drop=any (w keeps 20 >= 16) and gets in at once; under off it waits for free pages."""
    pol = MemFairPolicy(settings=MemFairSettings(reclaim_drop=drop))
    sched = make_scheduler(pol, num_pages=32, budget=64)
    ws = []
    for k in range(3):
        s = make_request(36, 30, tenant="w", rid=f"w{k}", arrival=float(k))
        s.num_computed_tokens = 36
        s.token_ids.append(7)
        sched.pool.allocate(s.request_id, 10)
        sched.add_running(s)
        ws.append(s)
    m = make_request(16, 4, tenant="m", arrival=10.0, rid="m")
    sched.add(m)
    out = sched.schedule()
    dropped = [mv.request_id for mv in out.moves if mv.kind == "preempt"]
    if drop == "any":
        assert len(dropped) == 1 and m.status == SeqStatus.RUNNING
    else:
        assert not dropped and m.status != SeqStatus.RUNNING
    apply_step(sched, out)
    check_conservation(sched)
    for _ in range(400):  # every request ends, the dropped one recomputed
        if not sched.has_work():
            break
        sim_step(sched)
    assert not sched.has_work() and all(s.num_output_tokens == 30 for s in ws)


@pytest.mark.parametrize("host_pages", [0, 32])
def test_memfair_without_a_host_tier_lets_a_prompt_in_only_with_room_for_all_of_it(host_pages):
    """16 pages of 4 tokens, a budget of 16 tokens. a's 32-token prompt (8 pages) runs alone;
    b's (8 pages too, within its share of 8) arrives after a's first chunk. Without a host tier
    8 + 1 (a's next token) + 4 (what a's prompt, within its share, still takes) > 12 free: b
    waits, and a's prompt takes a chunk every step until it is in. With a host tier b gets in on
    its first chunk."""
    sched = make_scheduler(make_policy("memfair"), num_pages=16, host_pages=host_pages, budget=16)
    a = make_request(32, 4, tenant="a", rid="a", arrival=0.0)
    sched.add(a)
    apply_step(sched, sched.schedule())
    b = make_request(32, 4, tenant="b", rid="b", arrival=1.0)
    sched.add(b)
    out = sched.schedule()
    assert (b.status == SeqStatus.RUNNING) == bool(host_pages)
    while not host_pages and a.num_computed_tokens < a.num_prompt_tokens:
        before = a.num_computed_tokens
        apply_step(sched, out)
        check_conservation(sched)
        assert a.num_computed_tokens > before and b.status != SeqStatus.RUNNING
        out = sched.schedule()
    apply_step(sched, out)
    for _ in range(200):  # every request ends
        if not sched.has_work():
            break
        sim_step(sched)
        check_conservation(sched)
    assert not sched.has_work() and a.num_output_tokens == b.num_output_tokens == 4


def test_a_request_demoted_for_another_is_not_promoted_in_the_same_step():
    sched, _ = _whale_borrowing_then_minnow(host_pages=64)
    for _ in range(6):
        out = sched.schedule()
        demoted = {m.request_id for m in out.moves if m.kind == "demote"}
        promoted = {m.request_id for m in out.moves if m.kind == "promote"}
        assert not demoted & promoted
        apply_step(sched, out)
        check_conservation(sched)


def test_memfair_reclaims_enough_for_the_request_it_reclaims_for():
    """Reclaim plans with may_admit's own test (the page per running request, the cap), so one
    step frees enough: demoting one borrower per step frees too few pages for the newcomer
    each time once the running rows have grown (6 steps of waiting, 3 demotions)."""
    sched = make_scheduler(make_policy("memfair"), num_pages=20, host_pages=40, budget=64)
    for k in range(6):  # tenant a: six decoding requests of 3 pages (18 of 20; its share is 10)
        s = make_request(11, 30, tenant="a", rid=f"a{k}", arrival=float(k))
        s.num_computed_tokens = 11
        s.token_ids.append(7)
        sched.pool.allocate(s.request_id, 3)
        sched.add_running(s)
    b = make_request(16, 4, tenant="b", rid="b", arrival=10.0)  # 4 pages, well within b's share
    sched.add(b)
    out = sched.schedule()
    assert b.status == SeqStatus.RUNNING, [(m.request_id, m.kind) for m in out.moves]
    apply_step(sched, out)
    check_conservation(sched)


# ---- starvation cases ---------------------------------------------------------------------------
def _trickle_of_b(sched, clock, big, steps: int, limit: int, **b_kw) -> int:
    """Step `sched` while tenant b always has work (up to `limit` requests of its own at once);
    return the step at which `big` finished (or `steps` if it did not)."""
    k = 0
    for step in range(steps):
        clock.t = step * 0.05
        if sum(s.tenant == "b" for s in sched.all_requests()) < limit:
            sched.add(make_request(20, 30, tenant="b", arrival=clock.t, rid=f"b{k}", **b_kw))
            k += 1
        apply_step(sched, sched.schedule())
        check_conservation(sched)
        if big.status.finished:
            return step
    return steps


def test_memfair_a_request_beyond_its_cap_is_delayed_not_stranded():
    """Default cap (half the tier while another tenant has work): a request that grew past it
    and was demoted must not stay parked for good while the other tenant keeps having work
    (stranded: 2,926 of 3,000 steps parked, 74 of 120 tokens). It borrows like anyone beyond
    their quota, and after `starve_after_s` of waiting it is let in whatever its quota."""
    clock = FakeClock()
    sched = make_scheduler(make_policy("memfair"), num_pages=40, host_pages=80, budget=64, clock=clock)
    big = make_request(8, 120, tenant="a", rid="a-long")  # grows to 32 pages: the cap is 20
    sched.add(big)
    done = _trickle_of_b(sched, clock, big, 3000, limit=3)
    assert big.status.name == "FINISHED_LENGTH" and big.num_output_tokens == 120 and done < 1500


def test_memfair_an_inherited_request_beyond_its_cap_gets_in():
    """The decode path of the case above: a 24-page arrival (cap 20) while b decodes."""
    from fairness.interface import Arrival

    clock = FakeClock()
    pol = make_policy("memfair")
    sched = make_scheduler(pol, num_pages=40, host_pages=80, budget=64, clock=clock)
    sched.add(make_request(20, 30, tenant="b", rid="b-first"))
    apply_step(sched, sched.schedule())
    st = sched.state()
    pol.refresh(sched.running, [*sched.parked, *sched.waiting], st)
    where = pol.place_arrival(Arrival("w", "a", 0, 24, st.now, st.now, 95, 20), 0, st)
    seq = Sequence("w", [5] * 95 + [7], 95, SamplingParams(max_tokens=20, ignore_eos=True), tenant="a",
                   num_computed_tokens=95)
    if where is Placement.HOST:
        sched.host_pool.allocate("w", 24)
        sched.add_parked(seq)
    else:
        sched.pool.allocate("w", 24)
        sched.add_running(seq)
    done = _trickle_of_b(sched, clock, seq, 2000, limit=2)
    assert seq.status.name == "FINISHED_LENGTH" and done < 1000


def test_priority_a_resident_low_class_row_ages_too():
    """Stepped in raw class order, a low-class request already resident would get 8 of 30
    tokens, then nothing for as long as higher classes kept the step budget full. Rows age
    since the last step that carried them, so it keeps getting tokens."""
    clock = FakeClock()
    pol = PriorityPolicy(FairnessConfig(), PrioritySettings(aging_s=1.0))
    sched = make_scheduler(pol, num_pages=2000, budget=8, max_num_seqs=4000, clock=clock)

    def inherited(rid, prio, max_tokens):
        s = Sequence(rid, [5] * 8 + [7], 8, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=rid[:2],
                     priority=prio, num_computed_tokens=8)
        s.arrival_time = clock.t
        sched.pool.allocate(rid, 3)
        sched.add_running(s)
        return s

    low = inherited("lo", 5, 30)
    got = []
    for step in range(1, 601):
        clock.t = step * 0.05
        if step <= 400:  # one class-0 request per step keeps the 8-token budget full
            inherited(f"hi{step}", 0, 20)
        apply_step(sched, sched.schedule())
        check_conservation(sched)
        got.append(low.num_output_tokens)
    # 5 classes at 1 s a class: a token every ~5 s (100 steps) once the budget is full
    assert got[-1] - got[99] >= 4, (got[99], got[-1])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prompts_that_lack_pages_held_for_hand_offs_wait_instead_of_redoing_each_other(name):
    """A prefill node whose pool is half held by a prompt waiting for its hand-off: two long
    prompts that do not fit beside it must not preempt themselves when they cannot grow,
    letting the other in, which then does the same, their prefill redone again and again for
    as long as the hand-off waits. The one that cannot grow waits with its pages, and both
    finish once the hand-off frees the rest."""
    clock = FakeClock()
    sched = make_scheduler(make_policy(name), num_pages=40, budget=64, clock=clock)
    sched.pool.allocate("held-for-hand-off", 20)
    a, b = make_request(100, 1, tenant="w", arrival=0.0), make_request(100, 1, tenant="w", arrival=0.1)
    sched.add(a)
    preempted = 0
    for step in range(200):
        clock.t = step * 0.02
        if step == 5:
            sched.add(b)
        if step % 10 == 0:  # another tenant keeps coming (memfair's small chunks apply)
            sched.add(make_request(4, 2, tenant="m", arrival=clock.t))
        out = sched.schedule()
        preempted += sum(m.kind == "preempt" and m.request_id in (a.request_id, b.request_id) for m in out.moves)
        apply_step(sched, out)
    assert preempted <= 1, f"{preempted} preemptions of the two prompts: they took turns"
    sched.pool.free("held-for-hand-off")
    for _ in range(200):
        clock.t += 0.02
        apply_step(sched, sched.schedule())
        check_conservation(sched)
        if a.status.finished and b.status.finished:
            break
    assert a.status.finished and b.status.finished
