"""The shm backend's receiver (the protocol: shm_backend.py): grants write slots on its shared
pools, reads offered payloads itself, revokes and checks before it commits; the zmq receiver
underneath for everything else."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq

from kv_transport import checksum
from kv_transport.config import TransportConfig
from kv_transport.fail_codes import FailCode
from kv_transport.local_link import LinkError, LinkListener
from kv_transport.receiver import _Inbound
from kv_transport.shm_common import MESSAGES_PER_PIECE, _next, NUM_SLOTS, piece_rows, _recv_now, S, _sent, _split
from kv_transport.shm_read import SOURCE_IDLE_S, Reading, Sources, read_piece
from kv_transport.shm_slots import WriteSlots
from kv_transport.wire import Ack, AdmitFn, Commit, Grant
from kv_transport.zmq_backend import ZmqReceiver
from pdtb.engine.page_pool import PagePool
from pdtb.engine.shared_memory import SharedMemoryError, boot_id

log = logging.getLogger("kv_transport.shm_backend")


@dataclass
class _Granted:
    """A transfer the receiver let write one-sided."""

    slot: int
    gen: int
    rows: int = 0  # payload rows [0, rows) checked against the sender's running checksum
    running: int = 0  # their checksum, read back from the pages


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
