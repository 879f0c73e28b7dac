"""Nodes behind several router processes (scripts/launch_cluster.sh --routers N): every router
connects its own DEALER (identity = its router_id) to every node. In-process nodes, no sockets
read: a node answers each router's ping to that router, and every per-request reply (token
events, hand-off notices, migration reports, the word that a router's requests were ended) goes
to the router that sent the request, never to another."""
from __future__ import annotations

import asyncio

from pdtb.nodes.node_base import NodeConfig
from pdtb.nodes.protocol import (GenerateRequest, HandoffNotice, Migrate, NodeStats, Params, Ping, Target,
                                 TokenEvent, encode_message)
from pdtb.engine.config import EngineConfig

from async_case import async_test

ROUTERS = ("router-a", "router-b")


def tap_sends(node) -> list[tuple[bytes, object]]:
    """Replace the control socket's sends with a list of (identity, message)."""
    sent = []

    async def send(identity: bytes, msg) -> bool:
        sent.append((identity, msg))
        return True

    node.ctrl.send = send
    return sent


def from_router(node, router: str, msg) -> None:
    node.ctrl._dispatch([router.encode(), encode_message(msg)])


def run_until_idle(node, max_steps: int = 64) -> dict[bytes, list]:
    """Step the engine until it has no work; the events it sent, by router identity."""
    out: dict[bytes, list] = {}
    for _ in range(max_steps):
        if not node.engine.has_work():
            break
        node.on_step_events(node.engine.step(), 0.0)
        for ident, batch in node.sink.take().items():
            out.setdefault(ident, []).extend(batch.events + batch.notices + batch.migrations)
    return out


@async_test
async def test_a_colocated_node_answers_each_router_and_streams_each_its_own_requests(llama_dir):
    from pdtb.colocated.node import ColocatedNode

    node = ColocatedNode(NodeConfig("colocated", "c0", EngineConfig(llama_dir, num_pages=64)))
    sent = tap_sends(node)
    try:
        for i, router in enumerate(ROUTERS):
            from_router(node, router, Ping(i + 1, router))
        await asyncio.sleep(0)  # (the ping answers are tasks)
        assert sorted((ident, type(msg), msg.seq) for ident, msg in sent) == [
            (b"router-a", NodeStats, 1), (b"router-b", NodeStats, 2)]
        for router in ROUTERS:
            for k in range(2):
                from_router(node, router, GenerateRequest(f"{router}-{k}", [5 + k] * 20, Params(max_tokens=4),
                                                          router_id=router))
        events = run_until_idle(node)
        assert sorted(events) == [b"router-a", b"router-b"]
        for router in ROUTERS:
            mine = events[router.encode()]
            assert {e.request_id for e in mine} == {f"{router}-0", f"{router}-1"}
            assert sum(len(e.token_ids) for e in mine) == 8 and sum(e.finished for e in mine) == 2
    finally:
        node.ctx.destroy(linger=0)


@async_test
async def test_one_routers_loss_ends_only_its_requests_and_it_alone_is_told(llama_dir):
    """A node that cannot reach router b (its connection dropped) ends b's requests and frees
    their pages; a's go on. When b is heard again it is told why, and a is told nothing."""
    from pdtb.colocated.node import ColocatedNode

    node = ColocatedNode(NodeConfig("colocated", "c0", EngineConfig(llama_dir, num_pages=64)))
    tap_sends(node)
    try:
        for router in ROUTERS:
            from_router(node, router, GenerateRequest(f"{router}-0", [7] * 20, Params(max_tokens=50), router_id=router))
        node._router_gone("router-b")
        assert sorted(node.seqs) == ["router-a-0"] and node.engine.pool.pages_of("router-b-0") == []
        from_router(node, "router-a", Ping(3, "router-a"))
        assert node.sink.take() == {}
        from_router(node, "router-b", Ping(4, "router-b"))
        told = node.sink.take()
        assert list(told) == [b"router-b"]
        assert [(e.request_id, e.retry) for e in told[b"router-b"].events] == [("router-b-0", True)]
    finally:
        node.ctx.destroy(linger=0)


def test_a_decode_node_tells_each_handed_off_request_to_its_own_router(llama_dir):
    """Hand-offs of two routers' requests land on one decode node: each one's notice (it holds
    the request now) and tokens go to the router named in its hand-off metadata; a migration's
    report goes to the router that asked for it."""
    from decode_node.node import DecodeNode
    from kv_transport.base import ReceivedTransfer, TransferState, TransferStatus

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32)))
    try:
        pool = node.engine.pool
        for router in ROUTERS:
            rid = f"{router}-h"
            pages = pool.allocate(rid, 3)
            extra = {"params": {"max_tokens": 4}, "router_id": router}
            node._adopt(ReceivedTransfer(f"t-{rid}", rid, "t", 40, pages, [5] * 40, [6], 40, extra,
                                         TransferStatus(f"t-{rid}", rid, TransferState.DONE, bytes_total=1)))
        notices = node.sink.take()
        for router in ROUTERS:
            got = notices[router.encode()].notices
            assert [(n.request_id, n.delivered) for n in got] == [(f"{router}-h", True)]
            assert isinstance(got[0], HandoffNotice)
        events = run_until_idle(node)
        for router in ROUTERS:
            mine = [e for e in events[router.encode()] if isinstance(e, TokenEvent)]
            assert {e.request_id for e in mine} == {f"{router}-h"} and mine[-1].finished
        from_router(node, "router-b", Migrate("router-a-h", "m1", Target("d1", "tcp://127.0.0.1:9"), "admin"))
        reports = node.sink.take()
        assert list(reports) == [b"router-b"] and reports[b"router-b"].migrations[0].migration_id == "m1"
    finally:
        node.ctx.destroy(linger=0)
