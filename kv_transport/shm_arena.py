"""The shm sender's export arena: KV exports staged where a receiver on this host can read them.

An export gathered into a lease of the arena (`ExportArena.lease`, through the sender's
`export_buffer`) is read by the receiver itself (shm_backend, the read path): one pass that
copies the bytes into its pages and sums them, where a one-sided write takes the sender's copy
plus the receiver's read-back.

- The arena is one SharedBuffer (a memfd: it lives as long as a process maps it). Space is
  handed out first-fit in ALIGN-byte units; freed ranges coalesce with their neighbours.
- A lease is a ctypes array over its range. Every tensor made from it, and every view of those,
  keeps it alive; the range goes back to the free list only once the last of them is gone *and*
  no transfer holds it any more (`hold` / `drop`). So a range is never handed out twice while
  its owner or a reader may still touch it.
- A lease's finalizer may run anywhere, the cyclic collector included, which can start inside
  one of this class's own critical sections: it only queues the range (SimpleQueue.put is
  reentrant), and every method drains the queue under the lock.
- Freed ranges stay faulted in: the arena's resident memory is its peak use, reused first-fit.
"""
from __future__ import annotations

import bisect
import ctypes
import queue
import threading
import weakref

import numpy as np
import torch

from pdtb.engine.shared_memory import HEADER_BYTES, Locator, SharedBuffer

ALIGN = 4096  # lease granularity: page-aligned ranges, so no two leases share a cache line


class ExportArena:
    """`nbytes` of shared memory handed out as export leases."""

    def __init__(self, nbytes: int, name: str = "pdtb-kv-arena") -> None:
        if nbytes < ALIGN:
            raise ValueError(f"an export arena needs at least {ALIGN} bytes")
        self.nbytes = nbytes - nbytes % ALIGN
        self.buf = SharedBuffer(self.nbytes, name)
        self._base = np.frombuffer(self.buf.map, np.uint8, self.nbytes, HEADER_BYTES).ctypes.data
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), by offset
        self._holds: dict[int, tuple[int, int]] = {}  # offset of a leased range -> (size, holders)
        self._lock = threading.Lock()
        self._dead: queue.SimpleQueue = queue.SimpleQueue()  # offsets of leases whose last tensor died

    @property
    def locator(self) -> Locator:
        return self.buf.locator

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._reap()
            return sum(n for _, n in self._free)

    def lease(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of `nbytes` in the arena, or None when no free range is that large."""
        if nbytes <= 0:
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._reap()
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    if n == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, n - size)
                    self._holds[off] = (size, 1)  # the lease itself
                    break
            else:
                return None
        arr = (ctypes.c_uint8 * nbytes).from_buffer(self.buf.map, HEADER_BYTES + off)
        weakref.finalize(arr, self._dead.put, off)
        return torch.from_numpy(np.frombuffer(arr, dtype=np.uint8))

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where a CPU tensor's bytes start in the arena, if they lie wholly inside one leased range."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        off = t.data_ptr() - self._base
        nbytes = t.numel() * t.element_size()
        if not 0 <= off <= self.nbytes - nbytes:
            return None
        with self._lock:
            self._reap()
            try:
                start = self._start_of(off)
            except KeyError:  # in no leased range
                return None
            if off + nbytes > start + self._holds[start][0]:
                return None
        return off

    def hold(self, off: int) -> None:
        """One more holder of the leased range that contains `off` (a transfer naming it)."""
        with self._lock:
            self._reap()
            start = self._start_of(off)
            size, n = self._holds[start]
            self._holds[start] = (size, n + 1)

    def drop(self, off: int) -> None:
        """One holder fewer; the last one returns the range to the free list."""
        with self._lock:
            self._reap()
            self._drop(off)

    def _reap(self) -> None:
        """Drop the holds of leases finalized since (under the lock)."""
        while True:
            try:
                off = self._dead.get_nowait()
            except queue.Empty:
                return
            self._drop(off)

    def _drop(self, off: int) -> None:
        start = self._start_of(off)
        size, n = self._holds[start]
        if n > 1:
            self._holds[start] = (size, n - 1)
            return
        del self._holds[start]
        self._release(start, size)

    def _start_of(self, off: int) -> int:
        starts = sorted(self._holds)
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or off >= starts[i] + self._holds[starts[i]][0]:
            raise KeyError(f"offset {off} is in no leased range")
        return starts[i]

    def _release(self, off: int, size: int) -> None:
        free = self._free
        i = bisect.bisect_left(free, (off, 0))
        if i < len(free) and off + size == free[i][0]:  # merge with the next range
            size += free.pop(i)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # and with the previous one
            off, size = free[i - 1][0], free[i - 1][1] + size
            i -= 1
            free.pop(i)
        free.insert(i, (off, size))

    def close(self) -> None:
        """Drop the arena's fd; its memory lives on while leases or a peer's mapping hold it."""
        self.buf.close()
