"""`NodeSet`: the router's connections to its nodes and their health: one zmq DEALER per node,
pings, frames read, what each node last reported.

    router DEALER (identity = router_id) ──connect──▶ node ROUTER (control address), one per node
    ping loop  every ping_interval: Ping(seq) to each node; NodeStats -> NodeState.stats, last_seen;
               a node is down when it has been silent for health_timeout and its connection has
               dropped (a socket monitor sees the peer's TCP close: a process that died), or silent
               for hang_timeout whatever the connection (hung, or its host died); a node down goes
               to `on_lost`. A live node is silent while one long engine step runs (a 2,048-token
               prefill chunk took 1-6 s on 2 shared cores): that is not death.
    read loop  one Poller over all DEALERs; NodeStats kept here, TokenBatch to `on_batch`
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from pdtb.nodes.protocol import (Drain, NodeStats, Ping, ProtocolError, SetFaults, TokenBatch, decode_message,
                                 encode_message)
from pdtb.router.config import NodeSpec
from pdtb.router.node_state import NodeState
from pdtb.router.placement import NodeView

log = logging.getLogger("pdtb.router.registry")
MAX_RECV_BYTES = 16 << 20  # TokenBatch and NodeStats are small; larger frames drop the connection
SEND_HWM = 10_000
MAX_DRAIN = 256  # messages read from one socket per poll
CLOSE_LINGER_MS = 200  # bounded: ctx.term() waits at most this long for unsent messages


class NodeSet:
    """Every configured node: its connection, its health and its last report (module docstring).

    `on_batch(node, batch)` takes each TokenBatch read; `on_lost(node, what)` each node judged
    gone ("stopped answering", "restarted"). Both run on the router's loop, from the read or
    ping loop."""

    def __init__(self, specs: tuple[NodeSpec, ...] | list[NodeSpec], *, router_id: str,
                 on_batch: Callable[[NodeState, TokenBatch], None], on_lost: Callable[[NodeState, str], None],
                 ping_interval: float = 0.5, health_timeout: float = 3.0, hang_timeout: float | None = None,
                 default_page_size: int = 16, track_prefixes: bool = False, curve_dir: str | None = None) -> None:
        self.nodes = [NodeState(s) for s in specs]  # only ever appended (add): the read loop relies on it
        self.router_id = router_id
        self.ping_interval, self.health_timeout = ping_interval, health_timeout
        self.hang_timeout = hang_timeout if hang_timeout is not None else max(health_timeout, 30.0)
        self.default_page_size = default_page_size
        self.track_prefixes = track_prefixes  # keep each node's PrefixView (routes cache and d2lpm)
        self.curve_dir = curve_dir
        self.on_batch, self.on_lost = on_batch, on_lost
        self.waiters: list[asyncio.Future] = []  # node_back() callers, woken when a node turns healthy
        self._ctx: zmq.asyncio.Context | None = None
        self._seq = 0

    def open(self) -> None:
        """Connect one DEALER per node (the loops read and ping them)."""
        self._ctx = zmq.asyncio.Context()
        for node in self.nodes:
            self._connect(node)

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

    def close(self) -> None:
        """Close every connection and the context."""
        for node in self.nodes:
            if node.socket is not None:
                node.socket.disable_monitor()
                # lets last aborts leave; IMMEDIATE: none queue for dead peers
                node.socket.close(linger=CLOSE_LINGER_MS)
                node.socket = None
            if node.monitor is not None:
                node.monitor.close(linger=0)
                node.monitor = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def send(self, node: NodeState, msg) -> bool:
        """Queue one message without blocking; False when the node is unreachable or its queue full."""
        if node.socket is None:
            return False
        try:
            node.socket.send(encode_message(msg), zmq.NOBLOCK).result()  # completed future, see read_loop
            return True
        except zmq.Again:
            return False

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
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self.waiters:
                self.waiters.remove(fut)

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

    def is_healthy(self, node: NodeState, now: float | None = None) -> bool:
        return node.healthy(time.monotonic() if now is None else now, self.health_timeout, self.hang_timeout)

    @staticmethod
    def draining(node: NodeState) -> bool:
        return node.drain_sent or bool(node.stats and node.stats.draining)

    def is_available(self, node: NodeState, now: float) -> bool:
        """Answered pings recently, not draining, and has not refused a request since its last
        answer (a node killed a moment ago still looks healthy until the health timeout, but its
        queue no longer drains)."""
        return (node.stats is not None and self.is_healthy(node, now) and not self.draining(node)
                and not (node.refused_at is not None and node.refused_at >= node.last_seen))

    def by_id(self, node_id: str, role: str | None = None) -> NodeState | None:
        """The node that answers to `node_id` now. An id repeats where a node was started again
        beside the one it replaces (a supervisor's replacement, a restart at another address):
        a healthy node wins over one that is down, then the one added last."""
        now = time.monotonic()
        found = [n for n in self.nodes if n.node_id == node_id and (role is None or n.spec.role == role)]
        return next((n for n in reversed(found) if self.is_healthy(n, now)), found[-1] if found else None)

    def drain(self, node_id: str, reason: str = "drained by the router") -> NodeState:
        """Tell a node to drain: it takes no new work; a decode node's requests are moved away."""
        node = self._reachable(node_id, Drain(reason))
        node.drain_sent = True
        return node

    def set_faults(self, node_id: str, faults: dict[str, float], for_s: float) -> NodeState:
        """Tell a node to inject `faults` into its KV sends for `for_s` seconds (chaos runs)."""
        return self._reachable(node_id, SetFaults(dict(faults), float(for_s)))

    def _reachable(self, node_id: str, msg) -> NodeState:
        """The node `node_id`, sent `msg`; ValueError when there is none or it cannot be reached."""
        node = self.by_id(node_id)
        if node is None:
            raise ValueError(f"no node {node_id!r}")
        if not self.send(node, msg):
            raise ValueError(f"node {node_id} is not reachable")
        return node

    def snapshot(self, exclude: frozenset[int] = frozenset()) -> list[NodeView]:
        """Every node as placement sees it (pdtb/router/placement.py); those whose id() is in
        `exclude` count as unavailable."""
        now = time.monotonic()
        views = []
        for i, n in enumerate(self.nodes):
            s = n.stats
            views.append(NodeView(
                i, n.node_id, n.spec.role, available=id(n) not in exclude and self.is_available(n, now),
                pages_total=s.pages_total if s else 0, page_size=(s.page_size if s else 0) or self.default_page_size,
                free_pages=n.free_pages_estimate(), queued_tokens=n.queued_tokens_estimate(),
                busy=s.running + s.waiting if s else 0, kv_addr=s.kv_addr if s else "",
                prefix_ns=s.prefix_ns if s else "", hash_page_size=s.page_size if s else 0,
                prefix_view=n.prefix_view))
        return views

    def cluster_views(self) -> dict:
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

    async def ping_loop(self) -> None:
        was_healthy = {id(n): False for n in self.nodes}
        last = time.monotonic()
        while True:
            self._seq += 1
            views = self.cluster_views()
            for node in self.nodes:
                view = views.get(node.node_id)
                self.send(node, Ping(self._seq, self.router_id, view.other_pages, view.elsewhere) if view
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
                    self.on_lost(node, "stopped answering")
                if ok and not was_healthy.get(id(node), False):
                    for fut in self.waiters:
                        if not fut.done():
                            fut.set_result(None)
                    self.waiters.clear()
                was_healthy[id(node)] = ok
            await asyncio.sleep(self.ping_interval)

    async def read_loop(self) -> None:
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
                    self.on_frame(node, frame)

    def on_frame(self, node: NodeState, frame: bytes) -> None:
        """One frame read from `node`'s connection."""
        try:
            msg = decode_message(frame)
        except ProtocolError as e:
            log.warning("dropping bad message from %s: %s", node.spec.address, e)
            return
        if isinstance(msg, NodeStats):
            old = node.stats
            node.stats, node.last_seen, node.lost = msg, time.monotonic(), False
            node.pending_tokens.clear()  # its queued_tokens counts them now (or they are done)
            if self.track_prefixes:
                node.prefix_view.update(msg.prefix_summary, node.last_seen)
            if old is not None and old.incarnation and msg.incarnation and old.incarnation != msg.incarnation:
                # restarted (on the same port) faster than the health timeout: the requests of the
                # process that died are gone with it
                log.warning("node %s (%s) restarted", node.node_id, node.spec.address)
                node.drain_sent = False  # a drain asked of the process that died
                self.on_lost(node, "restarted")
        elif isinstance(msg, TokenBatch):
            self.on_batch(node, msg)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, node.spec.address)
