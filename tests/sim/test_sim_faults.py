"""Node loss and transfer timeouts in the simulator (pdtb/sim/faults.py), against the router's
rules worked by hand: a node killed at T answers its last ping before T; the router finds it
lost at the first ping more than health_timeout after that; what depended on it is sent anew
(prompt plus the tokens streamed) and ends with every token, or fails once the retries are spent."""
from __future__ import annotations

import pytest

from pdtb.figures.records import RequestSpec
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import FixedStepCost, LinkModel
from pdtb.sim.faults import Kill
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape

STEP = 0.05  # every step 50 ms: a request of n output tokens decodes for about n steps


def _cluster(nodes, kills=(), retries=2, link=LinkModel(1e12), **kw) -> SimCluster:
    cost = FixedStepCost(STEP, 64, link=link)
    shape = ClusterShape(tuple(nodes), rpc_latency_s=0.0, client_latency_s=0.0, kills=tuple(kills),
                         recompute_retries=retries, **kw)
    return SimCluster(shape, page_spec(64, 16), cost)


def _specs(n: int, out: int = 80, every: float = 0.1) -> list[RequestSpec]:
    return [RequestSpec(0.01 + i * every, f"t{i % 2}", "x", 32, out) for i in range(n)]


def test_a_decode_node_killed_mid_stream_is_recomputed_when_the_router_finds_it_lost():
    specs = _specs(8)
    nodes = [NodeShape("prefill", 256), NodeShape("decode", 256), NodeShape("decode", 256)]
    c = _cluster(nodes, [Kill("decode-1", 2.2)])
    recs = c.run(specs)
    # pings every 0.5 s: decode-1's last answer was at 2.0, silent more than 3 s at the ping of 5.5
    lost_at = 5.5
    assert all(r.status == "ok" and r.output_tokens == 80 and len(r.token_times) == 80 for r in recs)
    hit = [r for r in recs if r.server_timing.get("recomputed")]
    assert hit and c.faults.lost == {"decode-1"}
    for r in hit:
        rc = r.server_timing["recomputed"]
        assert rc == {"times": 1, "lost_s": pytest.approx(lost_at - r.send_time), "tokens_before": rc["tokens_before"]}
        before = [t for t in r.token_times if t <= 2.2]
        assert len(before) == rc["tokens_before"] >= 1  # what streamed before the kill was kept
        assert not [t for t in r.token_times if 2.2 < t < lost_at]  # nothing came while the router waited
    assert len(hit) < len(recs)  # those on decode-2 went on untouched
    # the attempts sent anew went to the survivor, and every survivor's page came back
    assert all(c.reqs[c.attempt[f"sim-{i}"]].decode_node == "decode-2"
               for i, r in enumerate(recs) if r.server_timing.get("recomputed"))
    for nid, n in c.nodes.items():
        if nid != "decode-1":
            assert n.pool.num_free == n.pool.num_pages, nid
    assert c.faults.figures()["recomputes"] == len(hit)


def test_requests_queued_at_a_killed_prefill_node_are_prefilled_by_the_other():
    # one long prompt ahead of many: prefill-0 is killed with requests still queued
    specs = [RequestSpec(0.01 + 0.01 * i, "t", "x", 200, 4) for i in range(12)]
    nodes = [NodeShape("prefill", 256, max_num_batched_tokens=64), NodeShape("prefill", 256, max_num_batched_tokens=64),
             NodeShape("decode", 512)]
    c = _cluster(nodes, [Kill("prefill-0", 0.3)])
    recs = c.run(specs)
    assert all(r.status == "ok" and r.output_tokens == 4 for r in recs)
    hit = [i for i, r in enumerate(recs) if r.server_timing.get("recomputed")]
    assert hit and all(c.entry[c.attempt[f"sim-{i}"]] == "prefill-1" for i in hit)
    assert all(recs[i].token_times[0] > 3.5 for i in hit)  # none before the loss was found (last ping 0.0)


def test_with_the_retries_spent_the_request_fails_with_the_reason():
    nodes = [NodeShape("colocated", 256), NodeShape("colocated", 256)]
    specs = _specs(4, out=200)
    c = _cluster(nodes, [Kill("colocated-0", 1.0), Kill("colocated-1", 6.0)], retries=1)
    recs = c.run(specs)
    assert all(r.status == "failed" for r in recs)
    # recomputed once off colocated-0, then lost again; or, lost with colocated-1, nowhere to go
    reasons = {("retries spent" if "not recomputed: retries spent" in r.error else
                "no node" if "no node's pool holds it" in r.error else r.error) for r in recs}
    assert reasons == {"retries spent", "no node"}, reasons
    assert c.faults.figures()["failed_for_lost_nodes"] >= 1
    assert c.is_done()  # every request ended


@pytest.mark.parametrize("retries", [0, 2])
def test_a_transfer_past_the_timeout_moves_to_the_fallback_then_is_recomputed_then_fails(retries):
    # 32 tokens of 64-byte pages = 128 bytes over 10 B/s: 12.8 s, past a 5 s timeout everywhere.
    # A timeout is no fault of the request's: as the real prefill node marks it retry, the
    # router recomputes it (prefill again, then a timeout per decode node) until its retries are spent
    nodes = [NodeShape("prefill", 256), NodeShape("decode", 256), NodeShape("decode", 256)]
    c = _cluster(nodes, retries=retries, link=LinkModel(10.0), transfer_timeout_s=5.0)
    (rec,) = c.run([RequestSpec(0.01, "t", "x", 32, 4)])
    assert rec.status == "failed" and "timeout" in rec.error
    assert "retries spent" in rec.error
    assert c.faults.figures()["recomputes"] == retries
    # each attempt: a prefill step, then one timeout per decode node
    assert rec.end_time == pytest.approx(0.01 + (1 + retries) * (STEP + 10.0), abs=0.2)
    for n in c.nodes.values():
        assert n.pool.num_free == n.pool.num_pages and not n.pool.owners()


@pytest.mark.parametrize("bad", ["decode-1", "@3", "decode-1@", "decode-1@x", "decode-1@-2"])
def test_kill_flags_are_checked(bad):
    with pytest.raises(ValueError, match="NODE@SECONDS"):
        Kill.parse(bad)


def test_a_kill_of_a_node_the_cluster_does_not_have_is_refused():
    with pytest.raises(ValueError, match="no such node"):
        _cluster([NodeShape("colocated", 64)], [Kill("decode-3", 1.0)])
