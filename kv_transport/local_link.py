"""Control messages between two processes of one host over a Unix stream socket read by the
event loop itself (the shm backend's control path once a peer has a grant).

Why: ZeroMQ passes every message through an I/O thread at each end, so one message can wake
several threads; on a small virtual machine each wake of an idle core costs tens to hundreds
of microseconds. Over a Unix socket that uvloop reads directly a message wakes the peer's loop
and nothing else (`python -m kv_transport.bench_link` times a round trip both ways). A
one-sided transfer has four control messages in a row on its path (header, Grant, last
Commit, Ack) and one Commit per piece.

Setting up (shm_backend.py): a receiver listens on an abstract-namespace socket (no file to
leave behind) and names it in every Grant with a ticket minted for the ZeroMQ peer the Grant
goes to. The sender connects and sends the ticket as its first message; the receiver then
treats messages on the connection as that peer's and answers that peer over it. A wrong
ticket, a frame count or message size over the limits, or a connection that ends inside a
message closes the connection; nothing on it is dispatched.

Framing (little endian):

    u32 n | u32 len_0 .. u32 len_{n-1} | frame_0 bytes .. frame_{n-1} bytes
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import socket
import struct

from pdtb.aio import bounded

log = logging.getLogger(__name__)
HELLO = b"PDTBLINK1"
_U32 = struct.Struct("<I")
MAX_QUEUED = 256  # parsed messages waiting for the loop; more pause reading the connection
MAX_BUFFERED = 64 << 20  # bytes queued for a peer that does not read: the link counts as stuck


class LinkError(ConnectionError):
    """The link is closed or its peer does not read."""


def pack(frames: list) -> list:
    """The buffers that carry `frames` on a link (the frames themselves are not copied)."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    head = struct.pack(f"<{len(views) + 1}I", len(views), *(len(v) for v in views))
    return [head, *views]


class _Framer:
    """Splits a byte stream into messages; raises LinkError on one over the limits."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[list[bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            n = _U32.unpack_from(self.buf, 0)[0]
            if not 0 < n <= self.max_frames:
                raise LinkError(f"a message of {n} frames (at most {self.max_frames})")
            if len(self.buf) < 4 + 4 * n:
                break
            lens = struct.unpack_from(f"<{n}I", self.buf, 4)
            total = sum(lens)
            if total > self.max_bytes:
                raise LinkError(f"a message of {total} bytes (at most {self.max_bytes})")
            at = 4 + 4 * n
            if len(self.buf) < at + total:
                break
            frames = []
            for ln in lens:
                frames.append(bytes(self.buf[at:at + ln]))
                at += ln
            del self.buf[:at]
            out.append(frames)
        return out


class _Conn(asyncio.Protocol):
    """One end of a link: parsed messages go to `deliver(conn, frames)`."""

    def __init__(self, framer: _Framer, deliver, lost) -> None:
        self.framer, self.deliver, self.lost = framer, deliver, lost
        self.transport: asyncio.Transport | None = None
        self.peer: bytes | None = None  # (listener side) the peer its ticket names
        self.paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.framer.feed(data)
        except LinkError as e:
            log.warning("link: closing a connection: %s", e)
            self.transport.abort()
            return
        for frames in messages:
            if self.transport.is_closing() or not self.deliver(self, frames):
                self.transport.abort()
                return

    def connection_lost(self, exc) -> None:
        if self.framer.buf:
            log.warning("link: a connection ended inside a message (%d bytes dropped)", len(self.framer.buf))
        self.lost(self)

    def write(self, frames: list) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise LinkError("the link is closed")
        if t.get_write_buffer_size() > MAX_BUFFERED:
            raise LinkError(f"the peer has not read {t.get_write_buffer_size()} bytes")
        t.writelines(pack(frames))


class LinkListener:
    """The receiving side: accepts links from peers holding a ticket, and queues their messages
    as (peer, frames) for one reader, with any others `put` there (the receiver's ZeroMQ
    socket's), in order of arrival."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.name = f"\0pdtb-link-{os.getpid()}-{secrets.token_hex(8)}"
        self.queue: collections.deque[tuple[bytes, list]] = collections.deque()
        self.ready = asyncio.Event()  # set while `queue` holds messages
        self.room = asyncio.Event()  # set while `queue` is under MAX_QUEUED: a `put` source waits for it
        self.room.set()
        self._tickets: collections.OrderedDict[str, bytes] = collections.OrderedDict()  # ticket -> peer
        self._ticket_of: dict[bytes, str] = {}  # peer -> its ticket
        self._links: dict[bytes, _Conn] = {}  # peer -> its live link
        self._conns: set[_Conn] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.name)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._server = await asyncio.get_running_loop().create_unix_server(self._protocol, sock=sock)

    def _protocol(self) -> _Conn:
        c = _Conn(_Framer(self.max_frames, self.max_bytes), self._deliver, self._lost)
        self._conns.add(c)
        return c

    def ticket(self, peer: bytes, limit: int = 4096) -> str:
        """A ticket that binds a link to `peer` (the same one for a peer asked again)."""
        t = self._ticket_of.get(peer)
        if t is None:
            t = self._ticket_of[peer] = secrets.token_hex(16)
            self._tickets[t] = peer
            while len(self._tickets) > limit:  # peers come and go: the oldest tickets lapse
                del self._ticket_of[self._tickets.popitem(last=False)[1]]
        return t

    def linked(self, peer: bytes | None) -> bool:
        return peer in self._links

    def send(self, peer: bytes, frames: list) -> None:
        """Send `frames` to `peer` over its link; LinkError if it has none that works."""
        c = self._links.get(peer)
        if c is None:
            raise LinkError("no link to this peer")
        c.write(frames)

    def _deliver(self, c: _Conn, frames: list[bytes]) -> bool:
        if c.peer is None:  # the first message: HELLO and a ticket
            peer = self._tickets.get(frames[1].decode("ascii", "replace")) \
                if len(frames) == 2 and frames[0] == HELLO else None
            if peer is None:
                log.warning("link: a connection without a valid ticket closed")
                return False
            old = self._links.get(peer)
            if old is not None and old is not c:
                old.transport.abort()
            c.peer, self._links[peer] = peer, c
            return True
        self.put((c.peer, frames))
        if not self.room.is_set() and not c.paused:
            c.paused = True
            c.transport.pause_reading()
        return True

    def put(self, item: tuple[bytes, list]) -> None:
        """Queue a message (peer, frames) from another source behind the links' ones."""
        self.queue.append(item)
        self.ready.set()
        if len(self.queue) >= MAX_QUEUED:
            self.room.clear()

    def take(self) -> tuple[bytes, list] | None:
        """The oldest queued message, or None."""
        if not self.queue:
            self.ready.clear()
            return None
        item = self.queue.popleft()
        if not self.room.is_set() and len(self.queue) < MAX_QUEUED // 2:
            self.room.set()
            for c in self._conns:
                if c.paused and not c.transport.is_closing():
                    c.paused = False
                    c.transport.resume_reading()
        return item

    def _lost(self, c: _Conn) -> None:
        self._conns.discard(c)
        if c.peer is not None and self._links.get(c.peer) is c:
            del self._links[c.peer]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.abort()
        self._conns.clear()
        self._links.clear()


class LinkClient:
    """The sending side: one link to one receiver, its messages queued for one reader."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.queue: collections.deque[list[bytes]] = collections.deque()
        self.ready = asyncio.Event()
        self._conn = _Conn(_Framer(max_frames, max_bytes), self._deliver, self._lost)
        self.on_lost = None  # called once when an established link ends

    async def connect(self, name: str, ticket: str, timeout: float) -> None:
        """Connect to the listener `name` and present `ticket`; OSError if it is not there."""
        if not name.startswith("\0"):
            raise OSError(f"not a link name: {name!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            loop = asyncio.get_running_loop()
            await bounded(loop.sock_connect(sock, name), timeout)
            await bounded(loop.create_unix_connection(lambda: self._conn, sock=sock), timeout)
        except BaseException:
            sock.close()
            raise
        self._conn.write([HELLO, ticket.encode("ascii")])

    @property
    def up(self) -> bool:
        t = self._conn.transport
        return t is not None and not t.is_closing()

    def send(self, frames: list) -> None:
        self._conn.write(frames)

    def _deliver(self, c: _Conn, frames: list[bytes]) -> bool:
        self.queue.append(frames)
        self.ready.set()
        return True

    def take(self) -> list[bytes] | None:
        if not self.queue:
            self.ready.clear()
            return None
        return self.queue.popleft()

    def _lost(self, c: _Conn) -> None:
        if self.on_lost is not None:
            cb, self.on_lost = self.on_lost, None
            cb()

    def close(self) -> None:
        self.on_lost = None
        if self._conn.transport is not None:
            self._conn.transport.abort()
