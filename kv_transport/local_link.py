"""The local link: framed control messages over an abstract Unix socket read by the event loop,
bound to a ZeroMQ peer by a ticket from a Grant.

Control messages between two processes of one host over a Unix stream socket read by the
event loop itself (the shm backend's control path once a peer has a grant).

Why: ZeroMQ passes every message through an I/O thread at each end, so one message can wake
several threads; on a small virtual machine each wake of an idle core costs tens to hundreds
of microseconds. Over a Unix socket that uvloop reads directly a message wakes the peer's loop
and nothing else (`python -m pdtb.microbench.link` times a round trip both ways). A
one-sided transfer has four control messages in a row on its path (header, Grant, last
Commit, Ack) and one Commit per piece.

Setting up (shm_backend.py): a receiver listens on an abstract-namespace socket (no file to
leave behind) and names it in every Grant with a ticket minted for the ZeroMQ peer the Grant
goes to. The sender connects and sends the ticket as its first message; the receiver then
treats messages on the connection as that peer's and answers that peer over it.

An abstract socket has no file permissions, so the listener takes connections only from
processes of its own user (SO_PEERCRED), at most MAX_STRANGERS at a time before their ticket,
and the first message must be the ticket, small (HELLO_BYTES), within HELLO_TIMEOUT_S. A wrong
ticket, a frame count or message size over the limits, or a connection that ends inside a
message closes the connection: the messages before the bad one are dispatched, nothing after.

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
MAX_QUEUED = 64  # parsed messages waiting for the loop (ZeroMQ's default queue); more pause reading
MAX_BUFFERED = 64 << 20  # bytes queued for a peer that does not read: the link counts as stuck
HELLO_BYTES = 128  # the first message (HELLO, ticket) is no larger
HELLO_TIMEOUT_S = 5.0  # a connection that has not shown a ticket by then is closed
MAX_STRANGERS = 16  # connections without a ticket yet; more are closed at once


class LinkError(ConnectionError):
    """The link is closed or its peer does not read."""


def _same_user(transport) -> bool:
    """Whether the process at the other end runs as this user (SO_PEERCRED; True where the
    platform cannot say)."""
    sock = transport.get_extra_info("socket")
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (AttributeError, OSError):
        return True
    return uid == os.getuid()


def pack(frames: list) -> list:
    """The buffers that carry `frames` on a link (the frames themselves are not copied)."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    head = struct.pack(f"<{len(views) + 1}I", len(views), *(len(v) for v in views))
    return [head, *views]


class _Framer:
    """Splits a byte stream into messages, one at a time; LinkError on one over the limits
    (which a listener raises once a connection has shown its ticket)."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.buf = bytearray()

    def next(self) -> list[bytes] | None:
        """The next whole message in the buffer, or None."""
        buf = self.buf
        if len(buf) < 4:
            return None
        n = _U32.unpack_from(buf, 0)[0]
        if not 0 < n <= self.max_frames:
            raise LinkError(f"a message of {n} frames (at most {self.max_frames})")
        if len(buf) < 4 + 4 * n:
            return None
        lens = struct.unpack_from(f"<{n}I", buf, 4)
        total = sum(lens)
        if total > self.max_bytes:
            raise LinkError(f"a message of {total} bytes (at most {self.max_bytes})")
        at = 4 + 4 * n
        if len(buf) < at + total:
            return None
        frames = []
        for ln in lens:
            frames.append(bytes(buf[at:at + ln]))
            at += ln
        del buf[:at]
        return frames


class _Conn(asyncio.Protocol):
    """One end of a link: parsed messages go to `deliver(conn, frames)`."""

    def __init__(self, framer: _Framer, deliver, lost, on_made=None) -> None:
        self.framer, self.deliver, self.lost, self.on_made = framer, deliver, lost, on_made
        self.transport: asyncio.Transport | None = None
        self.peer: bytes | None = None  # (listener side) the peer its ticket names
        self.paused = False
        self.deadline: asyncio.TimerHandle | None = None  # (listener side) for the ticket

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.on_made is not None:
            self.on_made(self)

    def data_received(self, data: bytes) -> None:
        self.framer.buf += data
        while not self.transport.is_closing():
            try:
                frames = self.framer.next()
            except LinkError as e:
                log.warning("link: closing a connection: %s", e)
                self.transport.abort()
                return
            if frames is None:
                return
            if not self.deliver(self, frames):
                self.transport.abort()
                return

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
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
        c = _Conn(_Framer(2, HELLO_BYTES), self._deliver, self._lost, on_made=self._made)
        self._conns.add(c)
        return c

    def _made(self, c: _Conn) -> None:
        """A new connection: only a process of this user, and only so many before their tickets."""
        strangers = sum(1 for x in self._conns if x.peer is None and x.transport is not None
                        and not x.transport.is_closing())  # (this one included; not those still to start)
        if strangers > MAX_STRANGERS or not _same_user(c.transport):
            log.warning("link: a connection refused (%s)", "too many without a ticket" if strangers > MAX_STRANGERS
                        else "another user")
            c.transport.abort()
            return
        loop = asyncio.get_running_loop()
        c.deadline = loop.call_later(HELLO_TIMEOUT_S, lambda: None if c.peer is not None else c.transport.abort())

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
            c.framer.max_frames, c.framer.max_bytes = self.max_frames, self.max_bytes
            if c.deadline is not None:
                c.deadline.cancel()
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
    """The sending side: one link to one receiver, its messages queued for one reader. A link
    that ends stays `ended` only once every message received before the end was taken, so
    that an Ack that came just before the receiver went away is still read."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.queue: collections.deque[list[bytes]] = collections.deque()
        self.ready = asyncio.Event()
        self._conn = _Conn(_Framer(max_frames, max_bytes), self._deliver, self._lost)

    async def connect(self, name: str, ticket: str, timeout: float) -> None:
        """Connect to the listener `name` and present `ticket`; OSError (or LinkError, also an
        OSError) if it is not there or the ticket cannot be sent. Nothing stays open on failure."""
        if not name.startswith("\0"):
            raise OSError(f"not a link name: {name!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            loop = asyncio.get_running_loop()
            await bounded(loop.sock_connect(sock, name), timeout)
            await bounded(loop.create_unix_connection(lambda: self._conn, sock=sock), timeout)
            try:
                hello = ticket.encode("ascii")
            except UnicodeEncodeError:
                raise LinkError("the ticket is not ASCII") from None
            self._conn.write([HELLO, hello])
        except BaseException:
            self.close()
            sock.close()
            raise

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
        """The oldest message, or None."""
        if not self.queue:
            self.ready.clear()
            return None
        return self.queue.popleft()

    @property
    def ended(self) -> bool:
        """The link has ended and every message received before the end was taken."""
        return not self.queue and self._conn.transport is not None and self._conn.transport.is_closing()

    def _lost(self, c: _Conn) -> None:
        self.ready.set()  # (the reader finds the queue drained, then `ended`)

    def close(self) -> None:
        if self._conn.transport is not None:
            self._conn.transport.abort()
