"""Factories for driving the scheduler without a model: fake clock, fake forward pass."""
from __future__ import annotations

import itertools

from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
_ids = itertools.count()


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_pool(num_pages: int = 32, tier: str = "device") -> PagePool:
    return PagePool(SPEC, num_pages, tier=tier)


def make_request(prompt_len: int = 8, max_tokens: int = 4, tenant: str = "a", priority: int = 0,
                 arrival: float = 0.0, rid: str | None = None, slo_tier: str = "") -> Sequence:
    seq = Sequence.from_prompt(rid or f"r{next(_ids)}", [5] * prompt_len, SamplingParams(max_tokens=max_tokens,
                               ignore_eos=True), tenant=tenant, priority=priority, slo_tier=slo_tier)
    seq.arrival_time = arrival
    return seq


def make_scheduler(policy=None, num_pages: int = 32, host_pages: int = 0, budget: int = 64,
                   max_num_seqs: int = 64, clock=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 4096), make_pool(num_pages), policy=policy,
                     host_pool=make_pool(host_pages, "host") if host_pages else None, clock=clock or FakeClock())


def sim_step(sched: Scheduler) -> list[Sequence]:
    """One step with a fake forward pass: every chunk is computed, wanting chunks sample token 7.
    Returns the requests that finished."""
    return apply_step(sched, sched.schedule())


def apply_step(sched: Scheduler, out) -> list[Sequence]:
    """The fake forward pass of `sim_step` over an already scheduled step."""
    done = []
    for c in out.chunks:
        want = c.wants_logits
        c.seq.num_computed_tokens += c.num_new_tokens
        if want:
            c.seq.token_ids.append(7)
            if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                sched.finish(c.seq, SeqStatus.FINISHED_LENGTH, "length")
                done.append(c.seq)
    return done


def check_conservation(sched: Scheduler) -> None:
    """free + reserved + resident + parked == total on each tier; owners match the queues."""
    for pool in (sched.pool, sched.host_pool):
        if pool is None:
            continue
        pool.check()
        # the per-page states (state_counts) against the free list and the owners' page lists:
        # free + reserved + resident + parked == total, each term counted from its own record
        counts = pool.state_counts()
        owned = sum(len(pool.pages_of(o)) for o in pool.owners())
        assert counts["free"] == pool.num_free and counts["free"] + owned == pool.num_pages, counts
        assert counts["reserved"] + counts["resident"] + counts["parked"] == owned, counts
    dev = set(sched.pool.owners())
    assert dev <= {s.request_id for s in sched.running} | {s.request_id for s in sched.waiting}
    if sched.host_pool is not None:
        assert set(sched.host_pool.owners()) == {s.request_id for s in sched.parked}
    for s in sched.running:
        assert len(sched.pool.pages_of(s.request_id)) >= SPEC.pages_for(s.num_computed_tokens)


def state(pages: dict | None = None, device_total: int = 32, device_free: int = 0, now: float = 0.0,
          step: int = 0, host_total: int = 0, host_free: int = 0) -> SchedState:
    return SchedState(now, step, SPEC.page_size, SPEC.bytes_per_page, device_total, device_free, host_total,
                      host_free, pages or {}, {})
