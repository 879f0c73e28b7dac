"""The router's side of a live migration (pdtb/router/registry.py, pdtb/router/migration.py), on a
registry with no sockets: which node's token events a moving request takes, in what order, and
who is told to drop it when both ends hold it."""
from __future__ import annotations

import time

import pytest

from pdtb.nodes.handoff import HandoffState
from pdtb.nodes.protocol import (AbortRequest, HandoffNotice, Migrate, MigrationReport, NodeStats, TokenBatch,
                                 TokenEvent)
from pdtb.router.config import NodeSpec
from pdtb.router.registry import NodeRegistry, RequestFailed, RequestHandle


def make_registry():
    """A registry over p0, d0 (the source), d1 (the target); sends are recorded, not sent."""
    reg = NodeRegistry([NodeSpec("prefill", "tcp://127.0.0.1:1"), NodeSpec("decode", "tcp://127.0.0.1:2"),
                        NodeSpec("decode", "tcp://127.0.0.1:3")])
    now = time.monotonic()
    for node, (nid, role) in zip(reg.nodes, (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))):
        node.stats = NodeStats(nid, role, 0, 100, 100, kv_addr=f"tcp://kv-{nid}")
        node.last_seen = now
    sent = []
    reg.node_set.send = lambda node, msg: sent.append((node.node_id, msg)) or True
    p0, d0, d1 = reg.nodes
    handle = RequestHandle("r1", p0, d0, handoff=HandoffState.DELIVERED, entry_started=True)
    reg.dispatch.requests["r1"] = handle
    return reg, handle, sent, (p0, d0, d1)


def tokens(node_id, *ids, finished=False):
    return TokenBatch(node_id, [TokenEvent("r1", list(ids), finished, "length" if finished else None)])


def feed(reg, node, batch):
    for n in batch.notices:
        reg.follower.on_notice(node, n)
    for e in batch.events:
        reg.follower.on_event(node, e)
    for r in batch.migrations:
        reg.follower.on_migration_report(node, r)


def drained(handle) -> list[int]:
    out = []
    while not handle.queue.empty():
        out.extend(handle.queue.get_nowait().token_ids)
    return out


def notice(node_id, mid, n):
    return TokenBatch(node_id, [], [HandoffNotice("r1", node_id, True, mid, n)])


def report(mid, ok, **kw):
    return TokenBatch("d0", [], migrations=[MigrationReport(mid, "r1", "d0", "d1", ok, **kw)])


def test_the_stream_keeps_its_order_across_the_two_connections():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    feed(reg, d0, tokens("d0", 1, 2, 3))
    m = reg.migrate("r1", "d1")
    assert isinstance(sent[-1][1], Migrate) and sent[-1][0] == "d0" and sent[-1][1].target.kv_addr == "tcp://kv-d1"
    with pytest.raises(ValueError, match="moving already"):
        reg.migrate("r1", "d1")
    # the target's notice and first tokens overtake the source's last two tokens
    feed(reg, d1, notice("d1", m.migration_id, 5))
    feed(reg, d1, tokens("d1", 6, 7))
    assert handle.decode is d1 and drained(handle) == [1, 2, 3]
    feed(reg, d0, tokens("d0", 4))
    feed(reg, d0, tokens("d0", 5))
    feed(reg, d0, report(m.migration_id, True, phase="final", output_tokens=5, final_bytes=10))
    feed(reg, d1, tokens("d1", 8, finished=True))
    assert drained(handle) == [4, 5, 6, 7, 8] and handle.migration is None
    assert not any(isinstance(msg, AbortRequest) for _, msg in sent)
    assert reg.book.summary(time.monotonic())["done"][0]["state"] == "done"


def test_a_source_that_resumed_keeps_the_request_and_the_target_drops_it():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    feed(reg, d0, tokens("d0", 1, 2))
    m = reg.migrate("r1", "d1")
    feed(reg, d0, tokens("d0", 3, 4))  # the ACK was lost: the source resumed and went on
    feed(reg, d1, notice("d1", m.migration_id, 2))
    assert handle.decode is d0 and handle.migration is None
    assert ("d1", "r1") in [(n, msg.request_id) for n, msg in sent if isinstance(msg, AbortRequest)]
    feed(reg, d1, tokens("d1", 3))  # anything the target sent anyway is dropped
    assert drained(handle) == [1, 2, 3, 4]


def test_source_events_past_the_switch_are_dropped_and_the_source_lets_go():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    feed(reg, d0, tokens("d0", 1, 2))
    m = reg.migrate("r1", "d1")
    feed(reg, d1, notice("d1", m.migration_id, 2))
    feed(reg, d1, tokens("d1", 3))
    feed(reg, d0, tokens("d0", 9))  # resumed after its ACK was lost: too late, the target has it
    assert drained(handle) == [1, 2, 3]
    assert [(n, type(msg).__name__) for n, msg in sent][-1] == ("d0", "AbortRequest")


def test_a_failed_move_leaves_the_request_at_its_source():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    m = reg.migrate("r1", "d1")
    feed(reg, d0, report(m.migration_id, False, reason="no_pages: full", phase="resumed"))
    assert handle.migration is None and handle.decode is d0
    feed(reg, d1, notice("d1", m.migration_id, 0))  # a stale adoption: told to drop it
    assert sent[-1] == ("d1", sent[-1][1]) and isinstance(sent[-1][1], AbortRequest)
    done = reg.book.summary(time.monotonic())["done"][0]
    assert done["state"] == "failed" and done["outcome"] == "no_pages: full" and done["phase"] == "resumed"


def test_the_sources_confirmation_alone_switches_the_request():
    """The target's notice is late (or lost with the target): the source's ACK'd report switches it."""
    reg, handle, sent, (p0, d0, d1) = make_registry()
    feed(reg, d0, tokens("d0", 1))
    m = reg.migrate("r1", "d1")
    feed(reg, d0, report(m.migration_id, True, phase="final", output_tokens=1))
    assert handle.decode is d1 and handle.migration is None
    feed(reg, d1, notice("d1", m.migration_id, 1))
    feed(reg, d1, tokens("d1", 2))
    assert drained(handle) == [1, 2] and not any(isinstance(msg, AbortRequest) for _, msg in sent)
    reg.follower.fail_dependents(d1)  # now it depends on the target alone
    assert isinstance(handle.queue.get_nowait(), RequestFailed)


def test_a_source_that_dies_before_its_last_tokens_came_fails_the_request_for_recompute():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    m = reg.migrate("r1", "d1")
    feed(reg, d1, notice("d1", m.migration_id, 3))  # the router has 0 of the 3 tokens
    reg.follower.fail_dependents(d0)
    item = handle.queue.get_nowait()
    assert isinstance(item, RequestFailed) and item.node_lost


def test_an_abort_reaches_both_ends_and_bad_moves_are_refused():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    with pytest.raises(ValueError, match="not another decode node"):
        reg.migrate("r1", "d0")
    with pytest.raises(ValueError, match="not decoding"):
        reg.migrate("nope", "d1")
    d1.stats.draining = True
    with pytest.raises(ValueError, match="not available"):
        reg.migrate("r1", "d1")
    d1.stats.draining = False
    handle.entry_started = False  # its first token (from the prefill node) is not in yet
    with pytest.raises(ValueError, match="not decoding on its decode node yet"):
        reg.migrate("r1", "d1")
    handle.entry_started = True
    m = reg.migrate("r1", "d1")
    assert sent[-1][1].target_prefix_ns == d1.stats.prefix_ns
    reg.abort(handle, "client gone")
    assert {n for n, msg in sent if isinstance(msg, AbortRequest)} == {"p0", "d0", "d1"}


def test_the_rebalance_views_list_only_requests_the_router_can_move():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    d0.stats.extra = {"requests": [["r1", "alice", 40], ["unknown", "bob", 9], "garbage"],
                      "tenant_waiting": {"bob": 2}}
    views = {v.node_id: v for v in reg.rebalance.decode_views(time.monotonic())}
    assert [r.request_id for r in views["d0"].requests] == ["r1"] and views["d0"].tenant_waiting == {"bob": 2}
    reg.drain("d0")
    assert reg.rebalance.decode_views(time.monotonic())[0].draining
    moves = reg.rebalancer.plan(list(reg.rebalance.decode_views(time.monotonic())), time.monotonic())
    assert [(mv.request_id, mv.source, mv.target, mv.reason) for mv in moves] == [("r1", "d0", "d1", "drain")]


def test_a_source_lost_ends_its_migrations_in_the_book():
    reg, handle, sent, (p0, d0, d1) = make_registry()
    m = reg.migrate("r1", "d1")
    feed(reg, d1, notice("d1", m.migration_id, 0))  # the target took it, then the source died
    reg.follower.node_lost(d0, "stopped answering")
    done = reg.book.summary(time.monotonic())["done"][0]
    assert done["state"] == "done" and "after the target took" in done["outcome"] and not reg.book.in_flight
