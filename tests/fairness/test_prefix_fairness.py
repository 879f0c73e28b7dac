"""Fairness with shared prefix pages: quotas charge a shared page by the charge rule, victim
choice counts what evicting gives back, and every policy drains shared-prefix workloads under
memory pressure with page conservation after every step."""
from __future__ import annotations

import random

import pytest

from fairness import POLICIES, FairnessConfig, make_policy
from fairness import eviction, quotas
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig
from pdtb.engine.sequence import SamplingParams, Sequence
from sched_sim import FakeClock, apply_step

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")


def make_sched(policy=None, pages: int = 40, host: int = 0, charge: str = "split", budget: int = 32) -> Scheduler:
    pool = PagePool(SPEC, pages, charge=charge)
    hp = PagePool(SPEC, host, tier="host") if host else None
    sched = Scheduler(SchedulerConfig(64, budget, 4096), pool, policy=policy, host_pool=hp, clock=FakeClock())
    sched.prefix_ns = "test"
    return sched


def request(rid: str, prompt: list[int], tenant: str, max_tokens: int = 6, arrival: float = 0.0) -> Sequence:
    s = Sequence.from_prompt(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant)
    s.arrival_time = arrival
    return s


def step(sched: Scheduler):
    out = sched.schedule()
    for c in out.chunks:  # the engine registers computed pages after the forward pass
        c.seq.num_computed_tokens += c.num_new_tokens
        sched.register_computed(c.seq)
        c.seq.num_computed_tokens -= c.num_new_tokens
    apply_step(sched, out)
    return out


SYSTEM = list(range(100, 124))  # 6 pages of 4 tokens


@pytest.mark.parametrize("charge, want_a, want_b", [("split", 2 * (6 / 3 + 3), 6 / 3 + 3),
                                                    ("first", (6 + 3) + 3, 3), ("full", 2 * 9, 9)])
def test_quota_usage_follows_the_charge_rule(charge, want_a, want_b):
    """Tenant a runs two requests and tenant b one, all opening with one 6-page system prompt,
    each with 3 pages of its own (tokens and output): usage per tenant by each rule."""
    sched = make_sched(charge=charge)
    reqs = [request("a1", SYSTEM + [1] * 9, "a"), request("a2", SYSTEM + [2] * 9, "a", arrival=1),
            request("b1", SYSTEM + [3] * 9, "b", arrival=2)]
    sched.add(reqs[0])
    step(sched)  # a1 computes the system prompt and registers it
    for r in reqs[1:]:
        sched.add(r)
    step(sched)
    assert all(sched.pool.num_held(r.request_id) == 9 for r in reqs)
    use = quotas.usage(reqs, sched.state(), lambda s: s.tenant)
    assert use == pytest.approx({"a": want_a, "b": want_b})
    sched.pool.check()


def test_footprint_victim_is_the_request_whose_eviction_gives_pages_back():
    """Two requests of one tenant: one holds 9 pages, 6 of them shared with a third; the other
    holds 7 pages of its own. Evicting the first frees 3, the second 7: the second goes."""
    sched = make_sched(pages=40)
    sharer = request("s", SYSTEM + [1] * 9, "x")
    big_shared = request("big", SYSTEM + [2] * 9, "a", arrival=1)
    own = request("own", [9] * 27, "a", arrival=2)
    for r in (sharer, big_shared, own):
        sched.add(r)
        step(sched)
    st = sched.state()
    assert st.pages["big"] == 9 and st.gain["big"] == 3 and st.gain["own"] == 7
    assert eviction.footprint([big_shared, own], st, {"a": 2.0}) is own


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("host", [0, 24])
def test_every_policy_drains_shared_prefix_workloads_under_pressure(name, host):
    """30 requests of 3 tenants on a 20-page pool, prompts opening with one of 3 system prompts;
    requests that share pages are demoted, promoted and preempted. Everything finishes within
    a bounded number of steps, no page leaks, and every shared page has as many holders as
    page tables that list it after every step."""
    rng = random.Random(hash(name) % 1000 + host)
    prompts = [[200 + 10 * k + i for i in range(12)] for k in range(3)]
    cfg = FairnessConfig()
    sched = make_sched(make_policy(name, cfg), pages=20, host=host, budget=24)
    reqs = [request(f"r{i}", prompts[i % 3][:rng.choice((4, 8, 12))] + [rng.randrange(3, 90) for _ in range(rng.randrange(1, 14))],
                    f"t{i % 3}", max_tokens=rng.randrange(8, 30), arrival=i * 0.1) for i in range(30)]
    pending, moves, shared = list(reqs), set(), 0
    for i in range(3000):
        if pending and i % 2 == 0:
            sched.add(pending.pop(0))
        moves |= {m.kind for m in step(sched).moves}
        shared = max(shared, len(sched.pool._shared))
        sched.pool.check()
        if sched.host_pool is not None:
            sched.host_pool.check()
        sched.clock.t += 0.05
        if not pending and not sched.has_work():
            break
    assert not sched.has_work(), f"{name}: not drained"
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert sched.pool.num_free == sched.pool.num_pages and not sched.pool.owners()
    assert sched.prefix.hit_tokens > 0 and shared > 0
    # (mcsf admits only what fits until every admitted request completes: it never evicts)
    assert name == "mcsf" or moves & {"demote", "preempt"}, f"{name}: no memory pressure"
