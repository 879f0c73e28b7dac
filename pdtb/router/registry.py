"""Node registry: one zmq DEALER per node, pings, dispatch, and routing of token events.

    router DEALER (identity = router_id) ──connect──▶ node ROUTER (control address), one per node
    ping loop  every ping_interval: Ping(seq) to each node; NodeStats -> NodeState.stats, last_seen;
               a node is down when it has been silent for health_timeout and its connection has
               dropped (a socket monitor sees the peer's TCP close: a process that died), or silent
               for hang_timeout whatever the connection (hung, or its host died); a node down fails
               the requests that depend on it. A live node is silent while one long engine step
               runs (a 2,048-token prefill chunk took 1-6 s on 2 shared cores): that is not death.
    reader     one Poller over all DEALERs; TokenBatch events -> the request's asyncio.Queue
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
Queues carry TokenEvent items, or a RequestFailed that `next_event` raises.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio

from pdtb.nodes.handoff import HandoffEvent, HandoffState, advance
from pdtb.nodes.protocol import (AbortRequest, Drain, GenerateRequest, HandoffNotice, Migrate, MigrationReport, NodeDown,
                                 NodeStats, Ping, ProtocolError, Target, TokenBatch, TokenEvent, decode_message,
                                 encode_message)
from pdtb.aio import bounded
from pdtb.router.cache_route import ROUTES, CacheChoice, PrefixView, candidates_of, pick_by_cache, score_all
from pdtb.router.fair_route import D2lpmRouter, RouteCandidate
from pdtb.router.config import NodeSpec
from pdtb.router.migration import Migration, MigrationBook
from pdtb.router.rebalance import MODES as REBALANCE_MODES, DecodeView, Rebalancer, ReqView

log = logging.getLogger("pdtb.router.registry")
MAX_RECV_BYTES = 16 << 20  # TokenBatch and NodeStats are small; larger frames drop the connection
SEND_HWM = 10_000
MAX_DRAIN = 256  # messages read from one socket per poll
CLOSE_LINGER_MS = 200  # bounded: ctx.term() waits at most this long for unsent messages
FALLBACKS = 3  # other decode nodes a disaggregated request may be handed to


class RequestFailed(Exception):
    """A request ended without a result: `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, node_lost: bool = False, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.node_lost = node_lost  # a node it depended on is gone: recomputing it elsewhere may succeed
        self.param = param  # a 400's request field at fault ("prompt", "max_tokens")


@dataclass(eq=False)
class NodeState:
    """What the router knows about one node."""

    spec: NodeSpec
    socket: zmq.asyncio.Socket | None = field(default=None, repr=False)
    stats: NodeStats | None = None  # latest answer to a ping
    last_seen: float | None = None  # monotonic time of `stats`
    pending_pages: dict[str, int] = field(default_factory=dict)  # request id -> pages sent, not yet in stats
    # prefill or colocated node: request id -> prompt tokens sent since its last stats report
    # (reports are up to 0.5 s old: without these, every request of that window went to one node)
    pending_tokens: dict[str, int] = field(default_factory=dict)
    refused_at: float | None = None  # monotonic time a request could not be sent to it (queue full: likely dead)
    connected: bool = False  # the DEALER's connection stands (socket monitor events)
    dropped_at: float | None = None  # monotonic time its connection last dropped
    monitor: zmq.asyncio.Socket | None = field(default=None, repr=False)
    prefix_view: PrefixView = field(default_factory=PrefixView, repr=False)  # route "cache": pages it may hold
    drain_sent: bool = False  # this router told it to drain (it counts as draining before its next report)
    lost: bool = False  # judged down by the health loop, and not heard from since (that judgement comes once)

    @property
    def node_id(self) -> str:
        return self.stats.node_id if self.stats else self.spec.address

    def healthy(self, now: float, timeout: float, hang_timeout: float | None = None) -> bool:
        """Answered within `timeout`, or (with `hang_timeout`) within that while connected."""
        if self.last_seen is None:
            return False
        silent = now - self.last_seen
        # the connection vouches for a silent node only if it has not dropped since its last
        # answer: a node restarted on the same port reconnects at once, but its stats (its KV
        # address) are the dead one's until it answers
        steady = self.connected and (self.dropped_at is None or self.dropped_at < self.last_seen)
        return silent <= timeout or (hang_timeout is not None and steady and silent <= hang_timeout)

    def free_pages_estimate(self) -> int:
        return (self.stats.pages_free if self.stats else 0) - sum(self.pending_pages.values())

    def queued_tokens_estimate(self) -> int:
        """Prompt tokens waiting at the node: its last report plus those sent since."""
        return (self.stats.queued_tokens if self.stats else 0) + sum(self.pending_tokens.values())


def pick_prefill(nodes: list[NodeState]) -> NodeState | None:
    """Fewest queued prompt tokens (reported, plus sent since); tie: fewest running + waiting."""
    return min(nodes, key=lambda n: (n.queued_tokens_estimate(), n.stats.running + n.stats.waiting), default=None)


def pick_most_free(nodes: list[NodeState]) -> NodeState | None:
    """Most free pages after subtracting pages recently sent there."""
    return max(nodes, key=lambda n: n.free_pages_estimate(), default=None)


def load_order(n: NodeState) -> tuple:
    """A prefill or colocated node's place in the load rule's order, lower first: pick_prefill's
    key for a prefill node, pick_most_free's for a colocated one."""
    if n.spec.role == "prefill":
        return (n.queued_tokens_estimate(), n.stats.running + n.stats.waiting)
    return (-n.free_pages_estimate(),)


@dataclass
class Placement:
    """Where one request goes."""

    entry: NodeState  # gets the GenerateRequest (prefill or colocated)
    decode: NodeState | None  # disaggregated: the decode node
    cached: CacheChoice | None = None  # route "cache": the entry's score, overlap and the prompt's page hashes


@dataclass(eq=False)
class RequestHandle:
    """One in-flight request as the registry tracks it."""

    request_id: str
    entry: NodeState  # the node that got the GenerateRequest (prefill or colocated)
    decode: NodeState | None  # disaggregated: the chosen decode node
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    entry_started: bool = False  # the entry node has sent its first event
    handoff: HandoffState | None = None  # disaggregated: where the hand-off stands (pdtb/nodes/handoff.py)
    held: list[TokenEvent] = field(default_factory=list)  # decode events that overtook the first token
    fallbacks: list[str] = field(default_factory=list)  # decode node ids that may hold it: the chosen one and its fallbacks
    prefix_overlap_tokens: int = 0  # route "cache": prompt tokens the entry node was believed to hold cached
    tenant: str = ""  # route "d2lpm": the client its entry node's credit is charged to
    tokens: int = 0  # output tokens put on the queue
    migration: Migration | None = None  # a live migration under way, or whose source's last tokens are due

    @property
    def handed_off(self) -> bool:
        """The decode node holds it: the prefill node is no longer needed."""
        return self.handoff is HandoffState.DELIVERED

    def depends_on(self) -> list[NodeState]:
        if self.decode is None:
            return [self.entry]
        return [self.decode] if self.handed_off else [self.entry, self.decode]


class NodeRegistry:
    """Connects to every configured node and dispatches requests to them."""

    def __init__(self, specs: tuple[NodeSpec, ...] | list[NodeSpec], *, router_id: str | None = None,
                 ping_interval: float = 0.5, health_timeout: float = 3.0, hang_timeout: float | None = None,
                 default_page_size: int = 16, route: str = "load", rebalance: str = "off",
                 on_fatal: Callable[[BaseException], None] | None = None, curve_dir: str | None = None) -> None:
        self.curve_dir = curve_dir
        self.router_id = router_id or f"router-{os.getpid()}-{secrets.token_hex(4)}"
        self.nodes = [NodeState(s) for s in specs]
        self.ping_interval, self.health_timeout = ping_interval, health_timeout
        self.hang_timeout = hang_timeout if hang_timeout is not None else max(health_timeout, 30.0)
        self.default_page_size = default_page_size
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        self.route = route
        self.d2lpm = D2lpmRouter()  # route "d2lpm": per-(client, worker) credit (pdtb/router/fair_route.py)
        if rebalance not in REBALANCE_MODES:
            raise ValueError(f"rebalance must be one of {', '.join(REBALANCE_MODES)}, got {rebalance!r}")
        self.rebalancer = Rebalancer(rebalance)
        self.book = MigrationBook()
        self.on_downtime: Callable[[float], None] | None = None  # metrics: a migrated request's pause
        self._on_fatal = on_fatal
        self._requests: dict[str, RequestHandle] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._seq = 0

    # -- lifecycle ---------------------------------------------------------------------------
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
                         (zmq.MAXMSGSIZE, MAX_RECV_BYTES), (zmq.IMMEDIATE, 1)):
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

    # -- health --------------------------------------------------------------------------------
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

    # -- receiving -----------------------------------------------------------------------------
    async def _reader(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        poller = zmq.asyncio.Poller()
        by_socket, by_monitor = {}, {}
        while True:
            for node in self.nodes[len(by_socket):]:  # (nodes are only ever appended: add())
                poller.register(node.socket, zmq.POLLIN)
                by_socket[node.socket] = node
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
                for _ in range(MAX_DRAIN):  # bounded, so one chatty node cannot starve the loop
                    try:  # with NOBLOCK, zmq.asyncio returns an already completed future
                        frame = sock.recv(zmq.NOBLOCK).result()
                    except zmq.Again:
                        break
                    self._on_frame(by_socket[sock], frame)

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

    def _on_notice(self, node: NodeState, notice: HandoffNotice) -> None:
        handle = self._requests.get(notice.request_id)
        if handle is None or handle.handoff is None:
            return  # finished, aborted, or colocated: nothing to follow
        if notice.migration_id and node.spec.role == "decode":
            self._migrated(node, handle, notice)
        elif node is handle.entry:
            d = handle.decode  # (the node it was sent to, where another answers to its id now)
            self._move(handle, d if d is not None and d.node_id == notice.decode_node else
                       self.by_id(notice.decode_node, "decode"), notice.decode_node)
            if notice.delivered and handle.decode is not None and handle.decode.node_id == notice.decode_node:
                self._deliver(handle)  # it depends on that decode node alone now
                if handle.decode.lost:  # (the judgement that would fail it came before this notice)
                    self._lost_there(handle, notice.decode_node)
        elif node.spec.role == "decode":
            self._held_by(node, handle)
        else:
            log.warning("hand-off notice for %s from unrelated node %s", notice.request_id, node.spec.address)

    def _on_event(self, node: NodeState, event: TokenEvent) -> None:
        handle = self._requests.get(event.request_id)
        if handle is None:
            return  # finished or aborted here already; late events are expected
        if node is handle.entry:
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

    # -- live migration (pdtb/router/migration.py) -------------------------------------------------
    def decode_node(self, node_id: str) -> NodeState | None:
        return self.by_id(node_id, "decode")

    def by_id(self, node_id: str, role: str | None = None) -> NodeState | None:
        """The node that answers to `node_id` now. An id repeats where a node was started again
        beside the one it replaces (a supervisor's replacement, a restart at another address):
        a healthy node wins over one that is down, then the one added last."""
        now = time.monotonic()
        found = [n for n in self.nodes if n.node_id == node_id and (role is None or n.spec.role == role)]
        return next((n for n in reversed(found) if self.is_healthy(n, now)), found[-1] if found else None)

    def migrate(self, request_id: str, target_id: str, reason: str = "admin", inject: str = "") -> Migration:
        """Start moving a handed-off request to decode node `target_id`. ValueError says why not."""
        handle = self._requests.get(request_id)
        if handle is None or handle.decode is None:
            raise ValueError(f"request {request_id!r} is not decoding on a decode node here")
        if not handle.handed_off or not handle.entry_started:
            raise ValueError(f"request {request_id!r} is not decoding on its decode node yet ({handle.handoff.value})")
        if handle.migration is not None:
            raise ValueError(f"request {request_id!r} is moving already ({handle.migration.migration_id})")
        target = self.decode_node(target_id)
        if target is None or target is handle.decode:
            raise ValueError(f"{target_id!r} is not another decode node")
        if not self.is_healthy(target) or self.draining(target) or not target.stats.kv_addr:
            raise ValueError(f"decode node {target_id} is not available (down or draining)")
        source = handle.decode
        m = self.book.new(request_id, source.node_id, target.node_id, reason, self.router_id)
        if not self._send(source, Migrate(request_id, m.migration_id, Target(target.node_id, target.stats.kv_addr),
                                          reason, inject, target.stats.prefix_ns)):
            self.book.end(m, "failed", f"decode node {source.node_id} is not reachable")
            raise ValueError(f"decode node {source.node_id} is not reachable")
        handle.migration = m
        return m

    def drain(self, node_id: str, reason: str = "drained by the router") -> NodeState:
        """Tell a node to drain: it takes no new work; a decode node's requests are moved away."""
        node = self.by_id(node_id)
        if node is None:
            raise ValueError(f"no node {node_id!r}")
        if not self._send(node, Drain(reason)):
            raise ValueError(f"node {node_id} is not reachable")
        node.drain_sent = True
        return node

    def _migrated(self, node: NodeState, handle: RequestHandle, notice: HandoffNotice) -> None:
        """The target adopted a migrated request: switch to it, or tell it to drop the request."""
        m = handle.migration
        if m is None or m.migration_id != notice.migration_id or m.target != node.node_id or m.switched:
            if node is not handle.decode:
                self._send(node, AbortRequest(handle.request_id, "its migration is over: another node holds it"))
            return
        if handle.tokens > notice.output_tokens:  # the source resumed and went on: it holds the request
            self._send(node, AbortRequest(handle.request_id, "the source resumed the request"))
            self.book.end(m, "failed", "the source resumed it before the target's word came")
            handle.migration = None
            return
        self._switch(handle, node, notice.output_tokens)

    def _switch(self, handle: RequestHandle, target: NodeState, switch_at: int) -> None:
        m = handle.migration
        m.switched, m.switch_at = True, switch_at
        handle.decode = target
        if not self.is_healthy(target):  # it died after taking the request: recompute it
            handle.queue.put_nowait(RequestFailed(503, f"decode node {target.node_id} stopped answering",
                                                  node_lost=True))
            return
        self._caught_up(handle)

    def _caught_up(self, handle: RequestHandle) -> None:
        """Once the source's last tokens are in, the target's held events follow."""
        m = handle.migration
        if m is None or not m.switched or handle.tokens < m.switch_at:
            return
        handle.migration = None
        for ev in m.held:
            self._put(handle, ev)
        m.held.clear()

    def _migration_event(self, node: NodeState, handle: RequestHandle, event: TokenEvent) -> bool:
        """Events of a request that is moving. True: handled here."""
        m = handle.migration
        if not m.switched:
            return False  # the source holds it (the target's events before its notice are dropped below)
        if node is handle.decode:
            if handle.tokens < m.switch_at:
                m.held.append(event)
                return True
            return False
        if node.node_id == m.source:
            if handle.tokens < m.switch_at and not event.finished:
                self._put(handle, event)
                self._caught_up(handle)
            else:  # it went on after the target took over (its confirmation was lost): it lets go
                self._send(node, AbortRequest(handle.request_id, f"the request moved to {m.target}"))
            return True
        return False

    def _on_migration_report(self, node: NodeState, r: MigrationReport) -> None:
        m = self.book.report(r)
        if r.downtime_s > 0 and self.on_downtime is not None:
            self.on_downtime(r.downtime_s)
        handle = self._requests.get(r.request_id)
        if m is None or handle is None or handle.migration is not m:
            return
        if not r.ok and not m.switched:
            handle.migration = None  # it stays at the source (resumed), or ended there
        elif r.ok and not m.switched:  # the target confirmed to the source; its notice is on its way
            target = self.decode_node(m.target)
            if target is not None:
                self._switch(handle, target, r.output_tokens)

    async def _rebalance_loop(self) -> None:
        """Each second: moves from the rebalancer (drains in every mode)."""
        while True:
            await asyncio.sleep(max(1.0, self.ping_interval))
            now = time.monotonic()
            for m in self.book.expire(now):  # no word from its source: it is not moving any more
                h = self._requests.get(m.request_id)
                if h is not None and h.migration is m and not m.switched:
                    h.migration = None
            views = self._decode_views(now)
            if not views:
                continue
            for move in self.rebalancer.plan(views, now):
                try:
                    self.migrate(move.request_id, move.target, move.reason)
                except ValueError as e:
                    log.info("rebalance: %s -> %s not started: %s", move.request_id, move.target, e)
                    continue
                self.rebalancer.started(move, now)

    def _decode_views(self, now: float) -> list[DecodeView]:
        views = []
        for n in self.nodes:
            if n.spec.role != "decode" or not self.is_healthy(n, now) or n.stats is None:
                continue
            extra = n.stats.extra
            reqs = []
            for item in extra.get("requests", []) if isinstance(extra.get("requests"), list) else []:
                try:
                    rid, tenant, pages = item
                except (TypeError, ValueError):
                    continue
                h = self._requests.get(rid)
                if h is not None and h.decode is n and h.migration is None and h.handed_off:
                    reqs.append(ReqView(str(rid), str(tenant), int(pages)))
            waiting = extra.get("tenant_waiting") if isinstance(extra.get("tenant_waiting"), dict) else {}
            views.append(DecodeView(n.node_id, n.stats.pages_total, n.free_pages_estimate(), self.draining(n),
                                    tuple(reqs), {str(k): int(v) for k, v in waiting.items()},
                                    self.book.by_node(n.node_id)))
        return views

    def _held_by(self, node: NodeState, handle: RequestHandle) -> bool:
        """Decode node `node` says (a notice or output) it holds `handle`'s request. True when
        it is the request's decode node now; False when another one holds it (told to drop it)."""
        if node is handle.decode:
            self._deliver(handle)
            return True
        if handle.handed_off:  # a second holder (a hand-off that timed out at the sender but landed)
            log.warning("request %s: decode node %s holds it, but it is handed to %s; dropping it there",
                        handle.request_id, node.node_id, handle.decode.node_id)
            self._send(node, AbortRequest(handle.request_id, "the request is held by another decode node"))
            return False
        # it adopted the KV (a move whose notice is still on its way, or a transfer the sender
        # gave up on that landed after all): it holds the request now
        log.info("request %s: decode node %s holds it (the router had %s)", handle.request_id, node.node_id,
                 handle.decode.node_id)
        self._move(handle, node, node.node_id, spoke=True)
        self._send(handle.entry, AbortRequest(handle.request_id, f"held by decode node {node.node_id}"))
        self._deliver(handle)
        return True

    def _deliver(self, handle: RequestHandle) -> None:
        if not handle.handoff.final:
            handle.handoff = advance(handle.handoff, HandoffEvent.LANDED)

    def _move(self, handle: RequestHandle, new: NodeState | None, node_id: str, spoke: bool = False) -> None:
        """`handle`'s request went to decode node `new` (named `node_id`; None: unknown) instead:
        its prefill node says so, or (`spoke`) that decode node itself."""
        if handle.decode is None or handle.handed_off or new is None or new is handle.decode:
            if new is None or (handle.handed_off and new is not handle.decode):
                log.warning("request %s: ignoring a move to decode node %r (%s)", handle.request_id, node_id,
                            "unknown node" if new is None else "already handed off")
            return
        if not spoke and new.lost:
            self._lost_there(handle, node_id)
            return
        pages = handle.decode.pending_pages.pop(handle.request_id, None)
        if pages is not None:
            new.pending_pages[handle.request_id] = pages
        handle.decode = new
        handle.handoff = advance(handle.handoff, HandoffEvent.MOVE)

    def _lost_there(self, handle: RequestHandle, node_id: str) -> None:
        """`handle`'s request went to decode node `node_id` after the router judged it down: that
        judgement is not made again, so the request fails now rather than at the request timeout."""
        log.warning("request %s: handed to decode node %s, which is down", handle.request_id, node_id)
        handle.queue.put_nowait(RequestFailed(503, f"decode node {node_id} took the request but stopped answering",
                                              node_lost=True))

    # -- sending -------------------------------------------------------------------------------
    def _send(self, node: NodeState, msg) -> bool:
        """Queue one message without blocking; False when the node is unreachable or its queue full."""
        if node.socket is None:
            return False
        try:
            node.socket.send(encode_message(msg), zmq.NOBLOCK).result()  # completed future, see _reader
            return True
        except zmq.Again:
            return False

    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Choose nodes, fill the routing fields of `req`, send it; a node that cannot take it
        (its queue is full: it stopped reading) is skipped and another tried. Raises
        RequestFailed(503) when none can."""
        tried: set[int] = set()
        while True:
            where = self._place(len(req.prompt_token_ids), len(req.prompt_token_ids) + req.params.max_tokens,
                                frozenset(tried), req.prompt_token_ids, req.tenant)
            entry, decode = where.entry, where.decode
            req.router_id = self.router_id
            req.decode_node, req.decode_kv_addr = (decode.node_id, decode.stats.kv_addr) if decode else ("", "")
            others = self._fallbacks(decode, len(req.prompt_token_ids) + req.params.max_tokens) if decode else []
            req.fallbacks = [Target(n.node_id, n.stats.kv_addr) for n in others]
            # the decode nodes that may come to hold it: the chosen one and its fallbacks (none without fallbacks)
            handle = RequestHandle(req.request_id, entry, decode, tenant=req.tenant,
                                   handoff=HandoffState.BOUND if decode is not None else None,
                                   fallbacks=[decode.node_id, *(t.node_id for t in req.fallbacks)] if others else [])
            if self._send(entry, req):
                if where.cached is not None:  # it will hold these pages once prefilled: the next ones follow
                    entry.prefix_view.insert(where.cached.hashes, time.monotonic())
                    handle.prefix_overlap_tokens = where.cached.overlap_tokens
                break
            entry.refused_at = time.monotonic()
            tried.add(id(entry))
            log.warning("%s node %s is not accepting requests; trying another", entry.spec.role, entry.node_id)
        entry.pending_tokens[req.request_id] = len(req.prompt_token_ids)
        pages_node = decode or entry
        pages_node.pending_pages[req.request_id] = self._pages_for(pages_node, len(req.prompt_token_ids) + 1)
        self._requests[req.request_id] = handle
        return handle

    def largest_pool_tokens(self) -> int | None:
        """Tokens the largest pool of an available decode or colocated node holds (prompt and
        output together: what `_place` lets a request reach); None when none has answered yet."""
        sizes = [n.stats.pages_total * self._page_size(n) for role in ("decode", "colocated")
                 for n in self._available(role) if n.stats is not None]
        return max(sizes, default=None)

    def _fallbacks(self, chosen: NodeState, peak_tokens: int) -> list[NodeState]:
        """Up to FALLBACKS other available decode nodes that could hold the request, most free first."""
        others = [n for n in self._available("decode") if n is not chosen and n.stats.kv_addr
                  and self._pages_for(n, peak_tokens) <= n.stats.pages_total]
        return sorted(others, key=lambda n: -n.free_pages_estimate())[:FALLBACKS]

    def _page_size(self, node: NodeState) -> int:
        return node.stats.page_size or self.default_page_size

    def _pages_for(self, node: NodeState, tokens: int) -> int:
        return math.ceil(tokens / self._page_size(node))

    def _pick_entry(self, nodes: list[NodeState], prompt_ids: list[int] | None, tenant: str,
                    by_load) -> tuple[NodeState | None, CacheChoice | None]:
        """The prefill or colocated node of a request, by the route (`by_load`: the load rule)."""
        if prompt_ids is None or self.route == "load":
            return by_load(nodes), None
        if self.route == "cache":
            return pick_by_cache(nodes, prompt_ids)
        cands = candidates_of(nodes)
        scores = score_all(cands, prompt_ids)
        i = self.d2lpm.choose(tenant, len(prompt_ids), [RouteCandidate(n.node_id, sc.overlap_tokens, load_order(n))
                                                         for n, sc in zip(nodes, scores)])
        return (None, None) if i is None else (nodes[i], scores[i])

    def _place(self, prompt_tokens: int, peak_tokens: int, exclude: frozenset = frozenset(),
               prompt_ids: list[int] | None = None, tenant: str = "") -> Placement:
        """Entry node and decode node (None: colocated). A request that no available pool could ever hold
        (prefill: its prompt; decode or colocated: prompt + max_tokens) is a 400, not a node's
        failure after the fact."""
        fits = {role: [n for n in self._available(role, exclude) if self._pages_for(n, need) <= n.stats.pages_total]
                for role, need in (("prefill", prompt_tokens), ("decode", peak_tokens), ("colocated", peak_tokens))}
        decode = pick_most_free(fits["decode"])
        if decode is not None and fits["prefill"]:
            prefill, cached = self._pick_entry(fits["prefill"], prompt_ids, tenant, pick_prefill)
            return Placement(prefill, decode, cached)
        prefill = pick_prefill(fits["prefill"])  # (for the refusal below: no entry is charged)
        colocated, cached = self._pick_entry(fits["colocated"], prompt_ids, tenant, pick_most_free)
        if colocated:
            return Placement(colocated, None, cached)
        too_small = [(role, n) for role in ("prefill", "decode", "colocated") for n in self._available(role, exclude)
                     if n not in fits[role]]
        if too_small:
            role, n = max(too_small, key=lambda rn: rn[1].stats.pages_total)
            need = self._pages_for(n, prompt_tokens if role == "prefill" else peak_tokens)
            what = "its prompt" if role == "prefill" else "prompt + max_tokens"
            raise RequestFailed(400, f"request needs up to {need} KV pages for {what}; the largest {role} "
                                     f"node's pool has {n.stats.pages_total}",
                                param="prompt" if role == "prefill" else "max_tokens")
        missing = [r for r, n in (("prefill", prefill), ("decode", decode)) if n is None]
        roles = {n.spec.role for n in self.nodes}
        what = "colocated" if "colocated" in roles and not {"prefill", "decode"} <= roles else " or ".join(missing)
        raise RequestFailed(503, f"no healthy {what} node available")

    async def next_event(self, handle: RequestHandle, timeout: float) -> TokenEvent:
        """The request's next event. Raises RequestFailed when it failed or nothing came in `timeout`."""
        try:
            item = await bounded(handle.queue.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestFailed(503, f"no response from the nodes for {timeout:g} s") from None
        if isinstance(item, RequestFailed):
            raise item
        return item

    def abort(self, handle: RequestHandle, reason: str, final: bool = False) -> None:
        """Tell every node involved to drop the request (best effort, never blocks). With
        `final`, the node holding it first sends a last event with its timeline."""
        for node in (handle.entry, handle.decode):
            if node is not None:
                self._send(node, AbortRequest(handle.request_id, reason, final))
        m = handle.migration
        if m is not None:  # the other end of a move under way lets go too
            other = self.decode_node(m.target if handle.decode.node_id == m.source else m.source)
            if other is not None:
                self._send(other, AbortRequest(handle.request_id, reason))
        if not handle.handed_off and handle.fallbacks:  # a move may be under way: the new holder drops it too
            for node in self.nodes:
                if node.spec.role == "decode" and node is not handle.decode and node.node_id in handle.fallbacks:
                    self._send(node, AbortRequest(handle.request_id, reason))

    def release(self, handle: RequestHandle) -> None:
        """Forget the request: later events for it are dropped."""
        if self._requests.pop(handle.request_id, None) is not None and self.route == "d2lpm":
            self.d2lpm.charge_output(handle.tenant, handle.entry.node_id, handle.tokens)
        for node in (handle.entry, handle.decode):
            if node is not None:
                node.pending_pages.pop(handle.request_id, None)
                node.pending_tokens.pop(handle.request_id, None)

    @property
    def num_open_requests(self) -> int:
        return len(self._requests)
