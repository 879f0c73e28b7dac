"""Cluster-wide shares (fairness/cluster.py): the view of the other nodes, a node's shares from
cluster-wide ones computed by hand, memfair reading the view, and the ping that carries it."""
from __future__ import annotations

import pytest

from fairness import make_policy
from fairness.cluster import ClusterView, node_shares, views
from pdtb.nodes.protocol import Ping, decode_message, encode_message
from sched_sim import make_request, state


def test_views_are_the_others_by_hand():
    got = views({"d0": (100, {"a": 30, "b": 10}), "d1": (100, {"a": 50}), "d2": (50, {})})
    assert got["d0"] == ClusterView(150, {"a": 50})
    assert got["d1"] == ClusterView(150, {"a": 30, "b": 10})
    assert got["d2"] == ClusterView(200, {"a": 80, "b": 10})
    assert views({"alone": (100, {"a": 1})}) == {}


def one(x):
    return 1.0


def test_node_shares_by_hand():
    """Four nodes of 100 pages, tenants a and b (weight 1): 200 pages each cluster-wide.
    - a holds 300 on the other three, b is only here: a may claim nothing here, b 200, so b's
      share here is the whole pool and a's nothing (four shares for a spread tenant: 50 here).
    - a and b each hold 150 elsewhere: each may claim 50 here: 50 and 50.
    - a holds 120 elsewhere, b 30: claims 80 and 170; max-min over 100 pages: 50 each.
    - a holds 190 elsewhere, b 0: claims 10 and 200: a 10, b 90."""
    assert node_shares({"a": 0, "b": 0}, one, ClusterView(300, {"a": 300}), 100) == {"a": 0.0, "b": 100.0}
    assert node_shares({"a": 0, "b": 0}, one, ClusterView(300, {"a": 150, "b": 150}), 100) == {"a": 50.0, "b": 50.0}
    assert node_shares({"a": 0, "b": 0}, one, ClusterView(300, {"a": 120, "b": 30}), 100) == {"a": 50.0, "b": 50.0}
    assert node_shares({"a": 0, "b": 0}, one, ClusterView(300, {"a": 190}), 100) == pytest.approx({"a": 10.0, "b": 90.0})
    # a third tenant with work only elsewhere still counts in the split: 400 / 3 each
    got = node_shares({"a": 0}, one, ClusterView(300, {"c": 300}), 100)
    assert got == {"a": 100.0}  # a claims 133: all of this node


def test_memfair_reads_the_view_a_spread_tenant_gets_one_share():
    """A 100-page node with tenant a (60 pages here) and tenant b waiting. Alone, memfair gives
    each 50. Told that a holds 300 pages on three other nodes of 100, a may claim nothing here:
    b's share is the node, and a is beyond its share (its pages here are borrowed)."""
    a, b = make_request(240, 4, tenant="a"), make_request(8, 4, tenant="b")
    a.num_computed_tokens = 240
    st = state({a.request_id: 60}, device_total=100, device_free=40)
    pol = make_policy("memfair")
    pol.refresh([a], [b], st)
    assert pol.shares == {"t:a": 50.0, "t:b": 50.0}
    pol.cluster = ClusterView(300, {"a": 300})
    pol.refresh([a], [b], st)
    assert pol.shares == {"t:a": 0.0, "t:b": 100.0} and pol.over == {"t:a": float("inf"), "t:b": 0.0}
    static = make_policy("memfair", None, (("quota_shares", "static"),))
    static.cluster = ClusterView(300, {"a": 300})
    static.refresh([a], [b], st)
    assert static.shares == {"t:a": 50.0, "t:b": 50.0}  # static shares stay this node's own


def test_ping_carries_the_view_and_an_old_ping_still_parses():
    msg = decode_message(encode_message(Ping(3, "r", 300, {"a": 12})))
    assert (msg.other_pages, msg.elsewhere) == (300, {"a": 12})
    bare = decode_message(encode_message(Ping(4)))
    assert (bare.other_pages, bare.elsewhere) == (0, {})
    from pdtb.nodes.protocol import ProtocolError

    import msgpack

    with pytest.raises(ProtocolError, match="elsewhere"):
        decode_message(msgpack.packb({"type": "Ping", "v": encode_message_version(), "seq": 1,
                                      "elsewhere": {"a": "lots"}}))


def encode_message_version() -> int:
    from pdtb.nodes.protocol import PROTOCOL_VERSION

    return PROTOCOL_VERSION
