"""Runs of decode steps taken at once (pdtb/sim/coast.py) decide as every step an event does.

Each built-in policy runs a mixed workload twice, on a colocated node and on 1P+2D with a host
tier, small pools so that requests are demoted, preempted and deferred: once every step an
event, once with runs taken at once. Every decision the policy makes that is not the trivial
answer of a plain decode step (a victim, an admission, a placement, a chunk, an eviction to
reclaim, a row left out of a step) is logged with its step number and time; the logs, every
request's token times and timings, the tier moves and each node's step count are equal.
"""
from __future__ import annotations

import random
import sys

import pytest

import fairness
from fairness.config import FairnessConfig
from pdtb.figures.records import RequestSpec
from pdtb.sim import coast
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape
from pdtb.sim.roofline import RooflineCost

LOG: list = []


def _ids(seqs) -> tuple:
    return tuple(s.request_id for s in seqs)


def _logged(cls: type) -> type:
    """`cls` with its non-trivial answers logged (state.step and state.now with each)."""

    class Logged(cls):
        def reclaim(self, running, candidates, state):
            out = super().reclaim(running, candidates, state)
            if out:
                LOG.append(("reclaim", state.step, state.now, _ids(out)))
            return out

        def step_order(self, running, state):
            out = super().step_order(running, state)
            if {s.request_id for s in out} != {s.request_id for s in running}:
                LOG.append(("step_order", state.step, state.now, _ids(out)))
            return out

        def admission_order(self, candidates, state):
            out = super().admission_order(candidates, state)
            if candidates:
                LOG.append(("admission_order", state.step, state.now, _ids(out)))
            return out

        def may_admit(self, seq, need_pages, state):
            out = super().may_admit(seq, need_pages, state)
            LOG.append(("may_admit", state.step, state.now, seq.request_id, need_pages, out))
            return out

        def pick_victim(self, candidates, requester, state):
            out = super().pick_victim(candidates, requester, state)
            LOG.append(("pick_victim", state.step, state.now, _ids(candidates), getattr(out, "request_id", None)))
            return out

        def chunk_limit(self, seq, budget, state):
            out = super().chunk_limit(seq, budget, state)
            LOG.append(("chunk_limit", state.step, state.now, seq.request_id, budget, out))
            return out

        def place_arrival(self, arrival, queued, state):
            out = super().place_arrival(arrival, queued, state)
            LOG.append(("place_arrival", state.step, state.now, arrival.request_id, queued, out.value))
            return out

    Logged.name = cls.name
    return Logged


REF = f"{__name__}:Policy"  # set per test to the logged built-in


def _workload(seed: int) -> list[RequestSpec]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(36):
        t += rng.expovariate(12.0)
        long = i % 6 == 0
        tenant = "whale" if long else f"t{i % 3}"
        out.append(RequestSpec(t, tenant, "long" if long else "short", rng.randint(1500, 3000) if long else
                               rng.randint(50, 400), rng.randint(60, 300), priority=i % 3))
    return out


COST = RooflineCost.of("h100-sxm", "llama-3-8b")
SHAPES = {
    "colocated": lambda p: (NodeShape("colocated", 520, 400, max_num_batched_tokens=1024, policy=REF, fairness=p),),
    "disagg": lambda p: (NodeShape("prefill", 600, max_num_batched_tokens=1024, policy=REF, fairness=p),
                         NodeShape("decode", 300, 200, policy=REF, fairness=p),
                         NodeShape("decode", 300, 0, policy=REF, fairness=p)),
}


def _run(shape: str, runs: bool, specs) -> tuple[SimCluster, list]:
    LOG.clear()
    cfg = FairnessConfig()
    c = SimCluster(ClusterShape(SHAPES[shape](cfg), coast=runs), page_spec(COST.page_bytes, 16), COST)
    c.run(specs)
    return c, list(LOG)


def _figures(c: SimCluster) -> dict:
    recs = {rid: (r.status, r.error, r.token_times, r.end_time, r.server_timing) for rid, r in c.records.items()}
    nodes = {nid: (n.num_steps, n.scheduler.num_steps, round(n.busy_s, 9), n.pool.num_free,
                   n.host_pool.num_free if n.host_pool else 0) for nid, n in c.nodes.items()}
    moves = c.observer.summary(list(c.records.values()))
    return {"records": recs, "nodes": nodes, "moves": (moves["evictions"], moves["adopted"]), "samples": c.observer.samples}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", sorted(fairness.POLICIES))
def test_runs_of_decode_steps_decide_as_every_step(monkeypatch, name, shape):
    monkeypatch.setattr(sys.modules[__name__], "Policy", _logged(fairness.POLICIES[name]), raising=False)
    specs = _workload(seed=len(name))
    every, every_log = _run(shape, False, specs)
    taken, taken_log = _run(shape, True, specs)
    kv = [n for n in taken.nodes.values() if n.shape.role != "prefill"]
    coasted, steps = sum(n.coasted for n in kv), sum(n.num_steps for n in kv)
    assert coasted > steps // 5, (coasted, steps)  # runs were taken, under pressure too
    assert sum(n.coasted for n in every.nodes.values()) == 0
    assert len(every_log) > 50
    assert taken_log == every_log
    a, b = _figures(every), _figures(taken)
    assert a == b
    assert all(r.status == "ok" for r in taken.records.values())
    evictions = a["moves"][0]
    # the pools are small enough that requests change tiers (memfair's colocated admission, which
    # counts what the running prompts still take, moves none there)
    if name == "fcfs" or (name, shape) == ("memfair", "disagg"):
        assert sum(n for per in evictions.values() for n in per.values()) > 0, evictions


def test_policy_counters_after_runs_match_every_step(monkeypatch):
    """The counters a policy keeps from `on_steps` (VTC's tokens, memtime's page-seconds,
    DLPM's deficits) equal those kept step by step."""
    for name, attr in (("vtc", "counters"), ("memtime", "counters"), ("dlpm", "deficit")):
        monkeypatch.setattr(sys.modules[__name__], "Policy", _logged(fairness.POLICIES[name]), raising=False)
        specs = _workload(seed=7)
        every, _ = _run("colocated", False, specs)
        taken, _ = _run("colocated", True, specs)
        (pa,), (pb,) = [[n.policy for n in c.nodes.values()] for c in (every, taken)]
        want, got = getattr(pa, attr), getattr(pb, attr)
        assert want and set(want) == set(got), name
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), (name, k)


def test_ceil_sum_is_the_sum_of_pages_read():
    for ps in (1, 3, 16):
        for n in range(0, 70):
            assert coast.ceil_sum(n, ps) == sum(-(-x // ps) for x in range(1, n + 1))


def test_a_bandwidth_cap_steps_one_at_a_time():
    from fairness.base import BasePolicy

    assert BasePolicy(FairnessConfig(tenant_bw_cap=1e9)).on_steps is None
    assert callable(BasePolicy(FairnessConfig()).on_steps)


