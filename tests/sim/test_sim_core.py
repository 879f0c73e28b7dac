"""The simulator drives the real policy objects: a recording policy sees the same calls, in the
same order with the same arguments, from a simulated colocated node as from the fake-clock
scheduler harness (tests/sched_sim.py). Timings of tiny runs against figures worked by hand;
every request ends and every page comes back, in both modes."""
from __future__ import annotations

import random
import sys

import pytest

import fairness
from fairness.config import FairnessConfig
from fairness.interface import REQUIRED_METHODS
from pdtb.figures.records import RequestSpec
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import FixedStepCost, LinkModel
from pdtb.sim.node import NodeShape
from pdtb.sim.flags import page_spec
from sched_sim import SPEC, FakeClock, apply_step, make_request, make_scheduler

METHODS = ("reclaim", "refresh", "step_order", "admission_order", "may_admit", "pick_victim", "chunk_limit",
           "on_step", "place_arrival")


def _ids(x):
    if isinstance(x, list):
        return tuple(_ids(v) for v in x)
    for attr in ("request_id", "seq"):
        if hasattr(x, attr):
            return _ids(getattr(x, attr))
    return x if isinstance(x, (int, str, float, bool)) else type(x).__name__


class Recorder:
    """Wraps a real policy (a subclass's `inner_cls`, built with the recorder's config and
    settings); logs every call of METHODS the scheduler or a node makes on it."""

    log: list = []
    inner_cls: type | None = None

    def __init__(self, config=None, settings=None) -> None:
        self.__dict__["inner"] = self.inner_cls(config, settings)

    name = property(lambda self: self.inner.name)
    strict_order = property(lambda self: self.inner.strict_order)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _method(name: str):
    def call(self, *args):
        if name in METHODS:
            state = args[-1]
            Recorder.log.append((name, round(state.now, 6), state.step, state.device_free, _ids(list(args[:-1]))))
        return getattr(self.inner, name)(*args)
    call.__name__ = name
    return call


for _name in REQUIRED_METHODS:  # every method of the interface, so that the registry takes the class
    setattr(Recorder, _name, _method(_name))

RECORDER = f"{__name__}:RecorderPolicy"  # the policy by reference (module:Class), as --policy takes it


def _register(monkeypatch, inner: str) -> FairnessConfig:
    """RECORDER now wraps the built-in policy `inner`."""
    cls = fairness.POLICIES[inner]
    wrapper = type("RecorderPolicy", (Recorder,), {"inner_cls": cls, "Settings": cls.Settings})
    monkeypatch.setattr(sys.modules[__name__], "RecorderPolicy", wrapper, raising=False)
    Recorder.log = []
    return FairnessConfig()


def _workload(n: int = 14, seed: int = 3) -> list[RequestSpec]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.uniform(0.05, 0.95)  # never on a whole second: no arrival ties with a step's end
        whale = i % 5 == 0
        out.append(RequestSpec(t, "w" if whale else f"m{i % 3}", "whale" if whale else "minnow",
                               rng.randint(40, 60) if whale else rng.randint(3, 9), rng.randint(8, 20) if whale else 3))
    return out


def _harness(specs, cfg: FairnessConfig, pages: int, host: int, budget: int) -> None:
    """The same workload through the fake-clock harness: steps of one second, arrivals queued
    before each step."""
    clock = FakeClock()
    sched = make_scheduler(fairness.make_policy(RECORDER, cfg), num_pages=pages, host_pages=host, budget=budget,
                           clock=clock)
    todo = list(enumerate(specs))
    while todo or sched.has_work():
        while todo and todo[0][1].send_time <= clock.t:
            i, s = todo.pop(0)
            seq = make_request(s.prompt_len, s.output_len, tenant=s.tenant, arrival=clock.t, rid=f"sim-{i}")
            seq.timeline.prefill_queued = clock.t
            sched.add(seq)
        if not sched.has_work():
            clock.t = todo[0][1].send_time
            continue
        out = sched.schedule()
        clock.t += 1.0
        apply_step(sched, out)


def _sim(specs, shapes, host_link=LinkModel(1e12), link=LinkModel(1e12)) -> SimCluster:
    cost = FixedStepCost(1.0, SPEC.bytes_per_page, link=link, host_link=host_link)
    # every step an event: the policy is asked at each, as the harness asks it
    c = SimCluster(ClusterShape(tuple(shapes), rpc_latency_s=0.0, client_latency_s=0.0, coast=False),
                   page_spec(SPEC.bytes_per_page, SPEC.page_size), cost)
    c.run(specs)
    return c


@pytest.mark.parametrize("inner", ["memfair", "fcfs", "vtc"])
def test_sim_makes_the_same_policy_calls_as_the_scheduler_harness(monkeypatch, inner):
    specs = _workload()
    cfg = _register(monkeypatch, inner)
    _harness(specs, cfg, pages=20, host=32, budget=32)
    expected = list(Recorder.log)
    _register(monkeypatch, inner)
    c = _sim(specs, [NodeShape("colocated", 20, 32, max_num_batched_tokens=32, policy=RECORDER, fairness=cfg)])
    assert len(expected) > 200 and {e[0] for e in expected} >= {"reclaim", "step_order", "admission_order", "may_admit"}
    assert Recorder.log == expected
    if inner == "memfair":  # the pool is small enough that memfair moves requests between tiers
        moves = c.observer.summary(list(c.records.values()))["evictions"]
        assert sum(n for per in moves.values() for n in per.values()) > 0
    assert all(r.status == "ok" for r in c.records.values())


def test_colocated_timing_by_hand():
    """One request, prompt 8 (one step), 4 tokens, a step a second, sent at 0.5: tokens at
    1.5 (first, with the prefill), 2.5, 3.5, 4.5."""
    c = _sim([RequestSpec(0.5, "a", "x", 8, 4)], [NodeShape("colocated", 16)])
    r = c.records["sim-0"]
    assert r.status == "ok" and r.token_times == pytest.approx([1.5, 2.5, 3.5, 4.5])
    assert r.first_token_time == pytest.approx(1.5) and r.end_time == pytest.approx(4.5)


def test_disagg_timing_by_hand():
    """Prefill 1 s; the KV (2 pages of 4 tokens for an 8-token prompt) over a link of one page
    per second plus 0.25 s latency: lands 2.25 s later; then 3 decode steps of 1 s.
    Tokens: 1.0 (prefill node), then 4.25, 5.25, 6.25."""
    link = LinkModel(SPEC.bytes_per_page, 0.25)
    c = _sim([RequestSpec(0.0, "a", "x", 8, 4)], [NodeShape("prefill", 8), NodeShape("decode", 8)], link=link)
    r = c.records["sim-0"]
    assert r.status == "ok" and r.token_times == pytest.approx([1.0, 4.25, 5.25, 6.25])
    assert r.server_timing["slo"] is not None


def test_a_step_scale_stretches_each_role_s_steps_by_hand():
    """As the disaggregated timing, the prefill node's steps at 1.5x and the decode node's at 2x
    (a host's speed during one run, --step-scale): prefill ends at 1.5, the KV lands 2.25 s
    later at 3.75, then 3 decode steps of 2 s: 5.75, 7.75, 9.75. Runs of decode steps taken at
    once give the same times."""
    link = LinkModel(SPEC.bytes_per_page, 0.25)
    shapes = [NodeShape("prefill", 8, step_scale=1.5), NodeShape("decode", 8, step_scale=2.0)]
    c = _sim([RequestSpec(0.0, "a", "x", 8, 4)], shapes, link=link)
    assert c.records["sim-0"].token_times == pytest.approx([1.5, 5.75, 7.75, 9.75])
    shapes = [NodeShape("prefill", 8, step_scale=1.5), NodeShape("decode", 32, step_scale=2.0)]
    cost = FixedStepCost(1.0, SPEC.bytes_per_page, link=link)
    runs = SimCluster(ClusterShape(tuple(shapes), rpc_latency_s=0.0, client_latency_s=0.0),
                      page_spec(SPEC.bytes_per_page, SPEC.page_size), cost)
    runs.run([RequestSpec(0.0, "a", "x", 8, 40)])
    every = _sim([RequestSpec(0.0, "a", "x", 8, 40)], shapes, link=link)
    assert sum(n.coasted for n in runs.nodes.values()) > 0
    assert runs.records["sim-0"].token_times == pytest.approx(every.records["sim-0"].token_times)
    with pytest.raises(ValueError, match="step scale must be positive"):
        NodeShape("decode", 8, step_scale=0.0)


@pytest.mark.parametrize("policy", ["fcfs", "memfair", "vtc", "mcsf", "priority"])
@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_every_request_ends_and_every_page_comes_back(mode, policy):
    specs = _workload(30, seed=11)
    if mode == "colocated":
        shapes = [NodeShape("colocated", 20, 24, max_num_batched_tokens=32, policy=policy)]
    else:  # a decode pool that defers: hand-offs are held and retried
        shapes = [NodeShape("prefill", 24, policy=policy, max_num_batched_tokens=32),
                  NodeShape("decode", 20, 8, policy=policy), NodeShape("decode", 20, 0, policy=policy)]
    c = _sim(specs, shapes)
    assert all(r.end_time is not None for r in c.records.values())
    assert all(r.status == "ok" and r.output_tokens == s.output_len for r, s in zip(c.records.values(), specs))
    for n in c.nodes.values():
        n.pool.check()
        assert n.pool.num_free == n.pool.num_pages and not n.seqs and not n.scheduler.has_work()
        if n.host_pool is not None:
            assert n.host_pool.num_free == n.host_pool.num_pages
