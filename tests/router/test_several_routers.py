"""Several router processes behind one port (pdtb/router/peers.py, docs/cluster.md "Several
routers"), the logic without a cluster: D²LPM's credits of two routers that each see half of a
client's requests, by hand; cache-aware routing and cluster-wide tenant shares across two
registries; which router rebalances; the peer files; /admin/migrate forwarded between two routers
served in this process."""
from __future__ import annotations

import time

import aiohttp
import pytest

from pdtb.engine.prefix_hash import page_hashes
from pdtb.nodes.handoff import HandoffState
from pdtb.nodes.protocol import encode_message
from pdtb.router.config import Fleet, NodeSpec, RouterConfig, load_served_model
from pdtb.router.fair_route import D2lpmRouter, RouteCandidate
from pdtb.router.node_state import RequestHandle
from pdtb.router.peers import FORWARDED_HEADER, ROUTER_HEADER, Peers
from tests.router.test_cache_route import NS, PAGE, PREFIX, make_registry, make_request, make_stats

from async_case import async_test


# -- D²LPM: per-(client, worker) credit, each router its own ------------------------------------------
def cands():
    """Worker A holds 60 of every 100-token prompt of the client, B none: A costs 40, B 100."""
    return [RouteCandidate("A", 60, (0,)), RouteCandidate("B", 0, (1,))]


def test_two_routers_with_half_the_requests_each_charge_as_one_router_does():
    """Requests 1..6 of one client, alternating between two routers (as SO_REUSEPORT spreads
    connections), each router charging twice (charge_scale = 2 routers):

        one router (quantum 100):   A 100 -> 60 -> 20 -> -20, then B: the client spills at request 4
        routers a and b, x2 each:   a: A 100 -> 20 -> -60 (requests 1, 3), b the same (2, 4), then B at 5 and 6

    After the same four requests of the cluster every router's credit for the client is one
    router's (A -60, B 100), and the spill to B comes one request later (5, not 4), where
    unscaled routers would keep sending to A until request 7 (each sees half of the charges)."""
    one = D2lpmRouter(quantum=100)
    picks_one = [one.choose("c", 100, cands()) for _ in range(6)]
    assert picks_one[:4] == [0, 0, 0, 1]
    pair = [D2lpmRouter(quantum=100, charge_scale=2), D2lpmRouter(quantum=100, charge_scale=2)]
    picks_pair = [pair[i % 2].choose("c", 100, cands()) for i in range(4)]
    assert picks_pair == [0, 0, 0, 0]
    after_four = D2lpmRouter(quantum=100)
    for _ in range(4):
        after_four.credit[("c", "A")] = after_four.credit.get(("c", "A"), 100.0) - 40
    after_four.credit[("c", "B")] = 100.0
    assert pair[0].credit == pair[1].credit == after_four.credit == {("c", "A"): -60, ("c", "B"): 100}
    assert [pair[i % 2].choose("c", 100, cands()) for i in range(4, 6)] == [1, 1]
    unscaled = [D2lpmRouter(quantum=100), D2lpmRouter(quantum=100)]
    picks = [unscaled[i % 2].choose("c", 100, cands()) for i in range(8)]
    assert picks.index(1) == 6  # request 7
    pair[1].charge_output("c", "B", 10)  # output charged at 2 per token, twice
    assert pair[1].credit[("c", "B")] == 100 - 2 * 100 - 2 * 2 * 10


def test_the_long_run_share_per_worker_is_one_routers():
    """Over many requests, randomly split between two scaled routers, a client's share of
    requests per worker is one router's (5 of 7 to A here: A's credit buys 100/40 requests
    per round, B's 100/100)."""
    import random

    rng = random.Random(3)
    one, pair = D2lpmRouter(quantum=100), [D2lpmRouter(quantum=100, charge_scale=2) for _ in range(2)]
    n = 7000
    share_one = sum(one.choose("c", 100, cands()) == 0 for _ in range(n)) / n
    share_pair = sum(pair[rng.randrange(2)].choose("c", 100, cands()) == 0 for _ in range(n)) / n
    assert share_one == pytest.approx(5 / 7, abs=1e-3) and share_pair == pytest.approx(5 / 7, abs=0.01)


def test_a_registry_charges_as_many_times_as_there_are_routers():
    reg = make_registry(["colocated", "colocated"], "d2lpm")
    assert reg.d2lpm.charge_scale == 1
    from pdtb.router.registry import NodeRegistry

    assert NodeRegistry([NodeSpec("colocated", "tcp://127.0.0.1:1")], route="d2lpm", num_routers=3).d2lpm.charge_scale == 3
    with pytest.raises(ValueError):
        D2lpmRouter(charge_scale=0)


# -- cache-aware routing: the nodes' summaries are the truth, a router's own placements are its own --
def test_a_summary_reaches_every_router_and_a_placement_stays_with_its_router():
    a_sent, b_sent = [], []
    a = make_registry(["prefill", "prefill", "decode"], "cache", a_sent)
    b = make_registry(["prefill", "prefill", "decode"], "cache", b_sent)
    frame = encode_message(make_stats("n1", "prefill", page_hashes(PREFIX, PAGE, NS)))
    for reg in (a, b):
        reg.node_set.on_frame(reg.nodes[1], frame)  # n1's summary: it holds PREFIX
    a.submit(make_request(0, PREFIX + [3] * 8))
    b.submit(make_request(1, PREFIX + [4] * 8))
    assert a_sent == [a.nodes[1]] and b_sent == [b.nodes[1]]
    fresh = [9] * (8 * PAGE)  # a prefix no node holds: a sends it to n0 and expects n0 to hold it next
    a.submit(make_request(2, fresh + [1]))
    assert a_sent[-1] is a.nodes[0] and len(a.nodes[0].prefix_view.recent) == 8
    assert len(b.nodes[0].prefix_view) == 0  # b knows of it once n0's summary says so
    b.node_set.on_frame(b.nodes[0], encode_message(make_stats("n0", "prefill", page_hashes(fresh, PAGE, NS))))
    b.submit(make_request(3, fresh + [2]))
    assert b_sent[-1] is b.nodes[0]


# -- cluster-wide tenant shares: from node stats, the same in every router --------------------------
def test_every_router_sends_the_nodes_the_same_cluster_views():
    regs = [make_registry(["decode", "decode", "prefill"], "load") for _ in range(2)]
    frames = [encode_message(make_stats(f"n{i}", "decode", extra={"tenant_pages": tp}))
              for i, tp in enumerate(({"x": 30, "y": 5}, {"x": 2, "z": 40}))]
    for reg in regs:
        for node, frame in zip(reg.nodes, frames):
            reg.node_set.on_frame(node, frame)
    views = [reg.node_set.cluster_views() for reg in regs]
    assert views[0] == views[1] and views[0]["n0"].other_pages == 1000 and views[0]["n1"].elsewhere == {"x": 30, "y": 5}


# -- which router rebalances; the peer files -------------------------------------------------------
def test_router_0_runs_the_rebalance_mode_and_the_others_drain_only():
    nodes = (NodeSpec("colocated", "tcp://127.0.0.1:1"),)
    assert RouterConfig(nodes, rebalance="pressure", fleet=Fleet(0, 2)).own_rebalance == "pressure"
    assert RouterConfig(nodes, rebalance="fair", fleet=Fleet(1, 2)).own_rebalance == "off"
    with pytest.raises(ValueError):
        Fleet(2, 2)


def test_peers_read_each_others_admin_files(tmp_path):
    a, b = (Peers(Fleet(i, 2, str(tmp_path)), f"r{i}") for i in range(2))
    assert a.others() == []
    a.publish("http://127.0.0.1:1")
    b.publish("http://127.0.0.1:2")
    assert a.others() == ["http://127.0.0.1:2"] and b.others() == ["http://127.0.0.1:1"]
    Peers(Fleet(1, 2, str(tmp_path)), "r1-again").publish("http://127.0.0.1:3")  # b restarted
    b.unpublish()  # (the file names the new process now: left alone)
    assert a.others() == ["http://127.0.0.1:3"]
    assert Peers(Fleet(), "r").others() == [] and Fleet().admin_file is None


# -- /admin/migrate between two routers served here -------------------------------------------------
@async_test
async def test_a_migration_asked_of_the_wrong_router_is_answered_by_the_one_that_holds_the_request(llama_dir, tmp_path):
    from pdtb.router.completions import STATE
    from pdtb.router.main import start_router

    model = load_served_model(llama_dir)
    nodes = (NodeSpec("prefill", "tcp://127.0.0.1:9"), NodeSpec("decode", "tcp://127.0.0.1:10"))
    runners = []
    try:
        for i in range(2):
            config = RouterConfig(nodes, port=0, fleet=Fleet(i, 2, str(tmp_path)))
            runners.append((await start_router(config, model))[0])
        holder = runners[0].app[STATE].registry
        p0, d0 = holder.nodes
        holder.dispatch.requests["r1"] = RequestHandle("r1", p0, d0, handoff=HandoffState.BOUND)  # not handed off yet
        admin = [(tmp_path / f"router-{i}.admin").read_text().strip() for i in range(2)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            async def migrate(url, rid, headers=None):
                async with s.post(f"{url}/admin/migrate", json={"request_id": rid, "to": "d1"}, headers=headers) as r:
                    return r.status, (await r.json())["error"]["message"], r.headers[ROUTER_HEADER]

            status, message, answered = await migrate(admin[1], "r1")  # router 1 asks router 0
            assert status == 409 and "not decoding on its decode node yet" in message
            assert answered == runners[1].app[STATE].registry.router_id
            status, message, _ = await migrate(admin[1], "nobody")
            assert status == 409 and "not decoding on a decode node here" in message
            status, _, _ = await migrate(admin[1], "r1", {FORWARDED_HEADER: "x"})  # never passed on twice
            assert status == 404
            async with s.get(f"{admin[0]}/router") as r:
                me = await r.json()
            assert me["index"] == 0 and me["routers"] == 2 and me["peers"] == [admin[1]] and me["admin_url"] == admin[0]
    finally:
        for r in runners:
            await r.cleanup()


def test_metrics_of_several_routers_need_the_flag_before_prometheus_is_imported(tmp_path):
    """--metrics-dir switches prometheus_client to its multiprocess mode through its
    environment variable, read at import: too late in a process that imported it (this one)."""
    import prometheus_client  # noqa: F401 - imported in single-process mode here

    from pdtb.router.main import multiprocess_metrics

    with pytest.raises(ValueError, match="imported before"):
        multiprocess_metrics(str(tmp_path / "m"))
