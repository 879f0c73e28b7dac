"""Scatter payload rows into a request's pool pages, one copy per byte.

A payload row is one (layer, k/v, page) slab of page_size * kv_heads * head_dim elements:

    payload  [layer, kv, i, slot, head, dim]    row r = lk * n + i        (lk = layer*2 + kv)
    pool.kv  [layer, kv, page, slot, head, dim] row     lk * P + pages[i]

Pages usually come in long runs of consecutive ids, ascending or descending (PagePool's
free list hands pages back in reverse). A run is one strided slice per lk: on a CPU pool it
is written through a numpy byte view (negative strides allowed, memcpy speed). Scattered
pages use one fancy-index assignment per chunk (numpy on CPU: about 5x torch's index_copy_
on byte rows; index_copy_ of pool-dtype rows on a device).

On an accelerator, raw bytes (a zmq frame) go through one of two pinned staging buffers: one
memcpy into page-locked memory, an asynchronous copy to the device, and the scatter on the
device. A buffer is reused only after the event recorded behind its last copy has completed,
so the next piece is staged while the previous one crosses the bus. (The plain way, a
pageable tensor's .to(device), costs an extra host copy of a read-only frame plus the driver's
synchronous bounce through its own pinned buffer.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdtb.engine.page_pool import PagePool

MIN_AVG_RUN = 32  # pages; shorter runs are not worth a Python-level loop of slices
FUSE_BYTES = 1024 * 1024  # write-then-checksum piece (write_summed): fits in L2


@dataclass
class _Stage:
    """One staging buffer for an accelerator pool (pinned when the pool is on CUDA)."""

    buf: torch.Tensor | None = None  # uint8
    view: np.ndarray | None = None  # numpy view of buf: the memcpy target
    done: "torch.cuda.Event | None" = None  # recorded after the last copy that read buf


@dataclass
class WritePlan:
    """Where the rows of one transfer go."""

    num_pages: int  # n: pages of the request
    runs: list[tuple[int, int, int, int]] | None  # (first i, first page, length, step +-1)
    rows: np.ndarray | torch.Tensor | None  # pool row of every payload row, if runs is None
    page_ids: np.ndarray | None = None  # the pages (the C landing copy's and the read-back's row lists)


def find_runs(pages: list[int]) -> list[tuple[int, int, int, int]]:
    """Maximal runs of pages whose ids step by +1 or -1: (first i, first page, length, step)."""
    if len(pages) > 2:  # one run all along (a fresh or orderly free list): found without a Python loop
        steps = np.diff(np.asarray(pages, dtype=np.int64))
        if abs(int(steps[0])) == 1 and bool((steps == steps[0]).all()):
            return [(0, int(pages[0]), len(pages), int(steps[0]))]
    runs: list[tuple[int, int, int, int]] = []
    for i, p in enumerate(pages):
        if runs:
            i0, p0, ln, step = runs[-1]
            if ln == 1 and abs(p - p0) == 1:
                runs[-1] = (i0, p0, 2, p - p0)
                continue
            if p == p0 + ln * step:
                runs[-1] = (i0, p0, ln + 1, step)
                continue
        runs.append((i, p, 1, 1))
    return runs


class PageWriter:
    """Writes payload rows into one pool's pages."""

    def __init__(self, pool: PagePool, use_c_copy: bool = True) -> None:
        spec = pool.spec
        self.pool = pool  # the pool it writes into
        self.num_pool_pages = pool.num_pages
        self.num_lk = 2 * spec.num_layers
        self.row_elems = spec.page_size * spec.num_kv_heads * spec.head_dim
        self.row_bytes = self.row_elems * pool.kv.element_size()
        self.rows = pool.kv.view(self.num_lk * pool.num_pages, self.row_elems)
        self.cpu = pool.kv.device.type == "cpu"
        # byte view of the pool: numpy slices take negative steps, torch slices do not
        self.np_rows = pool.kv.view(-1).view(torch.uint8).numpy().reshape(
            self.num_lk * pool.num_pages, self.row_bytes) if self.cpu else None
        self._stages = (_Stage(), _Stage())  # accelerator pools only; filled on first use
        self._turn = 0
        self.copier = None  # cpu_kernel.RowCopier: landing copy and sum64 in one pass (CPU pools)
        if self.cpu and use_c_copy:
            from pdtb.engine import cpu_kernel

            self.copier = cpu_kernel.row_copier()

    def plan(self, pages: list[int]) -> WritePlan:
        ids = np.asarray(pages, dtype=np.int64)
        kept = ids
        runs = find_runs(pages)
        usable = self.cpu or all(step == 1 for _, _, _, step in runs)
        if usable and len(pages) >= MIN_AVG_RUN * len(runs):
            return WritePlan(len(pages), runs, None, kept)
        rows = (np.arange(self.num_lk)[:, None] * self.num_pool_pages + ids[None, :]).ravel()
        if not self.cpu:
            rows = torch.from_numpy(rows).to(self.rows.device)
        return WritePlan(len(pages), None, rows, kept)

    def write_bytes_sum64(self, plan: WritePlan, row0: int, data: memoryview, acc: int,
                          read_once: bool = False) -> int | None:
        """Write whole payload rows (bytes from payload row `row0`) and fold them into the running
        sum64 `acc`, in one pass (csrc/copy_rows.c; `read_once`: a source nobody reads again
        soon, prefetched around the cache). None, having written nothing, where that copy does
        not apply (not a CPU pool, no C compiler, rows not a multiple of 8 bytes): the caller
        then writes and sums separately."""
        if self.copier is None or self.row_bytes % 8 or len(data) % self.row_bytes:
            return None
        rows = self._pool_rows(plan, row0, row0 + len(data) // self.row_bytes)
        return self.copier(self.np_rows.ctypes.data, np.ascontiguousarray(rows), data, self.row_bytes, acc, read_once)

    def write_summed(self, plan: WritePlan, row0: int, data: memoryview, algo: str, acc: int,
                     read_once: bool = False) -> int:
        """Write whole payload rows (bytes from payload row `row0`) and return the running
        checksum `acc` extended by them. sum64 on a CPU pool: one C pass (write_bytes_sum64).
        Otherwise a write then a sum per FUSE_BYTES piece: the sum reads the bytes the write
        just pulled into cache (about 46 GB/s here, against 10 GB/s for a cold pass)."""
        from kv_transport import checksum

        fused = self.write_bytes_sum64(plan, row0, data, acc, read_once) if algo == "sum64" else None
        if fused is not None:
            return fused
        step = max(1, FUSE_BYTES // self.row_bytes) * self.row_bytes
        for off in range(0, len(data), step):
            piece = data[off:off + step]
            self.write_bytes(plan, row0 + off // self.row_bytes, piece)
            acc = checksum.update(algo, acc, piece)
        return acc

    def write_bytes(self, plan: WritePlan, row0: int, data: memoryview) -> None:
        """Write whole payload rows, given as raw bytes starting at payload row `row0`."""
        if self.cpu:
            self._write_np(plan, row0, np.frombuffer(data, dtype=np.uint8))
            return
        n = len(data)
        stage = self._next_stage(n)
        stage.view[:n] = np.frombuffer(data, dtype=np.uint8)
        cuda = self.rows.device.type == "cuda"  # elsewhere the copies below are synchronous
        src = stage.buf[:n].view(self.rows.dtype).view(-1, self.row_elems).to(self.rows.device, non_blocking=cuda)
        self.write(plan, row0, src)
        if cuda:
            stage.done = torch.cuda.Event()
            stage.done.record()

    def _next_stage(self, nbytes: int) -> _Stage:
        """The other staging buffer, free to overwrite (the copy that last read it has
        finished) and at least `nbytes` long."""
        self._turn ^= 1
        stage = self._stages[self._turn]
        if stage.done is not None:
            stage.done.synchronize()
            stage.done = None
        if stage.buf is None or stage.buf.numel() < nbytes:
            stage.buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8,
                                    pin_memory=self.rows.device.type == "cuda")
            stage.view = stage.buf.numpy()
        return stage

    def write(self, plan: WritePlan, row0: int, src: torch.Tensor) -> None:
        """Write `src` ([k, row_elems] of the pool's dtype) as payload rows row0 .. row0+k-1."""
        if src.device != self.rows.device:
            src = src.to(self.rows.device)
        if self.cpu:
            self._write_np(plan, row0, src.contiguous().reshape(-1).view(torch.uint8).numpy())
        elif plan.runs is None:
            self.rows.index_copy_(0, plan.rows[row0:row0 + src.shape[0]], src)
        else:
            self._write_runs(plan, row0, src, self.rows)

    def _write_np(self, plan: WritePlan, row0: int, flat: np.ndarray) -> None:
        src = flat.reshape(-1, self.row_bytes)
        if plan.runs is None:
            self.np_rows[plan.rows[row0:row0 + src.shape[0]]] = src
        else:
            self._write_runs(plan, row0, src, self.np_rows)

    def _runs_of(self, plan: WritePlan, row0: int, row1: int):
        """(first pool row, rows, step +-1) of each stretch of payload rows [row0, row1) that
        lands in consecutive pool rows, in payload order (`plan.runs` only)."""
        n, r, runs, run = plan.num_pages, row0, plan.runs, 0
        while r < row1:
            lk, i = divmod(r, n)
            while not runs[run][0] <= i < runs[run][0] + runs[run][2]:
                run = (run + 1) % len(runs)
            i0, p0, ln, step = runs[run]
            take = min(row1 - r, i0 + ln - i)
            yield lk * self.num_pool_pages + p0 + (i - i0) * step, take, step
            r += take

    def _pool_rows(self, plan: WritePlan, row0: int, row1: int) -> np.ndarray:
        """The pool row of each payload row in [row0, row1): lk * n + i lands in lk * P + pages[i]."""
        if plan.rows is not None:
            return plan.rows[row0:row1]
        lk, i = np.divmod(np.arange(row0, row1, dtype=np.int64), plan.num_pages)
        return lk * self.num_pool_pages + plan.page_ids[i]

    def _write_runs(self, plan: WritePlan, row0: int, src, dst) -> None:
        pos = 0
        for first, take, step in self._runs_of(plan, row0, row0 + src.shape[0]):
            if step == 1:
                dst[first:first + take] = src[pos:pos + take]
            else:  # descending pages: a negative-stride view (numpy only)
                stop = first - take
                dst[first:stop if stop >= 0 else None:-1] = src[pos:pos + take]
            pos += take

    def checksum(self, plan: WritePlan, algo: str, row0: int = 0, row1: int | None = None,
                 acc: int | None = None) -> int:
        """The running checksum `acc` (default: empty) extended by payload rows [row0, row1) as
        they stand in the pool's pages: what a one-sided sender wrote, read back.
        sum64 is order-free, so a run of pages is summed where it lies, in place; crc32 reads
        the rows in payload order, 1 MiB at a time."""
        from kv_transport import checksum

        row1 = self.num_lk * plan.num_pages if row1 is None else row1
        acc = checksum.initial(algo) if acc is None else acc
        if not self.cpu:  # a device pool: the rows gathered on the device (sum64 summed there too)
            rows = self._pool_rows(plan, row0, row1)
            idx = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(rows).to(self.rows.device)
            return checksum.update(algo, acc, self.rows.index_select(0, idx))
        if algo == "sum64" and plan.runs is not None:
            for first, take, step in self._runs_of(plan, row0, row1):
                lo = first if step == 1 else first - take + 1
                acc = checksum.update(algo, acc, self.np_rows[lo:lo + take].reshape(-1))
            return acc
        rows = self._pool_rows(plan, row0, row1)
        step = max(1, (1 << 20) // self.row_bytes)
        for a in range(0, len(rows), step):
            acc = checksum.update(algo, acc, self.np_rows[rows[a:a + step]].reshape(-1))
        return acc
