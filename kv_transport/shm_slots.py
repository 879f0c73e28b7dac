"""Write permissions for one-sided senders: one generation word per slot, guarded by a lock.

The receiver grants a transfer a slot `s` and a fresh generation `g` (never reused), and
writes `g` into word `s` of a small shared table. A sender may write the transfer's pages
only while it holds the lock on word `s` *and* reads `g` there:

    sender, per piece:  lock(s) ; if word[s] != g: unlock, stop (revoked) ; copy ; unlock(s)
    receiver, revoke:   word[s] = 0 ; try lock(s) ; unlock(s) ; now free or commit the pages

So once a revoke has returned True, no write under `g` can start, and none is in progress
(the word is 0 before the lock is tried, so a piece that starts after a failed try stops):
a late writer (one that slept through its transfer's timeout) finds 0 or another
generation and writes nothing, even if the pages went to another request meanwhile. A revoke
that finds the lock taken (a writer mid-piece) returns False and the receiver keeps the pages
reserved and tries again later.

The locks are Linux open-file-description locks (F_OFD_SETLK) on the word's 8 bytes: they
belong to each side's own open of the buffer, so they conflict inside one process too (the
tests run both sides in one), and the kernel drops a dead process's locks with its files:
a sender killed mid-piece no longer blocks the revoke.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import struct

import numpy as np

from pdtb.engine.shared_memory import HEADER_BYTES, Locator, Mapped, SharedBuffer, open_buffer

_F_WRLCK, _F_UNLCK = fcntl.F_WRLCK, fcntl.F_UNLCK
_FLOCK = "hhqqi4x"  # struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)  # linux/fcntl.h
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def _lock(fd: int, slot: int, kind: int) -> bool:
    """Take (F_WRLCK) or drop (F_UNLCK) the lock on word `slot`; False: another description holds it."""
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, struct.pack(_FLOCK, kind, 0, HEADER_BYTES + 8 * slot, 8, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _words(mm, n: int) -> np.ndarray:
    return np.frombuffer(mm, dtype=np.uint64, count=n, offset=HEADER_BYTES)


class WriteSlots:
    """The receiver's table: grants slots with fresh generations and revokes them."""

    def __init__(self, num_slots: int = 1024) -> None:
        self.num_slots = num_slots
        self.buf = SharedBuffer(8 * num_slots, "pdtb-kv-slots")
        self.words = _words(self.buf.map, num_slots)
        self._free = list(range(num_slots - 1, -1, -1))
        self._granted: set[int] = set()  # slots with a live grant (each also absent from _free)
        self._gens = itertools.count(1)

    @property
    def locator(self) -> Locator:
        return self.buf.locator

    @property
    def num_free(self) -> int:
        return len(self._free)

    def grant(self) -> tuple[int, int] | None:
        """(slot, generation), or None when every slot is in use."""
        tried = []
        slot = None
        while self._free:
            s = self._free.pop()
            if _lock(self.buf.fd, s, _F_WRLCK):  # (a late writer of an old grant may be checking it)
                slot = s
                break
            tried.append(s)
        self._free.extend(reversed(tried))
        if slot is None:
            return None
        gen = next(self._gens)
        self.words[slot] = gen
        _lock(self.buf.fd, slot, _F_UNLCK)
        self._granted.add(slot)
        return slot, gen

    def revoke(self, slot: int) -> bool:
        """End the grant on `slot`: True once no write under it can happen any more (the slot
        is free again); False while a writer holds it (call again later). A slot with no live
        grant (revoked already) answers True and stays free once.

        The word is cleared first, without the lock (an aligned 8-byte store): a holder inside
        a piece finishes that piece, and finds the grant gone when it takes the slot for the
        next one, so the revoke that follows is not outrun piece after piece."""
        if slot not in self._granted:
            return True
        self.words[slot] = 0
        if not _lock(self.buf.fd, slot, _F_WRLCK):
            return False
        _lock(self.buf.fd, slot, _F_UNLCK)
        self._granted.discard(slot)
        self._free.append(slot)
        return True

    def busy(self, slot: int) -> bool:
        """Whether a writer holds `slot` now (it is inside a piece); takes nothing."""
        got = fcntl.fcntl(self.buf.fd, F_OFD_GETLK, struct.pack(_FLOCK, _F_WRLCK, 0, HEADER_BYTES + 8 * slot, 8, 0))
        return struct.unpack(_FLOCK, got)[0] != _F_UNLCK

    def close(self) -> None:
        self.buf.close()


class SlotGuard:
    """The sender's side of one receiver's table: hold a slot while writing a piece."""

    def __init__(self, locator: Locator) -> None:
        self.mapped: Mapped = open_buffer(locator)
        self.num_slots = self.mapped.nbytes // 8
        self.words = _words(self.mapped.map, self.num_slots)

    def acquire(self, slot: int, gen: int) -> bool | None:
        """True: the slot is ours for one piece (call release); False: revoked (write
        nothing, ever); None: busy this instant (the receiver is revoking or granting: retry)."""
        if not 0 <= slot < self.num_slots:
            return False
        if not _lock(self.mapped.fd, slot, _F_WRLCK):
            return None
        if int(self.words[slot]) != gen:
            _lock(self.mapped.fd, slot, _F_UNLCK)
            return False
        return True

    def release(self, slot: int) -> None:
        _lock(self.mapped.fd, slot, _F_UNLCK)

    def close(self) -> None:
        self.mapped.close()
