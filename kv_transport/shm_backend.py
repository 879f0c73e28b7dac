"""One-sided writes into the receiver's pool, for peers on one host (`backend="shm"|"auto"`).

    sender                                             receiver (pools in shared memory)
    header (mode "shm") ────────────────────────────>  admit; reserve pages (device or host tier)
                        <── Grant(pool locator, pages, write slot s, generation g, credit)
    map the pool once; per piece (a quarter of what is left, 1 to 4 chunk_bytes):
      hold slot s at g (shm_slots.py); copy rows straight into the pages; let go
    Commit(checksum) ───────────────────────────────>  revoke s; read the pages back and check
                        <── Ack                         the sum; commit

Control messages start on the ZeroMQ socket of the zmq backend. Every Grant also names the
receiver's local link (local_link.py) and a ticket for the peer it goes to; the sender connects
(again after a lost link or a reset), and once no transfer announced on ZeroMQ is left it
announces on the link (a Unix socket the event loop reads: one wake-up per message where
ZeroMQ's I/O threads take several). A transfer's own messages all go the way its header went;
the receiver answers a linked peer there and pumps ZeroMQ into the same queue, and the sender
checks ZeroMQ at every link message and tick. The payload
bytes move in one copy, from the sender's export into the receiver's pool pages, with no
socket, no receive buffer and no landing copy. The state machines, timeouts, Nacks and page
ownership are the zmq backend's; a link that ends fails the sender's transfers in flight
(PEER_LOST; those announced on ZeroMQ too), as a reset ZeroMQ connection does, once every
message that came on it before the end has been read.

- A receiver whose receiving pool is not shared (PagePool(shared=True)) answers a Credit, and
  the sender streams chunks as in the zmq backend.
- A GPU pool is shared through a CUDA IPC handle (pdtb/engine/cuda_ipc.py): a sender whose
  payload is on a GPU copies device to device, and synchronizes before it lets go of the
  slot; the receiver reads the pages back on the device.
- A sender that cannot map the Grant's pool (another host, another container's /proc) streams
  chunks under the Grant's credit with `backend="auto"`; with `backend="shm"` the transfer
  fails (code peer_lost) with the reason.
- A late writer never touches pages handed out again: every grant has a fresh generation, a
  sender writes a piece only while it holds the slot's lock and reads its generation there, and
  the receiver frees or commits the pages only after it has revoked the slot under that lock.
  A sender inside a piece when its transfer fails (stalled, or slow) keeps the revoke from
  succeeding: the pages stay reserved, the Nack goes out, and the revoke is tried again every
  tick; a sender that dies drops its lock with its files.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
import zmq

from kv_transport import checksum
from kv_transport.admission import AdmitFn, FailCode
from kv_transport.base import TransferState
from kv_transport.config import TransportConfig
from kv_transport.local_link import LinkClient, LinkError, LinkListener
from kv_transport.page_writer import PageWriter, WritePlan
from kv_transport.receiver import _Inbound
from kv_transport.sender import _Outbound, to_host
from kv_transport.shm_read import SOURCE_IDLE_S, Reading, ReadOffers, Sources, read_piece
from kv_transport.shm_slots import SlotGuard, WriteSlots
from kv_transport.wire import Ack, Commit, Credit, Grant, encode
from kv_transport.zmq_backend import ZmqReceiver, ZmqSender
from pdtb.aio import bounded
from pdtb.engine import cuda_ipc
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.shared_memory import Locator, SharedMemoryError, boot_id, data_tensor, open_buffer

log = logging.getLogger(__name__)
S = TransferState
NUM_SLOTS = 1024  # one-sided transfers a receiver lets write at once (more get chunks)
# A piece is a quarter of what is left to write, at least one chunk_bytes and at most
# PIECE_MAX_CHUNKS of them: few Commits (each one wakes the receiver), small pieces at the end,
# so that the read-back of the last one, which nothing overlaps, is short, and no piece holds
# either loop for long (64 MiB in 4 MiB chunks: 16, 12, 9, 6.75, 5.06, 4, 4, 4, 3.19 MiB).
PIECE_SHARE = 4
PIECE_MAX_CHUNKS = 4
MESSAGES_PER_PIECE = 8  # with reads pending, waiting messages taken before the next piece (neither starves)
RELINK_AFTER_S = 10.0  # a link that could not be connected (refused, full) is tried again after this long


def piece_rows(left: int, chunk_rows: int) -> int:
    """Rows in the next piece when `left` rows are still to write, `chunk_rows` to a chunk."""
    return min(left, PIECE_MAX_CHUNKS * chunk_rows, max(chunk_rows, left // PIECE_SHARE))


@dataclass
class _PoolView:
    """What PageWriter needs of a pool: its geometry and its tensor (here, a peer's mapping)."""

    spec: KVSpec
    num_pages: int
    kv: object  # torch.Tensor


@dataclass
class _Target:
    """A receiver pool this sender has mapped."""

    writer: PageWriter
    guard: SlotGuard
    receiver: str  # the token of the receiver's slot table: one per receiver process
    device: bool = False  # a GPU pool (CUDA IPC)


@dataclass
class _Granted:
    """A transfer the receiver let write one-sided."""

    slot: int
    gen: int
    rows: int = 0  # payload rows [0, rows) checked against the sender's running checksum
    running: int = 0  # their checksum, read back from the pages


@dataclass
class _Write:
    """One granted transfer's one-sided write, piece by piece."""

    grant: Grant
    target: _Target
    plan: WritePlan
    next_row: int = 0  # payload rows [0, next_row) are written
    acc: int = 0  # running checksum of the rows written
    not_before: float = 0.0  # (fault injection: a late writer)


def _recv_now(sock) -> list | None:
    """A message already waiting on `sock`, or None (asks libzmq first: no future for nothing)."""
    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        return None
    try:
        fut = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        return fut.result() if fut.done() else None
    except zmq.Again:
        return None


async def _next(ready: asyncio.Event, timeout: float) -> None:
    """Wait at most `timeout` seconds for `ready`."""
    try:
        await bounded(ready.wait(), timeout)
    except asyncio.TimeoutError:
        pass


def _split(frames: list | None):
    """(peer, frames) of a message from the receiver's ROUTER socket, or None."""
    return None if frames is None else (frames[0].bytes, frames[1:])


def _sent() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


LINK = b"link"  # (sender) `peer` of a message that goes on the local link


class ShmSender(ZmqSender):
    """A ZmqSender that writes granted transfers straight into the receiver's shared pool."""

    send_errors = (zmq.ZMQError, LinkError)

    def __init__(self, config: TransportConfig, spec: KVSpec, name: str = "tx", context=None) -> None:
        super().__init__(config, spec, name, context)
        self.strict = config.backend == "shm"
        self._targets: dict[tuple[str, str, str], _Target] = {}  # (pool locator path, its token, slot table's token)
        self._writes: dict[str, _Write] = {}  # transfer id -> its write in progress
        self.one_sided = 0  # transfers written one-sided (the rest went as chunks)
        self._link: LinkClient | None = None  # the receiver's local link, once connected
        self._linking: asyncio.Task | None = None
        self._unreachable: dict[str, float] = {}  # link that could not be connected -> when to try it again
        self._on_link: set[str] = set()  # live transfers announced on the link: all their messages go there
        self.links = 0  # local links connected (a restarted receiver needs a new one)
        self.offers: ReadOffers | None = None  # the read path (shm_read.py), made at the first export_buffer
        self._offered: set[str] = set()  # live transfers offered for reading, no Grant had (yet)
        self.read_by_receiver = 0  # transfers done that the receiver read from the arena
        self._no_arena = config.shm_arena_bytes == 0

    # ---- the read path (shm_read.py) ---------------------------------------------------------
    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        if nbytes <= self.config.inline_max_bytes or self.config.checksum != "sum64":
            return None  # rides in the header message; or no whole-payload sum without a pass (crc32): not offered
        if self.offers is None and not self._no_arena:
            try:
                self.offers = ReadOffers(self.config.shm_arena_bytes)
            except (OSError, ValueError) as e:  # (SharedMemoryError is an OSError)
                log.warning("sender: no export arena (%s); payloads are written one-sided", e)
                self._no_arena = True
        return None if self.offers is None else self.offers.lease(nbytes)

    def _source_for(self, transfer_id: str, data: torch.Tensor, mode: str, whole_sum: int | None):
        if self.offers is None or mode != "shm":
            return None
        source = self.offers.offer(transfer_id, data, whole_sum)
        if source is not None:
            self._offered.add(transfer_id)
        return source

    def _drop_source(self, transfer_id: str, source) -> None:
        self._offered.discard(transfer_id)
        if self.offers is not None:
            self.offers.withdraw(transfer_id)

    def _expire(self, now: float) -> None:
        super()._expire(now)
        if self.offers is not None:
            self.offers.retry()

    # ---- the local link -------------------------------------------------------------------
    def _maybe_link(self, g: Grant) -> None:
        if not (self.config.local_link and g.link and g.host == boot_id()) or \
                self._unreachable.get(g.link, 0.0) > time.monotonic() or self._link is not None or self._linking is not None:
            return
        self._linking = asyncio.ensure_future(self._connect_link(g.link, g.ticket))

    async def _connect_link(self, name: str, ticket: str) -> None:
        link = LinkClient(self.limits.max_batch + 1, self.config.max_header_bytes)
        try:
            await link.connect(name, ticket, self.config.send_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:  # (LinkError is an OSError)
            log.info("sender: no local link to the receiver (%s); control stays on ZeroMQ for %.0fs", e, RELINK_AFTER_S)
            now = time.monotonic()
            self._unreachable = {k: t for k, t in self._unreachable.items() if t > now}
            self._unreachable[name] = now + RELINK_AFTER_S
            return
        finally:
            if self._linking is asyncio.current_task():
                self._linking = None
        self._link = link
        self.links += 1

    def _link_lost(self) -> None:
        """The link ended (the receiver died, closed, or refused what it got), and every message
        that came on it before that was read: what is still in flight is lost."""
        self._link.close()
        self._link = None
        log.warning("sender: the local link to the receiver ended")
        self._on_disconnected()

    # A transfer's messages all take the way its header took, so none overtakes another (a
    # Commit on the link could pass an earlier one still in ZeroMQ's queues), and transfers are
    # announced on the link only once none announced on ZeroMQ is left, Cancels included (a
    # retry of a cancelled request could otherwise arrive before the Cancel: busy).
    def _zmq_pending(self, announcing: list[str]) -> bool:
        """Whether a transfer announced on ZeroMQ (other than `announcing`) or its Cancel is in flight."""
        return any(o.status.state > S.BOOTSTRAPPING and o.status.transfer_id not in self._on_link
                   and o.status.transfer_id not in announcing for o in self._live.values()) or \
            any(c.transfer_id not in self._on_link for c in self._control)

    async def _emit(self, frames: list, kind: str, owners: list, peer: bytes | None = None) -> None:
        tids = [o.status.transfer_id for o in owners]
        if kind in ("header", "batch") and self._link is not None and not self._zmq_pending(tids):
            self._on_link.update(tids)
        on_link = bool(tids) and all(t in self._on_link for t in tids)
        await super()._emit(frames, kind, owners, LINK if on_link else None)

    async def _flush_control(self) -> None:
        while self._control:
            c = self._control.popleft()
            # (a Cancel for a transfer whose link is gone goes on ZeroMQ: same peer, and it frees
            # the receiver's pages now rather than at its idle timeout)
            way = LINK if c.transfer_id in self._on_link and self._link is not None else None
            self._on_link.discard(c.transfer_id)
            await super()._emit(encode(c), "cancel", [], way)

    def _finish(self, o: _Outbound, state: TransferState, reason: str | None = None,
                notify: bool = False, code: FailCode | None = None) -> None:
        super()._finish(o, state, reason, notify, code)
        tid = o.status.transfer_id
        self.read_by_receiver += tid in self._offered and o.status.state is S.DONE  # (the state super() settled on)
        self._drop_source(tid, None)
        if not any(c.transfer_id == o.status.transfer_id for c in self._control):
            self._on_link.discard(o.status.transfer_id)  # (a queued Cancel keeps it until it goes)

    def _write(self, frames: list, peer: bytes | None):
        if peer is LINK:
            if self._link is None:
                raise LinkError("the local link ended")
            self._link.send(frames)
            return _sent()
        return super()._write(frames, peer)

    async def _read(self, timeout: float):
        # With a link up the receiver answers this peer only there; ZeroMQ can hold only what
        # it sent before the link came up, picked up here at the next link message or tick.
        link = self._link
        if link is None:
            return await super()._read(timeout)
        got = link.take() or _recv_now(self._sock)
        if got is None and not link.ended:
            await _next(link.ready, timeout)
            if link is not self._link:  # dropped meanwhile (a reset): its messages are the old socket's
                return None
            got = link.take() or _recv_now(self._sock)
        if got is None and link.ended:
            self._link_lost()
        return got

    async def _reset(self) -> None:
        self._drop_link()  # the link speaks for the old socket's identity
        await super()._reset()

    def _drop_link(self) -> None:
        if self._linking is not None:
            self._linking.cancel()
            self._linking = None
        if self._link is not None:
            self._link.close()
            self._link = None
        self._on_link.clear()

    def _mode_for(self, nbytes: int) -> str:
        return "inline" if nbytes <= self.config.inline_max_bytes else "shm"

    def _stage(self, data: torch.Tensor, mode: str) -> torch.Tensor:
        """A payload on a GPU stays there for a one-sided write into a GPU pool (a device copy);
        it comes to the host only if the receiver wants bytes (`_host_view`)."""
        if mode == "shm" and data.is_cuda:
            return data.detach().contiguous()
        return super()._stage(data, mode)

    def _host_view(self, o: _Outbound) -> None:
        """Give a payload kept on the GPU its host bytes (chunks, a host-memory pool)."""
        if o.view is None and o.data is not None:
            o.data = to_host(o.data)
            o.view = memoryview(o.data.reshape(-1).view(torch.uint8).numpy())

    def _on_control(self, msg) -> None:
        if isinstance(msg, Credit):
            self._offered.discard(msg.transfer_id)  # the receiver does not read it: chunks
        if isinstance(msg, Ack) and msg.link and self.config.local_link and self._link is None and \
                self._linking is None and self._unreachable.get(msg.link, 0.0) <= time.monotonic() and \
                any(t in self._offered for t in msg.transfer_ids):
            # (only a receiver that read from this sender's arena names a link: it is on this host)
            self._linking = asyncio.ensure_future(self._connect_link(msg.link, msg.ticket))
        if not isinstance(msg, Grant):
            o = self._live.get(msg.transfer_id) if isinstance(msg, Credit) else None
            if o is not None:  # the receiver takes chunks
                self._host_view(o)
            super()._on_control(msg)
            return
        self._maybe_link(msg)
        self._offered.discard(msg.transfer_id)  # the receiver does not read it: a write
        o = self._live.get(msg.transfer_id)
        if o is None or o.status.state is not S.WAITING:
            log.info("sender: late or duplicate grant for %s discarded", msg.transfer_id)
            return
        o.status.state, o.status.t_started = S.TRANSFERRING, time.monotonic()
        if len(msg.pages) != o.header.num_pages:  # the pieces' rows are the header's: they must all have a page
            self._finish(o, S.FAILED, f"the receiver granted {len(msg.pages)} pages for a transfer of "
                         f"{o.header.num_pages}", notify=True, code=FailCode.BAD_MESSAGE)
            return
        try:
            target = self._target(msg)
        except SharedMemoryError as e:
            if self.strict:
                self._finish(o, S.FAILED, f"cannot write the receiver's pool one-sided: {e} "
                             "(--transport auto falls back to ZeroMQ)", notify=True, code=FailCode.PEER_LOST)
                return
            log.info("sender: %s goes as chunks: %s", msg.transfer_id, e)
            self._host_view(o)
            o.upto = max(o.upto, msg.upto)
        else:
            if not (target.device and o.data is not None and o.data.is_cuda):
                self._host_view(o)  # bytes from the host: into host memory, or staged to the GPU
            delay = self.config.faults.shm_delay_s
            self._writes[msg.transfer_id] = _Write(msg, target, target.writer.plan(msg.pages),
                                                   acc=checksum.initial(o.header.checksum_algo),
                                                   not_before=time.monotonic() + delay if delay else 0.0)
        self._wake.set()

    def _target(self, g: Grant) -> _Target:
        key = (g.buffer, g.buffer_token, g.slots_token)  # (a receiver started anew over the same pool has new slots)
        t = self._targets.get(key)
        if t is not None:
            return t
        shape = self.spec.page_shape(g.pool_pages)
        if cuda_ipc.is_cuda_locator(g.buffer):  # a GPU pool: device copies into its memory
            kv = cuda_ipc.open_pool(Locator(g.buffer, g.buffer_token, g.host), shape, self.spec.torch_dtype)
            guard = SlotGuard(Locator(g.slots, g.slots_token, g.host))
        else:
            pool = open_buffer(Locator(g.buffer, g.buffer_token, g.host))
            try:
                if pool.nbytes != g.pool_pages * self.spec.bytes_per_page:
                    raise SharedMemoryError(f"the pool has {pool.nbytes} bytes, not {g.pool_pages} pages of this geometry")
                guard = SlotGuard(Locator(g.slots, g.slots_token, g.host))
            except BaseException:
                pool.close()
                raise
            kv = data_tensor(pool.map, pool.nbytes, shape, self.spec.torch_dtype)
            pool.close()  # the mapping stays (kv holds it); locks go through the guard's own file
        for k, old in list(self._targets.items()):  # a restarted receiver: let the dead one's memory go
            if old.receiver != g.slots_token:
                old.guard.close()
                del self._targets[k]
        t = self._targets[key] = _Target(PageWriter(_PoolView(self.spec, g.pool_pages, kv)), guard, g.slots_token,
                                         kv.is_cuda)
        return t

    async def _send_chunks(self) -> bool:
        wrote = False
        for tid, w in list(self._writes.items()):
            o = self._live.get(tid)
            if o is None or o.status.state.finished:
                del self._writes[tid]
            elif time.monotonic() >= w.not_before:
                wrote = await self._write_piece(o, w) or wrote
        return await super()._send_chunks() or wrote

    async def _write_piece(self, o: _Outbound, w: _Write) -> bool:
        """Write the next piece under the grant's slot; on the last, send the Commit."""
        g, guard = w.grant, w.target.guard
        held = guard.acquire(g.slot, g.gen)
        if held is None:  # the receiver is granting or revoking this very instant
            return False
        if held is False:
            del self._writes[o.status.transfer_id]
            self._finish(o, S.FAILED, "the receiver revoked the write grant (it timed out or was "
                         "cancelled there): nothing written", code=FailCode.CANCELLED)
            return False
        writer, row = w.target.writer, w.target.writer.row_bytes
        total = o.header.payload_bytes // row
        left, chunk_rows = total - w.next_row, max(1, self.config.chunk_bytes // row)
        rows = piece_rows(left, chunk_rows)
        algo = o.header.checksum_algo
        try:
            if o.view is None:  # GPU to GPU: a device copy, finished before the slot is let go
                data = o.data.reshape(-1, writer.row_elems)[w.next_row:w.next_row + rows]
                writer.write(w.plan, w.next_row, data)
                w.acc = checksum.update(algo, w.acc, data)
                torch.cuda.synchronize(writer.rows.device)
                nbytes = rows * row
            else:
                data = o.view[w.next_row * row:(w.next_row + rows) * row]
                fused = writer.write_bytes_sum64(w.plan, w.next_row, data, w.acc) if algo == "sum64" else None
                if fused is None:
                    writer.write_bytes(w.plan, w.next_row, data)
                    if not writer.cpu:
                        torch.cuda.synchronize(writer.rows.device)
                    fused = checksum.update(algo, w.acc, data)
                w.acc = fused
                nbytes = len(data)
            if self.config.faults.shm_stall_s and w.next_row == 0:
                log.error("fault injected: the writer stalls %.1fs holding its slot", self.config.faults.shm_stall_s)
                time.sleep(self.config.faults.shm_stall_s)  # blocks the whole process, as a stalled one would
        finally:
            guard.release(g.slot)
        w.next_row += rows
        o.status.bytes_done += nbytes
        if w.next_row == total:
            del self._writes[o.status.transfer_id]
            self.one_sided += 1
        await self._emit(encode(Commit(o.status.transfer_id, w.next_row, w.acc)), "commit", [o])
        return True

    async def _shutdown(self) -> None:
        self._drop_link()
        await super()._shutdown()
        for t in self._targets.values():
            t.guard.close()
        self._targets.clear()
        if self.offers is not None:
            self.offers.close()
            self.offers = None
            self._no_arena = True


class ShmReceiver(ZmqReceiver):
    """A ZmqReceiver that grants one-sided writes into its shared pools."""

    send_errors = (zmq.ZMQError, LinkError)

    def __init__(self, config: TransportConfig, pool: PagePool, admit: AdmitFn | None = None,
                 context=None, num_slots: int = NUM_SLOTS) -> None:
        super().__init__(config, pool, admit, context)
        self.link: LinkListener | None = None  # started with the socket (config.local_link)
        self.slots = WriteSlots(num_slots)
        self._slot_of: dict[str, _Granted] = {}  # transfer id -> its grant
        self._held: list[tuple[_Inbound, int]] = []  # failed while a writer was inside a piece
        self._stale: list[int] = []  # slots of committed transfers not yet revoked (a misbehaving sender)
        self._sources = Sources()  # senders' export arenas (the read path, shm_read.py)
        self._reads: dict[str, Reading] = {}  # transfer id -> its read in progress, in turn order
        self.reads = 0  # transfers read from the sender's arena (the rest were written or streamed)
        self._messages_in_row = 0  # messages taken since the last read piece

    @property
    def num_held_pages(self) -> int:
        """Pages of failed transfers kept reserved until their writer is out of them."""
        return sum(len(inb.pages) + len(inb.shared) for inb, _ in self._held)

    # ---- the local link (see the module docstring) -------------------------------------------
    async def _open(self) -> None:
        await super()._open()
        if not self.config.local_link:
            return
        link = LinkListener(self.limits.max_batch + 1, self.config.max_header_bytes + self.config.max_message_bytes)
        try:
            await link.start()
        except OSError as e:
            log.warning("receiver: no local link (%s); control stays on ZeroMQ", e)
            return
        self.link = link
        pump = asyncio.create_task(self._pump(), name="kv-receiver-zmq-pump")
        pump.add_done_callback(self._task_done)  # stopped with the others; a crash fails the receiver
        self._tasks.append(pump)

    def _write(self, frames: list, peer: bytes | None):
        if self.link is not None and self.link.linked(peer):
            try:
                self.link.send(peer, frames)
                return _sent()
            except LinkError as e:
                log.info("receiver: the link to a sender failed (%s); answering on ZeroMQ", e)
        return super()._write(frames, peer)

    async def _read(self, timeout: float):
        if self._reads:  # waiting messages first, MESSAGES_PER_PIECE at most, then a piece, then the loop's other work
            got = None
            if self._messages_in_row < MESSAGES_PER_PIECE:
                got = self.link.take() if self.link is not None else _split(_recv_now(self._sock))
            if got is not None:
                self._messages_in_row += 1
                return got
            self._messages_in_row = 0
            if self._read_some():
                await asyncio.sleep(0)  # (the ZeroMQ pump, and a sender in this process, run too)
                return None
            timeout = min(timeout, self.config.tick_s / 4)  # every read waits (a late reader, a busy slot)
        link = self.link
        if link is None:
            return await super()._read(timeout)
        got = link.take()
        if got is None:
            await _next(link.ready, timeout)
            got = link.take()
        return got

    async def _pump(self) -> None:
        """ZeroMQ's messages into the link's queue, behind the links' own: one reader, in order
        of arrival, and one receive pending at a time instead of a poll per wait."""
        while True:
            await self.link.room.wait()
            frames = await self._sock.recv_multipart(copy=False)
            self.link.put((frames[0].bytes, frames[1:]))

    async def _shutdown(self) -> None:
        if self.link is not None:
            await self.link.close()
        await super()._shutdown()
        self._reads.clear()  # (every transfer failed at close: its pages are free)
        self._sources.close()

    # ---- the read path (shm_read.py) ---------------------------------------------------------
    def _start_read(self, inb: _Inbound) -> bool:
        """Read an offered payload from the sender's arena; False: grant a write instead."""
        h, src = inb.header, inb.header.source
        if src is None or not self.config.shm_read:
            return False
        try:
            opened = self._sources.open(src)
        except (SharedMemoryError, OSError, ValueError) as e:
            log.info("receiver: cannot read %s from the sender's arena (%s): granting a write", h.transfer_id, e)
            return False
        if src.offset + h.payload_bytes > len(opened.view):
            self._fail(inb, FailCode.BAD_MESSAGE, f"the offered payload ({h.payload_bytes} bytes at {src.offset}) "
                                                  f"runs past the sender's arena ({len(opened.view)} bytes)")
            return True
        delay = self.config.faults.shm_delay_s
        opened.readers += 1
        self._reads[h.transfer_id] = Reading(src, opened, checksum.initial(h.checksum_algo),
                                             not_before=time.monotonic() + delay if delay else 0.0)
        inb.status.state, inb.status.t_started = S.TRANSFERRING, time.monotonic()
        return True

    def _end_read(self, transfer_id: str) -> None:
        r = self._reads.pop(transfer_id, None)
        if r is not None:
            r.src.readers -= 1

    def _read_some(self) -> bool:
        """One piece of the first transfer in turn that can go on (it then goes last). True if
        a piece was copied."""
        now = time.monotonic()
        for tid, r in list(self._reads.items()):
            inb = self._live.get(tid)
            if inb is None or inb.status.state.finished:  # failed meanwhile (Cancel, timeout, close)
                self._end_read(tid)
                continue
            if now < r.not_before:
                continue
            h, row = inb.header, inb.writer.row_bytes
            total = h.payload_bytes // row
            rows = piece_rows(total - r.next_row, max(1, self.config.chunk_bytes // row))
            done = read_piece(r, inb.writer, inb.plan, rows, h.checksum_algo, self.config.faults.shm_stall_s)
            if done is None:
                continue
            if done is False:
                self._end_read(tid)
                self._fail(inb, FailCode.CANCELLED, "the sender withdrew the payload (it timed out or was "
                                                    "cancelled there): nothing read")
                continue
            inb.status.bytes_done, inb.last_seen = r.next_row * row, time.monotonic()
            self._reads[tid] = self._reads.pop(tid)  # the others' turn first
            if r.next_row == total:
                self._end_read(tid)
                if r.acc != r.source.checksum:
                    self._fail(inb, FailCode.CHECKSUM, f"the payload read sums to {r.acc:#x}, the sender's "
                                                       f"checksum is {r.source.checksum:#x}")
                else:
                    self.reads += 1
                    self._commit(inb)
                    link = self.link if inb.peer is not None and self.link is not None and \
                        not self.link.linked(inb.peer) else None  # (the peer is on this host: its arena is)
                    self._reply(inb.peer, Ack([h.transfer_id], link.name, link.ticket(inb.peer)) if link else
                                Ack([h.transfer_id]), "ack")
            return True
        return False

    def _start_shm(self, inb: _Inbound) -> None:
        if self._start_read(inb):
            return
        buf = inb.pool.shared
        slot = self.slots.grant() if buf is not None else None
        if slot is None:
            super()._start_shm(inb)
            return
        h, loc = inb.header, buf.locator
        self._slot_of[h.transfer_id] = _Granted(*slot, running=checksum.initial(h.checksum_algo))
        inb.granted = min(h.num_chunks, self.config.window)
        link = self.link if inb.peer is not None else None
        self._reply(inb.peer, Grant(h.transfer_id, inb.granted, boot_id(), loc.path, loc.token,
                                    self.slots.locator.path, self.slots.locator.token, slot[0], slot[1],
                                    inb.pool.num_pages, list(inb.pages), link.name if link else "",
                                    link.ticket(inb.peer) if link else ""), "grant", [inb])

    def _on_other(self, peer: bytes | None, m) -> None:
        if isinstance(m, Commit):
            self._on_commit(peer, m)
        else:
            super()._on_other(peer, m)

    def _on_commit(self, peer: bytes | None, m: Commit) -> None:
        """Check the rows written since the last Commit against the sender's running checksum,
        reading them back from the pages (a piece is checked while the sender writes the next);
        the last one revokes the slot, then commits."""
        inb = self._live.get(m.transfer_id)
        if inb is None:
            log.info("receiver: late commit for %s discarded", m.transfer_id)
            return
        if self._foreign(peer, m.transfer_id, "commit"):
            return
        g = self._slot_of.get(m.transfer_id)
        h = inb.header
        total = inb.writer.num_lk * h.num_pages
        if g is None or inb.next_chunk:
            self._fail(inb, FailCode.BAD_MESSAGE, "a commit for a transfer not written one-sided")
            return
        if m.rows <= g.rows:  # a duplicate (or late) Commit: those rows are checked already
            log.info("receiver: commit of rows up to %d for %s, %d checked: discarded", m.rows, m.transfer_id, g.rows)
            return
        if m.rows > total:
            self._fail(inb, FailCode.BAD_MESSAGE, f"commit of rows up to {m.rows}: {g.rows} checked, {total} in all")
            return
        if m.rows == total and not self.slots.revoke(g.slot):
            self._fail(inb, FailCode.BAD_MESSAGE, "last commit while the writer still holds its slot")
            return
        g.running = inb.writer.checksum(inb.plan, h.checksum_algo, g.rows, m.rows, g.running) \
            if self.config.shm_verify else m.checksum
        g.rows = m.rows
        now = time.monotonic()
        inb.last_seen = now
        if inb.status.state is S.WAITING:
            inb.status.state, inb.status.t_started = S.TRANSFERRING, now
        if g.running != m.checksum:
            self._fail(inb, FailCode.CHECKSUM, f"rows up to {m.rows} read back sum to {g.running:#x}, "
                                               f"the sender's say {m.checksum:#x}")
            return
        inb.status.bytes_done = m.rows * inb.writer.row_bytes
        if m.rows == total:
            self._commit(inb)
            self._reply(inb.peer, Ack([h.transfer_id]), "ack")

    def _commit(self, inb: _Inbound) -> None:
        g = self._slot_of.pop(inb.status.transfer_id, None)  # (granted, then sent as chunks)
        if g is not None and not self.slots.revoke(g.slot):
            log.error("receiver: %s came as chunks while its sender holds write slot %d", inb.status.transfer_id, g.slot)
            self._stale.append(g.slot)
        super()._commit(inb)

    def _pages_free_now(self, inb: _Inbound) -> bool:
        g = self._slot_of.pop(inb.status.transfer_id, None)
        if g is None or self.slots.revoke(g.slot):
            return True
        # A writer is inside a piece now: these pages stay RESERVED (nobody else gets them) until
        # a later revoke finds it out, at a tick of _expire.
        self._held.append((inb, g.slot))
        log.warning("receiver: transfer %s failed while its writer holds slot %d: its %d pages stay "
                    "reserved until the writer is out", inb.status.transfer_id, g.slot, len(inb.pages))
        return False

    def _expire(self, now: float) -> None:
        super()._expire(now)
        self._sources.close_idle(now - SOURCE_IDLE_S)
        for inb, slot in list(self._held):
            if self.slots.revoke(slot):
                self._held.remove((inb, slot))
                inb.pool.free(inb.header.request_id, inb.shared + inb.pages)
                log.info("receiver: the writer of %s is out; its pages are free", inb.status.transfer_id)
        self._stale = [s for s in self._stale if not self.slots.revoke(s)]

    async def close(self) -> None:
        await super().close()
        self._expire(time.monotonic())
        if self._held:
            log.error("receiver: closed with %d pages held by writers still inside them", self.num_held_pages)
        self.slots.close()

