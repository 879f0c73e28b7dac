"""ZeroMQ backend: the receiver binds a ROUTER, each sender connects a DEALER.

    sender DEALER ──header / batch / chunk / cancel──> ROUTER receiver
                  <──────── credit / ack / nack ──────  (same socket, routed by identity)

Payload frames are sent with copy=False straight from the export tensor's memory and
received with copy=False; the receiver copies each chunk once, from the zmq frame into the
reserved pool pages. Sockets: bounded send/receive HWMs, MAXMSGSIZE on the receiving side
(a peer sending a larger frame is disconnected by libzmq), linger 0 on close, IMMEDIATE on
the sender (no queueing towards a receiver that is not there: sends time out instead).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import zmq
import zmq.asyncio

from kv_transport.base import TransportError
from kv_transport.config import TransportConfig
from pdtb.aio import bounded
from kv_transport.receiver import ReceiverCore
from kv_transport.sender import SenderCore
from kv_transport.wire import AdmitFn
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

log = logging.getLogger(__name__)


def apply_socket_options(sock: zmq.Socket, config: TransportConfig) -> None:
    """Options both ends share: bounded queues, no linger, optional kernel buffer sizes."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, config.hwm)
    sock.setsockopt(zmq.RCVHWM, config.hwm)
    if "[" in config.endpoint:  # an IPv6 address (tcp://[::1]:port)
        sock.setsockopt(zmq.IPV6, 1)
    if config.socket_buffer_bytes:
        sock.setsockopt(zmq.SNDBUF, config.socket_buffer_bytes)
        sock.setsockopt(zmq.RCVBUF, config.socket_buffer_bytes)


def bind_address(endpoint: str) -> str:
    """Map an ephemeral endpoint to what libzmq binds: tcp port 0 -> '*'."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


async def _recv(sock: zmq.asyncio.Socket, timeout: float) -> list | None:
    try:
        return await bounded(sock.recv_multipart(copy=False), timeout)
    except asyncio.TimeoutError:
        return None


class ZmqSender(SenderCore):
    """SenderCore over a DEALER socket connected to `config.endpoint`."""

    send_errors = (zmq.ZMQError,)

    def __init__(self, config: TransportConfig, spec: KVSpec, name: str = "tx",
                 context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(config, spec, name)
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context(io_threads=1)
        self._sock: zmq.asyncio.Socket | None = None
        self._stale: list[zmq.asyncio.Socket] = []  # reset sockets, closed by the reader

    def _new_socket(self) -> zmq.asyncio.Socket:
        s = self._ctx.socket(zmq.DEALER)
        apply_socket_options(s, self.config)
        s.setsockopt(zmq.MAXMSGSIZE, self.config.max_header_bytes)
        s.setsockopt(zmq.IMMEDIATE, 1)
        if (rid := self._routing_id()) is not None:
            s.setsockopt(zmq.ROUTING_ID, rid)
        if self.config.curve_dir:
            from pdtb.security import CurveKeys, secure_client

            secure_client(s, CurveKeys.load(self.config.curve_dir))
        s.connect(self.config.endpoint)
        return s

    def _routing_id(self) -> bytes | None:
        """The routing id of a new socket; None: the receiving ROUTER picks one."""
        return None

    async def _open(self) -> None:
        self._sock = self._new_socket()

    def _write(self, frames: list, peer: bytes | None):
        return self._sock.send_multipart(frames, copy=False)

    async def _read(self, timeout: float):
        sock = self._sock
        frames = await _recv(sock, timeout)
        while self._stale:  # the reader closes reset sockets: it may be waiting on one
            self._stale.pop().close(linger=0)
        return frames if sock is self._sock else None

    async def _reset(self) -> None:
        old, self._sock = self._sock, self._new_socket()
        try:
            old.disconnect(self.config.endpoint)
        except zmq.ZMQError:
            pass
        self._stale.append(old)

    async def _shutdown(self) -> None:
        for s in [self._sock, *self._stale]:
            if s is not None:
                s.close(linger=0)
        self._stale = []
        if self._own_ctx:
            self._ctx.term()


def _inode(endpoint: str) -> tuple[int, int] | None:
    """(device, inode) of an ipc endpoint's socket file, or None."""
    if not endpoint.startswith("ipc://"):
        return None
    try:
        st = os.stat(endpoint[len("ipc://"):])
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ipc_in_use(endpoint: str) -> bool:
    """True if a process accepts connections on this ipc endpoint's path now."""
    import socket

    if not endpoint.startswith("ipc://") or _inode(endpoint) is None:
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(endpoint[len("ipc://"):])
        return True
    except OSError:  # refused or stale: a dead process's file, safe to bind over
        return False
    finally:
        s.close()


class ZmqReceiver(ReceiverCore):
    """ReceiverCore over a ROUTER socket bound to `config.endpoint`.

    `endpoint` holds the address actually bound (tcp port 0 resolved).
    """

    send_errors = (zmq.ZMQError,)  # e.g. EHOSTUNREACH: the sender is gone (ROUTER_MANDATORY)

    def __init__(self, config: TransportConfig, pool: PagePool, admit: AdmitFn | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        super().__init__(config, pool, admit)
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context(io_threads=1)
        self._sock: zmq.asyncio.Socket | None = None

    async def _open(self) -> None:
        s = self._ctx.socket(zmq.ROUTER)
        apply_socket_options(s, self.config)
        s.setsockopt(zmq.MAXMSGSIZE, max(self.config.max_message_bytes,
                                         self.config.max_header_bytes))
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise instead of vanishing
        if self.config.curve_dir:
            from pdtb.security import CurveKeys, secure_server

            secure_server(s, CurveKeys.load(self.config.curve_dir))
        if _ipc_in_use(self.config.endpoint):
            s.close(linger=0)
            raise TransportError(f"cannot bind {self.config.endpoint}: another process is listening there "
                                 f"(libzmq would silently take the path over)")
        try:
            s.bind(bind_address(self.config.endpoint))
        except zmq.ZMQError as e:
            s.close(linger=0)
            raise TransportError(f"cannot bind {self.config.endpoint}: {e}") from e
        self._sock = s
        self.endpoint = s.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._ipc_inode = _inode(self.endpoint)

    def _write(self, frames: list, peer: bytes | None):
        return self._sock.send_multipart([peer, *frames], copy=False)

    async def _read(self, timeout: float):
        frames = await _recv(self._sock, timeout)
        if frames is None:
            return None
        return frames[0].bytes, frames[1:]

    async def _reset(self) -> None:
        pass

    async def _shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
        if self._sock is not None and self.endpoint.startswith("ipc:///") and \
                _inode(self.endpoint) == getattr(self, "_ipc_inode", None):
            with contextlib.suppress(OSError):  # the socket file we bound (not a successor's); libzmq may leave it
                os.unlink(self.endpoint[len("ipc://"):])
