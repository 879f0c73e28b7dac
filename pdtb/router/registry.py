"""Node registry: one zmq DEALER per node, pings, dispatch, and routing of token events.

    router DEALER (identity = router_id) ──connect──▶ node ROUTER (control address), one per node
    ping loop  every ping_interval: Ping(seq) to each node; NodeStats -> NodeState.stats, last_seen;
               a node is down when it has been silent for health_timeout and its connection has
               dropped (a socket monitor sees the peer's TCP close: a process that died), or silent
               for hang_timeout whatever the connection (hung, or its host died); a node down fails
               the requests that depend on it. A live node is silent while one long engine step
               runs (a 2,048-token prefill chunk took 1-6 s on 2 shared cores): that is not death.
    reader     one Poller over all DEALERs; TokenBatch events -> the request's EventQueue (event_queue.py)
    submit     choose nodes (pick_* below), send GenerateRequest to the prefill/colocated node; with
               route "cache" the prefill/colocated node is scored by cached prefix against load
               (pdtb/router/cache_route.py) and the request's pages join that node's PrefixView

A request in disaggregated mode depends on its prefill node until its decode node sends a first
event, then on the decode node alone. Decode events that overtake the prefill node's first token
(different connections) are held until that token arrives, so the output stays in order.

Fallbacks: with the chosen decode node the router names up to FALLBACKS other decode nodes that
fit the request; the prefill node moves the hand-off to one of them when the chosen one cannot
take it and says so with a HandoffNotice, and says `delivered` once the KV has landed (states:
pdtb/nodes/handoff.py; the router follows BOUND, MOVED and DELIVERED).
A decode node that sends events for a request not yet handed off holds it (it adopted the KV,
maybe from a transfer its sender had given up on): it becomes the request's decode node, and
the prefill node is told to drop its hand-off. Once the request is handed off, any other decode
node that sends events for it is told to drop it. A decode node that stops answering fails the
requests handed (or delivered) to it, and those with no fallback left; the prefill nodes are
told (`NodeDown`) and move the others. An abort goes to the fallbacks too (a move may be under way).
Live migration (`migrate`, pdtb/router/migration.py): a handed-off request moves to another
decode node; its events come from the source until the token count the target's notice names,
then from the target. A rebalancer (pdtb/router/rebalance.py, `--rebalance`) decides moves from
the decode nodes' reports each second, and moves every request off a draining decode node.
Queues carry TokenEvent items, or a RequestFailed that `next_event` raises."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Callable

import zmq
import zmq.asyncio

from pdtb.nodes.protocol import NodeDown, NodeStats, Ping, ProtocolError, TokenBatch, TokenEvent, decode_message
from pdtb.router.cache_route import ROUTES
from pdtb.router.fair_route import D2lpmRouter
from pdtb.router.config import NodeSpec
from pdtb.router.migration import MigrationBook
from pdtb.router.rebalance import MODES as REBALANCE_MODES, Rebalancer
from pdtb.router.dispatch import FALLBACKS, Dispatch  # noqa: F401 (FALLBACKS: the simulator's router)
from pdtb.router.following import Following
from pdtb.router.node_state import (NodeState, Placement, RequestFailed, RequestHandle,  # noqa: F401
                                    load_order, pick_most_free, pick_prefill)
from pdtb.router.rebalance_loop import RebalanceLoop

log = logging.getLogger("pdtb.router.registry")
MAX_RECV_BYTES = 16 << 20  # TokenBatch and NodeStats are small; larger frames drop the connection
SEND_HWM = 10_000
MAX_DRAIN = 256  # messages read from one socket per poll
CLOSE_LINGER_MS = 200  # bounded: ctx.term() waits at most this long for unsent messages


class NodeRegistry(Dispatch, Following, RebalanceLoop):
    """Connects to every configured node and dispatches requests to them: connections, health
    and reading frames here; placing and sending in dispatch.py, following hand-offs and
    migrations in following.py, the rebalance loop in rebalance_loop.py."""

    def __init__(self, specs: tuple[NodeSpec, ...] | list[NodeSpec], *, router_id: str | None = None,
                 ping_interval: float = 0.5, health_timeout: float = 3.0, hang_timeout: float | None = None,
                 default_page_size: int = 16, route: str = "load", rebalance: str = "off",
                 on_fatal: Callable[[BaseException], None] | None = None, curve_dir: str | None = None,
                 num_routers: int = 1) -> None:
        self.curve_dir = curve_dir
        self.router_id = router_id or f"router-{os.getpid()}-{secrets.token_hex(4)}"
        self.nodes = [NodeState(s) for s in specs]
        self.ping_interval, self.health_timeout = ping_interval, health_timeout
        self.hang_timeout = hang_timeout if hang_timeout is not None else max(health_timeout, 30.0)
        self.default_page_size = default_page_size
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        self.route = route
        # route "d2lpm": per-(client, worker) credit, this process's own (pdtb/router/fair_route.py);
        # with several routers behind one port each sees 1/num_routers of a client's requests
        self.d2lpm = D2lpmRouter(charge_scale=float(num_routers))
        if rebalance not in REBALANCE_MODES:
            raise ValueError(f"rebalance must be one of {', '.join(REBALANCE_MODES)}, got {rebalance!r}")
        self.rebalancer = Rebalancer(rebalance)
        self.book = MigrationBook()
        self.on_downtime: Callable[[float], None] | None = None  # metrics: a migrated request's pause
        self._on_fatal = on_fatal
        self._requests: dict[str, RequestHandle] = {}
        self.num_submitted = 0  # requests this process sent to a node (GET /router)
        self._node_back: list[asyncio.Future] = []  # node_back() waiters, woken when a node turns healthy
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._seq = 0

    async def start(self) -> None:
        """Connect one DEALER per node and start the ping and reader tasks."""
        self._ctx = zmq.asyncio.Context()
        for node in self.nodes:
            self._connect(node)
        for coro in (self._ping_loop(), self._reader(), self._rebalance_loop()):
            task = asyncio.create_task(coro)
            task.add_done_callback(self._task_done)
            self._tasks.append(task)

    def _connect(self, node: NodeState) -> None:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self.router_id.encode())
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, SEND_HWM), (zmq.RCVHWM, SEND_HWM),
                         (zmq.MAXMSGSIZE, MAX_RECV_BYTES), (zmq.IMMEDIATE, 1), (zmq.IPV6, "[" in node.spec.address)):
            s.setsockopt(opt, val)
        if self.curve_dir:
            from pdtb.security import CurveKeys, secure_client

            secure_client(s, CurveKeys.load(self.curve_dir))
        node.monitor = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        s.connect(node.spec.address)
        node.socket = s

    def add(self, spec: NodeSpec) -> NodeState:
        """A node that joins while the router runs (a replacement started by a supervisor); it
        takes work once it has answered a ping, as the nodes given at start do. ValueError if a
        node with that address is listed already."""
        if any(n.spec.address == spec.address for n in self.nodes):
            raise ValueError(f"a node at {spec.address} is listed already")
        node = NodeState(spec)
        self._connect(node)
        self.nodes.append(node)
        log.info("node %s at %s added", spec.role, spec.address)
        return node

    async def node_back(self, timeout: float) -> None:
        """Until a node turns healthy (its first answer, or its first after a silence), or
        `timeout` seconds."""
        fut = asyncio.get_running_loop().create_future()
        self._node_back.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._node_back:
                self._node_back.remove(fut)

    def retire(self, key: str) -> NodeState:
        """A node whose process is gone for good (its replacement is added), by node id or
        address: /health stops waiting for it. ValueError unless the health loop has judged it
        lost (its requests were failed or moved then), or it never answered this router (it
        died before this router started): a live node is drained, not retired."""
        found = [n for n in self.nodes if key in (n.node_id, n.spec.address) and not n.retired]
        if not found:
            raise ValueError(f"no node {key!r} to retire")
        node = found[0]
        if not node.lost and node.last_seen is not None:
            raise ValueError(f"node {key} still answers (or is not judged lost yet): not retired")
        node.retired = True
        log.info("node %s retired", key)
        return node

    def fail_all(self, reason: str) -> int:
        """Fail every open request with a 503 `reason` (its handler reports it to the client and
        aborts it at its nodes). Returns how many there were."""
        handles = list(self._requests.values())
        for handle in handles:
            handle.queue.put_nowait(RequestFailed(503, reason))
        return len(handles)

    async def close(self) -> None:
        """Fail every open request, stop the tasks, close the sockets."""
        self.fail_all("router shutting down")
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()
        for node in self.nodes:
            if node.socket is not None:
                node.socket.disable_monitor()
                node.socket.close(linger=CLOSE_LINGER_MS)  # lets last aborts leave; IMMEDIATE: none queue for dead peers
                node.socket = None
            if node.monitor is not None:
                node.monitor.close(linger=0)
                node.monitor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.critical("router task %s failed", task.get_coro().__name__, exc_info=task.exception())
        if self._on_fatal:
            self._on_fatal(task.exception())

    def is_healthy(self, node: NodeState, now: float | None = None) -> bool:
        return node.healthy(time.monotonic() if now is None else now, self.health_timeout, self.hang_timeout)

    def _available(self, role: str, exclude: frozenset = frozenset()) -> list[NodeState]:
        """Nodes of `role` that answered pings recently, are not draining, and have not refused
        a request since their last answer (a node killed a moment ago still looks healthy until
        the health timeout, but its queue no longer drains)."""
        now = time.monotonic()
        return [n for n in self.nodes if n.spec.role == role and self.is_healthy(n, now) and not self.draining(n)
                and id(n) not in exclude and not (n.refused_at is not None and n.refused_at >= n.last_seen)]

    @staticmethod
    def draining(node: NodeState) -> bool:
        return node.drain_sent or bool(node.stats and node.stats.draining)

    def _cluster_views(self) -> dict:
        """Per decode or colocated node, what the others hold, from their last stats
        (fairness/cluster.py): a tenant's share of KV memory is cluster-wide."""
        from fairness.cluster import views

        pool = {}
        for node in self.nodes:
            st = node.stats
            if st is None or node.lost or st.role not in ("decode", "colocated"):
                continue
            tenants = (st.extra or {}).get("tenant_pages") or {}
            pool[node.node_id] = (st.pages_total, {str(t): int(n) for t, n in tenants.items()
                                                   if isinstance(n, (int, float))})
        return views(pool)

    async def _ping_loop(self) -> None:
        was_healthy = {id(n): False for n in self.nodes}
        last = time.monotonic()
        while True:
            self._seq += 1
            views = self._cluster_views()
            for node in self.nodes:
                view = views.get(node.node_id)
                self._send(node, Ping(self._seq, self.router_id, view.other_pages, view.elsewhere) if view
                           else Ping(self._seq, self.router_id))
            now = time.monotonic()
            if now - last > self.ping_interval + self.health_timeout / 2:
                # This loop itself was held up (a long synchronous step): the nodes' answers
                # may sit unread in the sockets, so silence proves nothing. Judge next round.
                log.warning("router loop stalled %.1f s; node health is judged again next round", now - last)
                last = now
                await asyncio.sleep(self.ping_interval)
                continue
            last = now
            for node in self.nodes:
                ok = self.is_healthy(node, now)
                if was_healthy.get(id(node), False) and not ok:  # (a node added since start: not yet judged)
                    log.warning("node %s (%s) stopped answering", node.node_id, node.spec.address)
                    node.lost = True
                    self._node_lost(node, "stopped answering")
                if ok and not was_healthy.get(id(node), False):
                    for fut in self._node_back:
                        if not fut.done():
                            fut.set_result(None)
                    self._node_back.clear()
                was_healthy[id(node)] = ok
            await asyncio.sleep(self.ping_interval)

    def _node_lost(self, node: NodeState, what: str) -> None:
        """`node`'s process is gone ("stopped answering", "restarted"): fail what depends on it;
        prefill nodes move hand-offs off it."""
        self._fail_dependents(node, what)
        for m in [m for m in self.book.in_flight.values() if m.source == node.node_id]:
            # its report will not come: the target took the request (switched), or it is recomputed
            self.book.end(m, "done" if m.switched else "failed", f"the source {what}" +
                          (" after the target took the request" if m.switched else ""))
        if node.spec.role == "decode":
            now = time.monotonic()
            for p in self.nodes:
                if p.spec.role == "prefill" and self.is_healthy(p, now):
                    self._send(p, NodeDown(node.node_id, what))

    def _fail_dependents(self, node: NodeState, what: str = "stopped answering") -> None:
        now = time.monotonic()
        for handle in list(self._requests.values()):
            if node is handle.decode and not handle.handed_off and self.is_healthy(handle.entry, now) and any(
                    n.node_id in handle.fallbacks and n.node_id != node.node_id and self.is_healthy(n, now)
                    for n in self.nodes if n.spec.role == "decode"):
                continue  # its prefill node moves the hand-off to a fallback (NodeDown) or fails it
            mig = handle.migration
            due = mig is not None and mig.switched and mig.source == node.node_id and handle.tokens < mig.switch_at
            if node in handle.depends_on() or due:
                msg = f"{node.spec.role} node {node.node_id} {what}"
                if node.stats is not None and node.stats.draining:  # its last words (the aborts) were lost
                    msg = f"{node.spec.role} node {node.node_id} shut down: it was draining, then stopped answering"
                handle.queue.put_nowait(RequestFailed(503, msg, node_lost=True))

    async def _reader(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        poller = zmq.asyncio.Poller()
        by_socket, by_monitor, plain = {}, {}, {}
        while True:
            for node in self.nodes[len(by_socket):]:  # (nodes are only ever appended: add())
                poller.register(node.socket, zmq.POLLIN)
                by_socket[node.socket] = node
                # a blocking-API view of the same socket: a NOBLOCK read through zmq.asyncio
                # builds a future per frame, a tenth of the router's work per token
                plain[node.socket] = zmq.Socket.shadow(node.socket.underlying)
                if node.monitor is not None:
                    poller.register(node.monitor, zmq.POLLIN)
                    by_monitor[node.monitor] = node
            for sock, _ in await poller.poll(timeout=int(self.ping_interval * 1000)):
                node = by_monitor.get(sock)
                if node is not None:  # connection events: a dropped connection is how a dead process shows
                    while True:
                        try:
                            event = parse_monitor_message(sock.recv_multipart(zmq.NOBLOCK).result())["event"]
                        except zmq.Again:
                            break
                        node.connected = event == zmq.EVENT_CONNECTED
                        if not node.connected:
                            node.dropped_at = time.monotonic()
                    continue
                raw, node = plain[sock], by_socket[sock]
                for _ in range(MAX_DRAIN):  # bounded, so one chatty node cannot starve the loop
                    try:
                        frame = raw.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frame(node, frame)

    def _on_frame(self, node: NodeState, frame: bytes) -> None:
        try:
            msg = decode_message(frame)
        except ProtocolError as e:
            log.warning("dropping bad message from %s: %s", node.spec.address, e)
            return
        if isinstance(msg, NodeStats):
            old = node.stats
            node.stats, node.last_seen, node.lost = msg, time.monotonic(), False
            node.pending_tokens.clear()  # its queued_tokens counts them now (or they are done)
            if self.route != "load":
                node.prefix_view.update(msg.prefix_summary, node.last_seen)
            if old is not None and old.incarnation and msg.incarnation and old.incarnation != msg.incarnation:
                # restarted (on the same port) faster than the health timeout: the requests of the
                # process that died are gone with it
                log.warning("node %s (%s) restarted", node.node_id, node.spec.address)
                node.drain_sent = False  # a drain asked of the process that died
                self._node_lost(node, "restarted")
        elif isinstance(msg, TokenBatch):
            for notice in msg.notices:  # before the events: an adoption, then its output
                self._on_notice(node, notice)
            for event in msg.events:
                self._on_event(node, event)
            for report in msg.migrations:
                self._on_migration_report(node, report)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, node.spec.address)

    def _on_event(self, node: NodeState, event: TokenEvent) -> None:
        handle = self._requests.get(event.request_id)
        if handle is None:
            return  # finished or aborted here already; late events are expected
        if node is handle.entry:
            if event.retry and handle.handed_off and handle.decode is not None and handle.decode is not node:
                # the hand-off timed out at the prefill node but landed: the decode node holds
                # the request and streams it; the prefill node's word to recompute is moot
                log.info("request %s: %s, but decode node %s holds it", event.request_id, event.error,
                         handle.decode.node_id)
                return
            handle.entry_started = True
            node.pending_tokens.pop(handle.request_id, None)
            self._put(handle, event)
            for held in handle.held:
                self._put(handle, held)
            handle.held.clear()
        elif handle.handoff is not None and node.spec.role == "decode":
            if handle.migration is not None and self._migration_event(node, handle, event):
                return
            if not self._held_by(node, handle):
                return
            if event.token_ids or event.finished:  # its pages now show in the node's device-tier stats
                node.pending_pages.pop(handle.request_id, None)  # (an adopted request may be parked in host)
            if handle.entry_started:
                self._put(handle, event)
            else:
                handle.held.append(event)
        else:
            log.warning("event for %s from unrelated node %s", event.request_id, node.spec.address)

    @staticmethod
    def _put(handle: RequestHandle, event: TokenEvent) -> None:
        handle.tokens += len(event.token_ids)
        handle.queue.put_nowait(event)
