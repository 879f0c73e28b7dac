"""Hand-off fallbacks: a prefill node moves a hand-off its decode node cannot take to another
decode node the router named, and the router follows it (no processes here; the real-cluster
check is in tests/clusters/test_cluster.py)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdtb.nodes.protocol import GenerateRequest, HandoffNotice, NodeDown, NodeStats, Params, Target, TokenEvent
from kv_transport import TransferState
from kv_transport.fail_codes import FailCode
from pdtb.router.config import NodeSpec

from async_case import async_test

X, Y, Z = Target("dx", "tcp://127.0.0.1:11"), Target("dy", "tcp://127.0.0.1:12"), Target("dz", "tcp://127.0.0.1:13")


class FakeSender:
    """Stands in for a KV sender: every transfer waits until the test ends it."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.status: dict[str, SimpleNamespace] = {}
        self.cancelled: list[str] = []

    def export_buffer(self, nbytes: int):
        return None

    def send(self, export, meta) -> str:
        tid = f"t{len(self.sent)}-{meta.extra['router_id']}"
        self.sent.append(tid)
        self.status[tid] = SimpleNamespace(state=TransferState.TRANSFERRING, code=None, reason=None, bytes_total=100,
                                           duration_s=0.01)
        return tid

    def end(self, state: TransferState, code: FailCode | None = None, reason: str | None = None) -> None:
        st = self.status[self.sent[-1]]
        st.state, st.code, st.reason = state, code, reason

    def poll(self, tid):
        return self.status.get(tid)

    def cancel(self, tid, reason="cancelled") -> None:
        self.cancelled.append(tid)
        self.end(TransferState.FAILED, FailCode.CANCELLED, reason)


def prefill_node(llama_dir):
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.engine.config import EngineConfig
    from prefill_node.node import PrefillNode

    node = PrefillNode(NodeConfig("prefill", "p0", EngineConfig(llama_dir, num_pages=64)))
    node.senders.by_addr = {t.kv_addr: FakeSender() for t in (X, Y, Z)}
    node.events, node.notices = [], []
    node.sink.add = lambda route, ev: node.events.append(ev)
    node.sink.notice = lambda route, n: node.notices.append(n)
    return node


def submit(node, rid: str, fallbacks=(Y,)) -> None:
    """Send the node request `rid` bound to X, with `fallbacks`."""
    req = GenerateRequest(rid, [5] * 40, Params(max_tokens=8), decode_node=X.node_id, decode_kv_addr=X.kv_addr,
                          fallbacks=list(fallbacks))
    node._on_message(b"r1", req)


def prefill(node) -> None:
    while node.engine.has_work():  # as the node's engine loop does
        events = node.engine.step()
        node.acct.on_output(node.engine.last_output, 0.0)
        node.on_step_events(events, 0.0)


def hand_off(node, rid: str, fallbacks=(Y,)) -> None:
    """Submit `rid` bound to X with `fallbacks`, and run the node until its hand-off exists."""
    submit(node, rid, fallbacks)
    prefill(node)
    assert rid in node.handoffs


async def refused_by_x(node, code: FailCode, reason: str, fallbacks=(Y,)) -> None:
    """Hand request "r" off to X with `fallbacks`, then fail X's transfer with `code` as its
    receiver would; the node has seen the failure when this returns."""
    hand_off(node, "r", fallbacks)
    await node.poll_io()
    node.senders.by_addr[X.kv_addr].end(TransferState.FAILED, code, reason)
    await node.poll_io()


def notices(node) -> list[str]:
    """The decode nodes the router was told of (moves), in order; deliveries left out."""
    return [n.decode_node for n in node.notices if not n.delivered]


def run(node, coro_fn):
    async def go():
        try:
            await coro_fn()
        finally:
            node.ctx.destroy(linger=0)
    asyncio.run(go())


def test_a_refusal_for_good_moves_the_hand_off_to_the_next_decode_node(llama_dir):
    node = prefill_node(llama_dir)

    async def go():
        await refused_by_x(node, FailCode.DRAINING, "receiver: the decode node is shutting down")
        # the hand-off has moved to Y and started there at once
        assert notices(node) == [Y.node_id] and node.handoffs["r"].req.decode_kv_addr == Y.kv_addr
        assert len(node.senders.by_addr[Y.kv_addr].sent) == 1
        node.senders.by_addr[Y.kv_addr].end(TransferState.DONE)
        await node.poll_io()
        assert "r" not in node.handoffs and node.engine.pool.num_free == node.engine.pool.num_pages
        assert not [ev for ev in node.events if ev.finish_reason == "error"]
        last = node.notices[-1]  # the router learns that the request is Y's alone now
        assert last.delivered and last.decode_node == Y.node_id and node.handoffs.get("r") is None

    run(node, go)


def test_without_a_fallback_a_refusal_still_fails_the_request(llama_dir):
    node = prefill_node(llama_dir)

    async def go():
        await refused_by_x(node, FailCode.DRAINING, "receiver: the decode node is shutting down", fallbacks=())
        errors = [ev for ev in node.events if ev.finish_reason == "error"]
        assert len(errors) == 1 and "draining" in errors[0].error and not notices(node)
        assert errors[0].retry  # the router may send it anew elsewhere
        assert "r" not in node.handoffs and node.engine.pool.num_free == node.engine.pool.num_pages

    run(node, go)


@pytest.mark.parametrize("code,retry", [(FailCode.TIMEOUT, True), (FailCode.PEER_LOST, True),
                                        (FailCode.TOO_LARGE, False), (FailCode.BAD_METADATA, False)])
def test_a_failed_hand_off_may_be_recomputed_unless_the_request_is_at_fault(llama_dir, code, retry):
    """A hand-off that failed for a transport reason (a lost or late message: the request is
    not at fault) fails with `retry`, so that the router recomputes it elsewhere; one that no
    pool can hold, or whose metadata does not validate, fails for good."""
    node = prefill_node(llama_dir)

    async def go():
        await refused_by_x(node, code, "receiver: why", fallbacks=())
        (err,) = [ev for ev in node.events if ev.finish_reason == "error"]
        assert err.retry is retry and "r" not in node.handoffs

    run(node, go)


def test_bad_metadata_fails_at_once_rather_than_trying_another_node(llama_dir):
    node = prefill_node(llama_dir)

    async def go():
        await refused_by_x(node, FailCode.BAD_METADATA, "receiver: request metadata digest")
        assert not notices(node) and [ev.finish_reason for ev in node.events if ev.finished] == ["error"]
        assert not node.senders.by_addr[Y.kv_addr].sent

    run(node, go)


def test_a_full_decode_node_passes_the_turn_to_the_next_and_backs_off_only_after_all_refused(llama_dir):
    node = prefill_node(llama_dir)

    async def go():
        await refused_by_x(node, FailCode.NO_PAGES, "receiver: need 3 pages, 0 free", fallbacks=(Y, Z))
        assert notices(node) == [Y.node_id] and len(node.senders.by_addr[Y.kv_addr].sent) == 1  # no wait in between
        node.senders.by_addr[Y.kv_addr].end(TransferState.FAILED, FailCode.NO_PAGES, "receiver: need 3 pages, 0 free")
        await node.poll_io()
        assert len(node.senders.by_addr[Z.kv_addr].sent) == 1
        node.senders.by_addr[Z.kv_addr].end(TransferState.FAILED, FailCode.NO_PAGES, "receiver: need 3 pages, 0 free")
        await node.poll_io()  # all three refused: back to X, after a backoff
        h = node.handoffs["r"]
        assert notices(node) == [Y.node_id, Z.node_id, X.node_id] and h.transfer_id is None and h.retry_at > time.monotonic()
        assert len(node.senders.by_addr[X.kv_addr].sent) == 1

    run(node, go)


def test_node_down_cancels_the_transfer_and_moves_or_fails_the_hand_offs(llama_dir):
    node = prefill_node(llama_dir)

    async def go():
        hand_off(node, "moves")
        hand_off(node, "stuck", fallbacks=())
        await node.poll_io()
        assert len(node.senders.by_addr[X.kv_addr].sent) == 2
        submit(node, "queued", fallbacks=(Z, Y))  # not prefilled yet, bound to X too
        node._on_message(b"r1", NodeDown(X.node_id, "stopped answering"))
        assert len(node.senders.by_addr[X.kv_addr].cancelled) == 2
        assert notices(node) == [Z.node_id, Y.node_id] and node.handoffs["moves"].req.decode_node == Y.node_id
        errors = [ev for ev in node.events if ev.finish_reason == "error"]
        assert [ev.request_id for ev in errors] == ["stuck"] and "stopped answering" in errors[0].error
        assert errors[0].retry  # the router sends it anew elsewhere, as for its own view of the loss
        await node.poll_io()
        assert len(node.senders.by_addr[Y.kv_addr].sent) == 1
        prefill(node)
        assert node.handoffs["queued"].targets == [Z, Y]  # X is off its list
        # a request sent after that (the router saw X answer again: a restart) goes to X
        hand_off(node, "later")
        assert node.handoffs["later"].req.decode_node == X.node_id

    run(node, go)


# ---- the router's side -------------------------------------------------------------------------
def registry():
    from pdtb.router.registry import NodeRegistry

    reg = NodeRegistry([NodeSpec("prefill", "tcp://127.0.0.1:1"), NodeSpec("decode", "tcp://127.0.0.1:2"),
                        NodeSpec("decode", "tcp://127.0.0.1:3")])
    p, a, b = reg.nodes
    now = time.monotonic()
    p.stats, p.last_seen = NodeStats("p", "prefill", 0, 100, 100), now
    a.stats, a.last_seen = NodeStats("a", "decode", 0, 100, 90, kv_addr="tcp://127.0.0.1:22"), now
    b.stats, b.last_seen = NodeStats("b", "decode", 0, 100, 50, kv_addr="tcp://127.0.0.1:23"), now
    return reg, p, a, b


def drain(handle) -> list[TokenEvent]:
    out = []
    while not handle.queue.empty():
        out.append(handle.queue.get_nowait())
    return out


@async_test
async def test_the_router_names_fallbacks_and_follows_a_move():
    reg, p, a, b = registry()
    sent = []
    reg.node_set.send = lambda node, msg: sent.append((node, msg)) or True
    req = GenerateRequest("r", [5] * 20, Params(max_tokens=4))
    handle = reg.submit(req)
    assert handle.decode is a and req.fallbacks == [Target("b", "tcp://127.0.0.1:23")]
    assert "r" in a.pending_pages
    reg.follower.on_event(p, TokenEvent("r", [7]))
    reg.follower.on_notice(p, HandoffNotice("r", "b"))  # p moved it
    assert handle.decode is b and not handle.handed_off and "r" in b.pending_pages and not a.pending_pages
    reg.follower.on_notice(b, HandoffNotice("r", "b", delivered=True))  # b adopted it
    reg.follower.on_event(b, TokenEvent("r", [8]))
    assert handle.handed_off and [e.token_ids for e in drain(handle)] == [[7], [8]]
    # a has it too (a transfer that timed out at p but landed): told to drop it
    reg.follower.on_event(a, TokenEvent("r", [9]))
    assert not drain(handle) and [(n, type(m).__name__) for n, m in sent[1:]] == [(a, "AbortRequest")]


@async_test
async def test_a_decode_node_that_adopted_the_request_holds_it_before_any_notice():
    """b's events come before p's notice (different connections), or b adopted a transfer p had
    given up on while p tries another node: b holds the request. Its output is passed on at
    once (not set aside until a notice that might never come, then thrown away), and p is told
    to drop its hand-off."""
    reg, p, a, b = registry()
    sent = []
    reg.node_set.send = lambda node, msg: sent.append((node, msg)) or True
    handle = reg.submit(GenerateRequest("r", [5] * 20, Params(max_tokens=4)))
    reg.follower.on_event(p, TokenEvent("r", [7]))
    reg.follower.on_event(b, TokenEvent("r", [8]))
    reg.follower.on_event(b, TokenEvent("r", [9], finished=True, finish_reason="length"))
    assert handle.decode is b and handle.handed_off
    assert [e.token_ids for e in drain(handle)] == [[7], [8], [9]]
    assert [(n, m.request_id) for n, m in sent[1:]] == [(p, "r")]  # p drops its hand-off


@async_test
async def test_a_delivered_hand_off_depends_on_its_decode_node_alone():
    """The KV reached a, then a died before its first event: the prefill node no longer holds
    the request, so a NodeDown cannot move it; it must fail now, not at the request timeout
    (600 s)."""
    reg, p, a, b = registry()
    reg.node_set.send = lambda node, msg: True
    handle = reg.submit(GenerateRequest("r", [5] * 20, Params(max_tokens=4)))
    reg.follower.on_event(p, TokenEvent("r", [7]))
    reg.follower.on_notice(p, HandoffNotice("r", "a", delivered=True))
    assert handle.handed_off and handle.decode is a
    drain(handle)
    reg.follower.fail_dependents(a)
    with pytest.raises(Exception, match="stopped answering"):
        raise handle.queue.get_nowait()


@async_test
async def test_an_abort_reaches_every_decode_node_that_may_hold_the_request():
    """A client gone while a move notice is on its way: the node the request moved to gets the
    abort too (it decoded to max_tokens for nobody)."""
    reg, p, a, b = registry()
    sent = []
    reg.node_set.send = lambda node, msg: sent.append((node, msg)) or True
    handle = reg.submit(GenerateRequest("r", [5] * 20, Params(max_tokens=4)))
    reg.abort(handle, "client disconnected")
    assert {n.node_id for n, m in sent[1:] if type(m).__name__ == "AbortRequest"} == {"p", "a", "b"}


@async_test
async def test_a_dead_decode_node_fails_only_requests_without_a_way_out():
    reg, p, a, b = registry()
    reg.node_set.send = lambda node, msg: True
    moving = reg.submit(GenerateRequest("moving", [5] * 20, Params(max_tokens=4)))
    b.last_seen = None  # b is down too: nothing left to move to
    stuck = reg.submit(GenerateRequest("stuck", [5] * 20, Params(max_tokens=4)))
    b.last_seen = time.monotonic()
    assert moving.fallbacks == ["a", "b"] and stuck.fallbacks == []
    reg.follower.fail_dependents(a)
    assert moving.queue.empty()  # its prefill node moves it (NodeDown)
    with pytest.raises(Exception, match="stopped answering"):
        raise stuck.queue.get_nowait()


@async_test
async def test_a_move_names_the_node_that_answers_to_the_id_not_the_one_it_replaced():
    """A replacement reports the id of the node it replaced, which stays listed (down): the
    prefill node's notice names that id, and the request follows the live node. Following the
    dead one would leave it waiting for events that never come (the live node's are refused
    as a second holder's)."""
    from pdtb.router.registry import NodeState

    reg, p, a, b = registry()
    sent = []
    reg.node_set.send = lambda node, msg: sent.append((node, msg)) or True
    a.last_seen = time.monotonic() - 60  # a is down
    a2 = NodeState(NodeSpec("decode", "tcp://127.0.0.1:4"))  # as NodeRegistry.add lists it (no sockets here)
    reg.nodes.append(a2)
    a2.stats, a2.last_seen = NodeStats("a", "decode", 0, 100, 100, kv_addr="tcp://127.0.0.1:24"), time.monotonic()
    assert reg.by_id("a") is a2 and reg.decode_node("a") is a2
    handle = reg.submit(GenerateRequest("r", [5] * 20, Params(max_tokens=4)))
    assert handle.decode is a2  # the most free pages, beside b
    reg.follower.on_event(p, TokenEvent("r", [7]))
    reg.follower.on_notice(p, HandoffNotice("r", "a", delivered=True))
    assert handle.decode is a2 and handle.handed_off
    reg.follower.on_event(a2, TokenEvent("r", [8], finished=True, finish_reason="length"))
    assert [e.token_ids for e in drain(handle)] == [[7], [8]]
    assert not [m for _, m in sent[1:] if type(m).__name__ == "AbortRequest"]


@async_test
async def test_a_hand_off_to_a_node_judged_down_fails_the_request_at_once():
    """The router judges a node down once (when it stops answering); a notice that the request
    went there after that judgement fails it now, not at the request timeout (600 s)."""
    reg, p, a, b = registry()
    reg.node_set.send = lambda node, msg: True
    moved = reg.submit(GenerateRequest("moved", [5] * 20, Params(max_tokens=4)))
    stays = reg.submit(GenerateRequest("stays", [5] * 20, Params(max_tokens=4)))
    assert moved.decode is a and stays.decode is a
    b.last_seen = time.monotonic() - 60  # silent, not judged yet (the router's loop stalled): no verdict
    reg.follower.on_notice(p, HandoffNotice("moved", "b"))
    assert moved.decode is b and moved.queue.empty()
    b.lost = True  # judged now
    reg.follower.on_notice(p, HandoffNotice("moved", "b", delivered=True))
    with pytest.raises(Exception, match="decode node b took the request but stopped answering"):
        raise moved.queue.get_nowait()
    a.lost = True
    reg.follower.on_notice(p, HandoffNotice("stays", "a", delivered=True))  # delivered where it was sent
    assert stays.handed_off and stays.queue.qsize() == 1


@async_test
async def test_a_prefill_node_s_retry_is_moot_once_a_decode_node_holds_the_request():
    """The hand-off timed out at the prefill node but landed: the decode node adopted the
    request and streams it, so the prefill node's failure (marked retry) is dropped rather than
    passed on (it would recompute the request while b serves it); before any decode node holds
    it, the same failure reaches the request."""
    reg, p, a, b = registry()
    reg.node_set.send = lambda node, msg: True
    held = reg.submit(GenerateRequest("r", [5] * 20, Params(max_tokens=4)))
    reg.follower.on_event(p, TokenEvent("r", [7]))
    reg.follower.on_event(b, TokenEvent("r", [8]))  # b adopted it
    reg.follower.on_event(p, TokenEvent("r", [], True, "error", "KV transfer to the decode node failed: timeout", retry=True))
    assert held.handed_off and [e.token_ids for e in drain(held)] == [[7], [8]]
    fresh = reg.submit(GenerateRequest("s", [5] * 20, Params(max_tokens=4)))
    reg.follower.on_event(p, TokenEvent("s", [7]))
    reg.follower.on_event(p, TokenEvent("s", [], True, "error", "KV transfer to the decode node failed: timeout", retry=True))
    assert [e.retry for e in drain(fresh)] == [False, True]
