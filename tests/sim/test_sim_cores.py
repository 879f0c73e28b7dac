"""Shared cores (`pdtb sim --host-cores N`): processor sharing replayed by hand, and a simulated
cluster whose steps stretch when its processes outnumber the cores."""
from __future__ import annotations

import pytest

from pdtb.sim.cores import SharedCores
from pdtb.sim.events import EventLoop


def test_processor_sharing_by_hand():
    """One core. A: 2 s of work at t=0. B: 1 s at t=0.5. From 0.5 both run at half speed: B's
    second takes 2 s (ends 2.5); A has 1.5 s left at 0.5, 0.5 s at 2.5, alone again: ends 3.0.
    C: 0.25 s queued on A itself at t=1, after A's first piece: alone at full speed, 3.0 to 3.25."""
    loop, ended = EventLoop(), {}
    cores = SharedCores(1, loop)
    cores.run("a", 2.0, lambda: ended.setdefault("a", loop.now))
    loop.at(0.5, cores.run, "b", 1.0, lambda: ended.setdefault("b", loop.now))
    loop.at(1.0, cores.run, "a", 0.25, lambda: ended.setdefault("c", loop.now))
    loop.run()
    assert ended == pytest.approx({"a": 3.0, "b": 2.5, "c": 3.25})
    assert cores.busy_s == pytest.approx({"a": 3.25, "b": 2.0})


def test_enough_cores_change_nothing_and_a_callback_may_queue_more():
    loop, ended = EventLoop(), []
    cores = SharedCores(2, loop)
    cores.run("a", 1.0, lambda: cores.run("a", 1.0, lambda: ended.append(("a2", loop.now))))
    cores.run("b", 1.5, lambda: ended.append(("b", loop.now)))
    loop.run()
    assert ended == [("b", pytest.approx(1.5)), ("a2", pytest.approx(2.0))]
    with pytest.raises(ValueError):
        SharedCores(0, loop)


def test_a_cluster_on_one_core_takes_longer_and_keeps_every_token():
    from pdtb.figures.records import RequestSpec
    from pdtb.sim.cluster import ClusterShape, SimCluster
    from pdtb.sim.cost import FixedStepCost, LinkModel
    from pdtb.sim.flags import page_spec
    from pdtb.sim.node import NodeShape
    from tests.sim.test_sim_core import SPEC

    specs = [RequestSpec(0.02 * i, "t", "x", 32, 6) for i in range(16)]

    def run(cores: int, router_s: float = 0.0):
        shape = ClusterShape((NodeShape("prefill", 64), NodeShape("decode", 96)), rpc_latency_s=0.0,
                             client_latency_s=0.0, host_cores=cores, router_token_s=router_s)
        c = SimCluster(shape, page_spec(SPEC.bytes_per_page, SPEC.page_size),
                       FixedStepCost(0.05, SPEC.bytes_per_page, link=LinkModel(1e12), host_link=LinkModel(1e12)))
        recs = c.run(specs)
        assert all(r.status == "ok" and r.output_tokens == 6 for r in recs)
        return max(r.end_time for r in recs), c

    alone, _ = run(0)
    two, _ = run(2)
    assert two == pytest.approx(alone)  # two processes with work, two cores: nothing shared
    shared, c = run(1)
    assert shared > alone * 1.1  # prefill and decode steps overlap: on one core they stretch
    relayed, c = run(1, router_s=0.01)
    assert relayed > shared and c.cores.busy_s["router"] > 0
