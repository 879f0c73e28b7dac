"""The read path of the shm backend: the receiver copies an offered payload itself.

    sender                                              receiver
    export gathered into the sender's arena (shm_arena.py)
    header (mode shm, source: arena locator, offset,
            read slot s at generation g, checksum) ──>  admit; reserve pages (device or host tier)
                                                         per piece (chunk_bytes): hold s at g;
                                                         copy the rows into the pages, summing
                                                         them in the same pass; let go
                        <── Ack                         the sum matches: commit
    withdraw: revoke s; the arena range is free once
    no reader holds it and the export is gone

One pass over the bytes, on the receiver, checks them as it lands them: a one-sided write
takes the sender's copy plus the receiver's read-back (three passes). No Grant, no Commit.

The slots are the write path's (shm_slots.py) with the roles turned around: the sender owns
the table, grants a slot per offered transfer and revokes it when the transfer ends (done,
failed, timed out, cancelled); the receiver holds it while it copies a piece. Once a revoke
has returned True no read under that generation can start or be in progress, so an arena
range is handed out again only after every reader is out of it: a late reader (one that slept
through the sender's timeout) finds the slot revoked and reads nothing. A revoke that finds a
reader inside keeps the range and is retried every tick. A receiver that cannot map the arena
(another host, another container's /proc) or does not read (`shm_read=False`) answers with a
Grant or a Credit as for any shm header, and the sender writes or streams from the same bytes.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kv_transport.shm_arena import ExportArena
from kv_transport.shm_slots import SlotGuard, WriteSlots
from kv_transport.wire import ReadSource
from pdtb.engine.shared_memory import HEADER_BYTES, Locator, Mapped, open_buffer

log = logging.getLogger(__name__)
NUM_READ_SLOTS = 1024  # transfers a sender offers for reading at once (more are written)
MAX_OPEN_SOURCES = 16  # senders' arenas a receiver keeps mapped (the least recently used idle one goes)
SOURCE_IDLE_S = 30.0  # a sender's arena nobody has read from for this long is unmapped (a gone sender's memory goes)


class ReadOffers:
    """The sender's side: its export arena and the read slots it grants and revokes."""

    def __init__(self, arena_bytes: int, num_slots: int = NUM_READ_SLOTS) -> None:
        self.arena = ExportArena(arena_bytes)
        try:
            self.slots = WriteSlots(num_slots)
        except BaseException:
            self.arena.close()
            raise
        self._offered: dict[str, tuple[int, int]] = {}  # transfer id -> (slot, arena offset)
        self._pending: list[tuple[int, int]] = []  # withdrawn while a reader was inside a piece

    @property
    def num_pending(self) -> int:
        """Withdrawn offers whose range waits for its reader to get out."""
        return len(self._pending)

    def lease(self, nbytes: int) -> torch.Tensor | None:
        return self.arena.lease(nbytes)

    def offer(self, transfer_id: str, data: torch.Tensor, checksum: int | None) -> ReadSource | None:
        """A ReadSource for `data` if it lies in the arena and a slot is free; None: write it."""
        off = self.arena.offset_of(data)
        if off is None or checksum is None:
            return None
        got = self.slots.grant()
        if got is None:
            return None
        slot, gen = got
        self.arena.hold(off)
        self._offered[transfer_id] = (slot, off)
        a, t = self.arena.locator, self.slots.locator
        return ReadSource(a.host, a.path, a.token, t.path, t.token, slot, gen, off, checksum)

    def withdraw(self, transfer_id: str) -> None:
        """The transfer ended: no read may start under its slot; its range goes once none is inside."""
        got = self._offered.pop(transfer_id, None)
        if got is not None and not self._revoke(*got):
            self._pending.append(got)

    def retry(self) -> None:
        """Revoke again the slots a reader was inside (every tick)."""
        self._pending = [p for p in self._pending if not self._revoke(*p)]

    def _revoke(self, slot: int, off: int) -> bool:
        if not self.slots.revoke(slot):
            return False
        self.arena.drop(off)
        return True

    def close(self) -> None:
        for tid in list(self._offered):
            self.withdraw(tid)
        self.retry()
        if self._pending:
            log.error("sender: closed with %d offered payloads a reader is still inside", len(self._pending))
        self.slots.close()
        self.arena.close()


@dataclass
class Source:
    """A sender's arena and slot table, as this receiver maps them."""

    mapped: Mapped
    guard: SlotGuard
    view: memoryview  # the arena's data bytes
    readers: int = 0  # transfers reading from it now
    last_used: float = 0.0  # monotonic time it was last opened for a read


@dataclass
class Reading:
    """One offered transfer this receiver is copying, piece by piece."""

    source: ReadSource
    src: Source
    acc: int  # running checksum of rows [0, next_row)
    next_row: int = 0
    not_before: float = 0.0  # (fault injection: a late reader)


class Sources:
    """The receiver's mappings of senders' arenas, by (arena, its token, slot table's token)."""

    def __init__(self, max_open: int = MAX_OPEN_SOURCES) -> None:
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, str, str], Source] = OrderedDict()

    def open(self, s: ReadSource) -> Source:
        """The mapping of `s`'s arena (made on first use); SharedMemoryError if it cannot be."""
        key = (s.buffer, s.buffer_token, s.slots_token)
        got = self._open.get(key)
        if got is not None:
            self._open.move_to_end(key)
            got.last_used = time.monotonic()
            return got
        mapped = open_buffer(Locator(s.buffer, s.buffer_token, s.host), writable=False)  # (it only reads)
        try:
            guard = SlotGuard(Locator(s.slots, s.slots_token, s.host))
        except BaseException:
            mapped.close()
            raise
        got = self._open[key] = Source(mapped, guard, memoryview(mapped.map)[HEADER_BYTES:HEADER_BYTES + mapped.nbytes],
                                       last_used=time.monotonic())
        self._trim(keep=key)
        return got

    def close_idle(self, before: float) -> None:
        """Unmap the arenas nobody reads from that were last used before `before`."""
        for key in [k for k, v in self._open.items() if v.readers == 0 and v.last_used < before]:
            _close(self._open.pop(key))

    def _trim(self, keep: tuple[str, str, str]) -> None:
        """Close the least recently used mappings nobody reads from, down to `max_open` if it can."""
        idle = [k for k, v in self._open.items() if v.readers == 0 and k != keep]
        for key in idle[:max(0, len(self._open) - self.max_open)]:
            _close(self._open.pop(key))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for src in self._open.values():
            _close(src)
        self._open.clear()


def _close(src: Source) -> None:
    src.guard.close()
    src.view.release()
    try:
        src.mapped.map.close()
    except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
        pass
    src.mapped.close()


def read_piece(r: Reading, writer, plan, rows: int, algo: str, stall_s: float = 0.0) -> bool | None:
    """Copy payload rows [r.next_row, r.next_row + rows) from the source into the pages while
    holding the read slot, summing them in the same pass. True: done; None: the slot is busy
    this instant (the sender is granting or revoking: retry); False: revoked (read nothing)."""
    s = r.source
    held = r.src.guard.acquire(s.slot, s.gen)
    if not held:
        return held
    try:
        start = s.offset + r.next_row * writer.row_bytes
        r.acc = writer.write_summed(plan, r.next_row, r.src.view[start:start + rows * writer.row_bytes], algo, r.acc,
                                    read_once=True)
        if stall_s and r.next_row == 0:
            log.error("fault injected: the reader stalls %.1fs holding its slot", stall_s)
            time.sleep(stall_s)  # blocks the whole process, as a stalled one would
    finally:
        r.src.guard.release(s.slot)
    r.next_row += rows
    return True
