"""Decode read cache: a contiguous copy of the running batch's K/V for attention on the CPU.

The torch decode path (`--decode-attention torch`, or where the C kernel of csrc/paged_decode.c
does not apply: no C compiler, a dtype other than float32). Without a paged-attention kernel,
every layer of every step would gather each sequence's pages into a padded `[B, kv_heads, L, head_dim]` batch: the whole KV of
the batch copied 2 x layers times per step. During steady decode the batch does not change, so
the runner keeps that gathered copy between steps and only appends the new token to it:

    pool pages (authoritative, paged)   --gather on (re)build-->   read cache [layers, 2, B, kvh, cap, hd]
    new token K/V  --index_copy--> pool             --index_put--> read cache row b, position pos_b

The pool stays the source of truth (export, import, eviction and tiering only ever see pages).
Each request keeps its row (its slot) while it stays in the batch; the attention group is laid
out in slot order, not in the step's order. When the membership changes, a request that left
frees its slot, a newcomer's pages are gathered into a free slot, and a request whose slot lies
past the new batch size is moved down with one contiguous copy. So one whale joining or leaving
a batch of whales gathers one whale, not all of them. A row is kept only if the cache holds
exactly its positions [0, pos) (`covered`); a row that skipped steps, or came back from a
preemption and recompute, is gathered afresh. The cache is rebuilt whole when its row or
position capacity must grow, and dropped when it would exceed its byte budget.

A step that also carries prefill chunks keeps using it
for its decode rows (a prefill chunk is its own attention group and gathers its own pages), so
chunked prefill beside a steady decode batch does not force a rebuild. On a GPU a paged kernel
would replace it.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch

HEADROOM = 128  # extra positions per (re)build so a steady batch rebuilds rarely ...
HEADROOM_SHARE = 4  # ... or a quarter of the length, if more: a 2,000-token row decoding 512
# tokens is re-laid out once, not four times (each time every row of the bucket is gathered)
BUCKET_EDGES = (256, 1024, 4096)  # keys attended: <= 256, <= 1024, <= 4096, longer


def bucket_of(keys: int) -> int:
    """Length bucket of a decode row attending `keys` keys. Rows of one bucket share a read
    cache and an attention call, so a 30-token row is not padded to a 2,000-token row's length
    and short requests joining and leaving rebuild only the short rows' cache."""
    return bisect_left(BUCKET_EDGES, keys)


def key_length(max_pos: int) -> int:
    """Keys a decode group attends: its longest row's, rounded up to a multiple of 16."""
    return -(-(max_pos + 1) // 16) * 16


@dataclass
class ReadCachePlan:
    """What this step does with the read cache (built by the runner, used by PagedKVCache).
    Rows are slots: row r of the attention group is row r of the cache."""

    rebuild: bool  # gather every row from pages this step (else move/gather some, then append)
    rows: torch.Tensor  # [B] arange, the row of each sequence
    pos: torch.Tensor  # [B] position of each row's new token, in row order
    length: int  # keys attended this step (<= capacity)
    cache: "DecodeReadCache"  # whose buffer holds these rows
    order: np.ndarray | None = None  # row r holds the request at index order[r] of the step's key; None: r
    fresh: torch.Tensor | None = None  # rows to gather from pages (not in the cache)
    move_src: torch.Tensor | None = None  # rows kept from the last step: old row index ...
    move_dst: torch.Tensor | None = None  # ... and new row index (all moves at once)


class DecodeReadCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_bytes: int = 256 << 20) -> None:
        self.shape_tail = (num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.dtype, self.device, self.max_bytes = dtype, device, max_bytes
        self.key: tuple | None = None  # request ids of the cached batch, in row (slot) order
        self.slot_of: dict = {}  # request id -> its row
        self.covered = np.zeros(0, np.int64)  # positions each row holds: [0, covered[r])
        self.capacity = 0  # positions per row
        self.row_capacity = 0  # rows the buffer is laid out for
        self.buf: torch.Tensor | None = None
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._arange: torch.Tensor | None = None
        self._views: dict = {}  # (layer, batch, capacity, length) -> views of `buf`
        self.rows_gathered = 0  # rows planned to be gathered from their pages, ever (a cost counter)

    def holds(self, positions) -> bool:
        """True when row r holds exactly the positions before positions[r], for every row."""
        return len(positions) == len(self.covered) and bool(np.array_equal(self.covered, positions))

    def plan(self, batch_key: tuple, positions, length: int, page_len: int) -> ReadCachePlan | None:
        """Decide for this step's decode rows (`batch_key` and `positions`, each new token's
        position, in the step's order); None means "gather pages instead" (too big)."""
        pos = np.asarray(positions, np.int64).reshape(-1)
        if length > self.capacity or page_len > self.capacity or len(batch_key) > self.row_capacity:
            plan = self._rebuild_whole(batch_key, pos, length, page_len)
        elif batch_key == self.key and self.holds(pos):  # steady: append only
            plan = ReadCachePlan(False, self._rows(len(pos)), torch.as_tensor(pos, device=self.device), length, self)
        else:
            plan = self._reuse_rows(batch_key, pos, length)
        if plan is None:
            return None
        self.rows_gathered += len(batch_key) if plan.rebuild else 0 if plan.fresh is None else plan.fresh.numel()
        if plan.order is not None:
            batch_key, pos = tuple(batch_key[i] for i in plan.order), pos[plan.order]
        if batch_key != self.key:
            self.key, self.slot_of = batch_key, {rid: r for r, rid in enumerate(batch_key)}
        self.covered = pos + 1  # this step appends each row's new token
        return plan

    def _rebuild_whole(self, batch_key: tuple, pos: np.ndarray, length: int, page_len: int):
        b, need = len(batch_key), max(length, page_len)
        per_pos = self.num_layers * 2 * self.shape_tail[0] * self.shape_tail[1] * self._elem
        # spare rows and positions first, so that joins and growth do not relayout the buffer
        for rows, cap in ((b + (b + 3) // 4, need + max(HEADROOM, need // HEADROOM_SHARE)),
                          (b, need + HEADROOM)):
            if rows * cap * per_pos <= self.max_bytes:
                break
        else:
            self.invalidate()
            return None
        size = rows * cap * per_pos
        have = 0 if self.buf is None else self.buf.numel() * self._elem
        if have < size:  # grow geometrically: a growing batch does not reallocate every time
            size = min(max(size, have * 3 // 2), max(size, self.max_bytes))
            # zeros, not empty: masked keys get weight 0, and 0 * NaN garbage would be NaN
            self.buf = torch.zeros(size // self._elem, dtype=self.dtype, device=self.device)
        self.capacity, self.row_capacity, self._views = cap, rows, {}
        self.key, self.slot_of = None, {}
        return ReadCachePlan(True, self._rows(b), torch.as_tensor(pos, device=self.device), length, self)

    def _reuse_rows(self, batch_key: tuple, pos: np.ndarray, length: int) -> ReadCachePlan:
        """Rows the cache holds stay in their slots (moved down when their slot lies past the
        new batch size); the others are gathered into free slots."""
        b = len(batch_key)
        slot: list[int | None] = [None] * b  # by index in batch_key
        taken, movers = set(), []
        for i, rid in enumerate(batch_key):
            j = self.slot_of.get(rid)
            if j is not None and self.covered[j] == pos[i]:
                if j < b:
                    slot[i] = j
                    taken.add(j)
                else:
                    movers.append((i, j))
        free = iter([r for r in range(b) if r not in taken])  # ascending: all-new rows keep step order
        src, dst, fresh = [], [], []
        for i, j in movers:
            slot[i] = r = next(free)
            src.append(j)
            dst.append(r)
        for i in range(b):
            if slot[i] is None:
                slot[i] = r = next(free)
                fresh.append(r)
        order = np.empty(b, np.int64)
        order[np.asarray(slot, np.int64)] = np.arange(b)
        t = lambda a: torch.as_tensor(a, dtype=torch.long, device=self.device) if a else None  # noqa: E731
        return ReadCachePlan(False, self._rows(b), torch.as_tensor(pos[order], device=self.device), length, self,
                             None if np.array_equal(order, np.arange(b)) else order, t(fresh), t(src), t(dst))

    def _rows(self, b: int) -> torch.Tensor:
        if self._arange is None or self._arange.numel() < b:
            self._arange = torch.arange(max(b, 256), device=self.device)
        return self._arange[:b]

    def layer(self, layer_idx: int) -> torch.Tensor:
        """View [2, row_capacity, kv_heads, capacity, head_dim] of one layer."""
        kvh, hd = self.shape_tail
        per_layer = 2 * self.row_capacity * kvh * self.capacity * hd
        return self.buf[layer_idx * per_layer:(layer_idx + 1) * per_layer].view(
            2, self.row_capacity, kvh, self.capacity, hd)

    def views(self, layer_idx: int, batch: int, length: int) -> tuple:
        """(layer view of rows [0, B) [2, B, kvh, cap, hd], the same permuted to [B, cap, 2,
        kvh, hd] for appends, K [B, kvh, length, hd], V): built once per (layer, batch, length)
        while the buffer's layout stays the same."""
        key = (layer_idx, batch, self.capacity, length)
        got = self._views.get(key)
        if got is None:
            if len(self._views) > 8 * self.num_layers:
                self._views.clear()
            rc = self.layer(layer_idx)[:, :batch]
            got = self._views[key] = (rc, rc.permute(1, 3, 0, 2, 4), rc[0, :, :, :length], rc[1, :, :, :length])
        return got

    def invalidate(self) -> None:
        self.key, self.slot_of, self.capacity, self.row_capacity = None, {}, 0, 0
        self.covered = np.zeros(0, np.int64)
        self._views = {}


class ReadCaches:
    """One DecodeReadCache per length bucket (see bucket_of)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_bytes: int = 256 << 20) -> None:
        self.buckets = [DecodeReadCache(num_layers, num_kv_heads, head_dim, dtype, device, max_bytes)
                        for _ in range(len(BUCKET_EDGES) + 1)]

    def __getitem__(self, bucket: int) -> DecodeReadCache:
        return self.buckets[bucket]

    def invalidate(self) -> None:
        for c in self.buckets:
            c.invalidate()

    @property
    def rows_gathered(self) -> int:
        return sum(c.rows_gathered for c in self.buckets)
