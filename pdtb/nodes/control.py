"""The node side of the control plane: a ZeroMQ ROUTER socket that the router connects to.

Incoming frames are decoded and validated (`pdtb.nodes.protocol.decode_message`); a bad frame is
logged and dropped and the node keeps serving. Outgoing events are batched per router
identity during a step and flushed once per step (`EventSink`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio

from pdtb.security import secure_server
from pdtb.aio import bounded
from pdtb.nodes.protocol import (MAX_CONTROL_BYTES, HandoffNotice, MigrationReport, ProtocolError, TokenBatch, TokenEvent, decode_message,
                                 encode_message)

log = logging.getLogger(__name__)
SEND_TIMEOUT_S = 5.0


class ControlServer:
    """Binds `bind_addr` (tcp://host:0 picks an ephemeral port) and dispatches messages."""

    def __init__(self, ctx: zmq.asyncio.Context, bind_addr: str, handler: Callable[[bytes, object], None],
                 keys=None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
        secure_server(self.sock, keys)
        self.sock.bind(bind_addr)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.handler = handler
        self.bad_frames = 0

    async def serve(self, stop: asyncio.Event, tick_s: float = 0.1) -> None:
        while not stop.is_set():
            if not await self.sock.poll(int(tick_s * 1000)):
                continue
            # NOBLOCK: the engine loop's drain() may have taken the message since poll(); a
            # blocking recv would then wait for the next one and never see `stop`.
            try:
                frames = await self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            self._dispatch(frames)

    async def drain(self, limit: int = 10000) -> int:
        """Handle every message already queued on the socket, without waiting. The engine loop
        calls this between steps: one asyncio wake-up per message would let a long step hold
        up arrivals and pings for as many steps as there are messages."""
        n = 0
        while n < limit and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._dispatch(await self.sock.recv_multipart())
            n += 1
        return n

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.bad_frames += 1
            log.warning("control: dropped message of %d frames", len(frames))
            return
        try:
            msg = decode_message(frames[1])
        except ProtocolError as e:
            self.bad_frames += 1
            log.warning("control: dropped bad frame from %r: %s", frames[0][:32], e)
            return
        try:
            self.handler(frames[0], msg)
        except Exception:  # a message no check foresaw must not take the node down with it
            self.bad_frames += 1
            log.exception("control: handling %s from %r failed; the message is dropped", type(msg).__name__,
                          frames[0][:32])

    async def send(self, identity: bytes, msg) -> bool:
        """Send one message to a connected router; False (logged) if it is gone or stuck."""
        return await self.deliver(identity, msg) is None

    async def deliver(self, identity: bytes, msg) -> str | None:
        """`send`, telling why it failed: None (sent), "gone" (ROUTER_MANDATORY: no such peer is
        connected now) or "stuck" (a peer too slow to take it in time)."""
        try:
            # bounded, not wait_for: on Python >= 3.12 wait_for can call a send that went out a timeout
            await bounded(self.sock.send_multipart([identity, encode_message(msg)]), SEND_TIMEOUT_S)
            return None
        except (zmq.ZMQError, asyncio.TimeoutError) as e:
            log.warning("control: cannot send %s to %r: %s", type(msg).__name__, identity, e)
            return "gone" if isinstance(e, zmq.ZMQError) and e.errno == zmq.EHOSTUNREACH else "stuck"

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket. With `linger_ms`, messages already queued (a node's last words: the
        failures of requests cut by a shutdown) get that long to leave before they are
        dropped; the context's term() waits at most that long."""
        self.sock.close(linger=linger_ms)


class EventSink:
    """Collects TokenEvents and HandoffNotices per router identity; `flush` sends one TokenBatch
    per router.

    A batch the router's socket is not connected for (the router exited or died, or its
    connection dropped) is lost, and the requests it streamed can never be told apart from
    complete ones: `on_gone(router_id)` is called so that the node ends that router's requests
    and frees their pages, instead of generating for nobody until max_tokens (or a drain's
    timeout). A send that merely timed out (a slow router) does not count."""

    def __init__(self, server: ControlServer, node_id: str,
                 on_gone: Callable[[str], None] | None = None) -> None:
        self.server = server
        self.node_id = node_id
        self.on_gone = on_gone
        self._pending: dict[bytes, TokenBatch] = {}

    def _batch(self, router_id: str) -> TokenBatch:
        key = router_id.encode()
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = TokenBatch(self.node_id, [])
        return batch

    def add(self, router_id: str, event: TokenEvent) -> None:
        self._batch(router_id).events.append(event)

    def notice(self, router_id: str, notice: HandoffNotice) -> None:
        self._batch(router_id).notices.append(notice)

    def migration(self, router_id: str, report: MigrationReport) -> None:
        self._batch(router_id).migrations.append(report)

    def take(self) -> dict[bytes, TokenBatch]:
        """The batches collected since the last flush, by router identity (removed here)."""
        pending, self._pending = self._pending, {}
        return pending

    async def flush(self) -> None:
        for ident, batch in self.take().items():
            why = await self.server.deliver(ident, batch)
            if why == "gone" and self.on_gone is not None:
                self.on_gone(ident.decode(errors="replace"))
