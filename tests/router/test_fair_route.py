"""D²LPM routing (`--route d2lpm`, pdtb/router/fair_route.py): the rule replayed by hand on a
small example, the router's registry choosing by it over prefix views, and the simulator's router."""
from __future__ import annotations

import math

import pytest

from pdtb.engine.prefix_hash import page_hashes
from pdtb.nodes.protocol import encode_message
from pdtb.router.fair_route import D2lpmRouter, RouteCandidate
from tests.router.test_cache_route import NS, PAGE, PREFIX, make_registry, make_request, make_stats


def two(overlap_a=0, overlap_b=0):
    return [RouteCandidate("A", overlap_a, (0,)), RouteCandidate("B", overlap_b, (1,))]


def test_the_rule_by_hand():
    r = D2lpmRouter(quantum=100, input_weight=1, output_weight=2)
    # no credit anywhere: one round gives A and B 100 each; equal overlap, A first by load; A pays 50
    assert r.choose("c", 50, two()) == 0 and r.credit == {("c", "A"): 50, ("c", "B"): 100}
    # both have credit: the longer prefix wins and pays only what it must prefill (80 - 32)
    assert r.choose("c", 80, two(32, 0)) == 0 and r.credit[("c", "A")] == 2
    # A's credit is still positive: locality again, A goes below zero (2 - 16)
    assert r.choose("c", 80, two(64, 0)) == 0 and r.credit[("c", "A")] == -14
    # A holds the whole prompt, but c has paid out its credit there: B, which must prefill all 80
    assert r.choose("c", 80, two(80, 0)) == 1 and r.credit[("c", "B")] == 20
    r.charge_output("c", "B", 15)  # 15 tokens generated at 2 each
    assert r.credit[("c", "B")] == -10
    # none positive (-14, -10): one round (100) makes both positive; equal overlap, A by load
    assert r.choose("c", 10, two()) == 0 and r.credit == {("c", "A"): 76, ("c", "B"): 90}
    # another client's credit is its own
    assert r.choose("d", 10, two(0, 5)) == 1 and r.credit[("d", "B")] == 95 and r.credit[("d", "A")] == 100


def test_as_many_rounds_as_it_takes_and_the_load_order_breaks_ties():
    r = D2lpmRouter(quantum=100)
    r.credit = {("c", "A"): -250.0, ("c", "B"): -300.0}
    assert r.choose("c", 1, two()) == 0  # 3 rounds: A 50, B 0 (not positive)
    assert r.credit == {("c", "A"): 49.0, ("c", "B"): 0.0}
    cands = [RouteCandidate("A", 0, (5,)), RouteCandidate("B", 0, (2,))]
    assert D2lpmRouter().choose("c", 1, cands) == 1  # equal overlap and credit: the lighter load
    assert D2lpmRouter().choose("c", 1, []) is None


@pytest.mark.parametrize("kw", [dict(quantum=0), dict(quantum=math.inf), dict(input_weight=-1),
                                dict(output_weight=math.nan)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        D2lpmRouter(**kw)


def test_the_registry_follows_a_prefix_until_the_client_has_paid_for_it_there():
    sent = []
    reg = make_registry(["prefill", "prefill", "decode"], "d2lpm", sent)
    a, b, _ = reg.nodes
    reg.node_set.on_frame(b, encode_message(make_stats("n1", "prefill", page_hashes(PREFIX, PAGE, NS))))
    reg.dispatch.d2lpm = D2lpmRouter(quantum=100)
    reg.d2lpm.credit = {("t", a.node_id): 10.0, ("t", b.node_id): 20.0}

    def submit(i, tenant):
        req = make_request(i, PREFIX + [i] * 8)
        req.tenant = tenant
        return reg.submit(req)

    handles = [submit(i, "t") for i in range(3)]  # B holds the prefix: each prefills 8 tokens there
    assert all(h.entry is b and h.prefix_overlap_tokens == len(PREFIX) for h in handles)
    assert reg.d2lpm.credit[("t", b.node_id)] == -4
    assert submit(3, "t").entry is a  # no credit left at B: A, which must prefill all 136
    assert reg.d2lpm.credit[("t", a.node_id)] == 10 - 136
    # u has credit nowhere: a round of 100 each. Both are believed to hold the prefix now (A's
    # insert at r3), so the load order decides: A queues 136 tokens, B 408
    assert submit(4, "u").entry is a
    assert reg.d2lpm.credit[("u", a.node_id)] == 92 and reg.d2lpm.credit[("u", b.node_id)] == 100
    handles[0].tokens = 6
    reg.release(handles[0])
    assert reg.d2lpm.credit[("t", b.node_id)] == -4 - 2 * 6
    assert sent == [b, b, b, a, a]


def test_the_route_flag_takes_d2lpm():
    from pdtb.router.main import parse_args

    assert parse_args(["--route", "d2lpm"]).route == "d2lpm"


def test_the_simulated_router_charges_each_client_on_the_nodes_it_chose(monkeypatch):
    import pdtb.sim.cluster as sim_cluster
    from pdtb.figures.records import RequestSpec
    from pdtb.sim.cluster import ClusterShape, SimCluster
    from pdtb.sim.cost import FixedStepCost, LinkModel
    from pdtb.sim.node import NodeShape
    from pdtb.sim.flags import page_spec
    from tests.sim.test_sim_core import SPEC

    quantum, made = 100.0, []
    monkeypatch.setattr(sim_cluster, "D2lpmRouter", lambda: made.append(D2lpmRouter(quantum=quantum)) or made[-1])
    specs = [RequestSpec(0.5 * i, t, "x", 40 + 8 * i, 4 + i % 3) for i in range(12) for t in ("a", "b")]
    shape = ClusterShape((NodeShape("prefill", 64), NodeShape("prefill", 64), NodeShape("decode", 96)),
                         rpc_latency_s=0.0, client_latency_s=0.0, route="d2lpm")
    c = SimCluster(shape, page_spec(SPEC.bytes_per_page, SPEC.page_size),
                   FixedStepCost(1.0, SPEC.bytes_per_page, link=LinkModel(1e12), host_link=LinkModel(1e12)))
    recs = c.run(specs)
    assert all(r.status == "ok" and r.output_tokens == r.requested_output_tokens for r in recs)
    credit = made[0].credit
    for t in ("a", "b"):
        mine = [s for s in specs if s.tenant == t]
        spent = sum(s.prompt_len for s in mine) + 2 * sum(s.output_len for s in mine)  # input 1, output 2
        given = sum(v for (client, _), v in credit.items() if client == t) + spent
        assert given > 0 and math.isclose(given % (2 * quantum), 0, abs_tol=1e-6)  # whole rounds, both nodes
    assert {c.entry[f"sim-{i}"] for i in range(len(specs))} == {"prefill-0", "prefill-1"}
    with pytest.raises(ValueError):
        ClusterShape(shape.nodes, route="cache")
