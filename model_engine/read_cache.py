"""Decode read cache: a contiguous copy of the running batch's K/V for attention on the CPU.

Without a paged-attention kernel (there is none for the CPU), every layer of every step would
gather each sequence's pages into a padded `[B, kv_heads, L, head_dim]` batch: the whole KV of
the batch copied 2 x layers times per step. During steady decode the batch does not change, so
the runner keeps that gathered copy between steps and only appends the new token to it:

    pool pages (authoritative, paged)   --gather on (re)build-->   read cache [layers, 2, B, kvh, cap, hd]
    new token K/V  --index_copy--> pool             --index_put--> read cache row b, position pos_b

The pool stays the source of truth (export, import, eviction and tiering only ever see pages);
the read cache is rebuilt whenever the decode rows' membership or order changes and dropped
when it would exceed its byte budget. A step that also carries prefill chunks keeps using it
for its decode rows (a prefill chunk is its own attention group and gathers its own pages), so
chunked prefill beside a steady decode batch does not force a rebuild. On a GPU a paged kernel
would replace it.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

HEADROOM = 128  # extra positions per (re)build so a steady batch rebuilds rarely
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
    """What this step does with the read cache (built by the runner, used by PagedKVCache)."""

    rebuild: bool  # gather from pages this step (else append only)
    rows: torch.Tensor  # [B] arange, the row of each sequence
    pos: torch.Tensor  # [B] position of each sequence's new token
    length: int  # keys attended this step (<= capacity)
    cache: "DecodeReadCache"  # whose buffer holds these rows


class DecodeReadCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_bytes: int = 256 << 20) -> None:
        self.shape_tail = (num_kv_heads, head_dim)
        self.num_layers = num_layers
        self.dtype, self.device, self.max_bytes = dtype, device, max_bytes
        self.key: tuple | None = None  # request ids of the cached batch, in row order
        self.capacity = 0
        self.buf: torch.Tensor | None = None
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._arange: torch.Tensor | None = None
        self._views: dict = {}  # (layer, batch, capacity, length) -> views of `buf`

    def plan(self, batch_key: tuple, positions, length: int, page_len: int) -> ReadCachePlan | None:
        """Decide for a pure-decode step; None means "gather pages instead" (too big)."""
        b = len(batch_key)
        rebuild = batch_key != self.key or length > self.capacity
        if rebuild:
            cap = max(length, page_len) + HEADROOM
            size = self.num_layers * 2 * b * cap * self.shape_tail[0] * self.shape_tail[1] * self._elem
            if size > self.max_bytes:
                self.invalidate()
                return None
            have = 0 if self.buf is None else self.buf.numel() * self._elem
            if have < size:  # grow geometrically: a growing batch does not reallocate every time
                size = min(max(size, have * 3 // 2), max(size, self.max_bytes))
                # zeros, not empty: masked keys get weight 0, and 0 * NaN garbage would be NaN
                self.buf = torch.zeros(size // self._elem, dtype=self.dtype, device=self.device)
            self.key, self.capacity, self._views = batch_key, cap, {}
        return ReadCachePlan(rebuild, self._rows(b), torch.as_tensor(positions, device=self.device),
                             length, self)

    def _rows(self, b: int) -> torch.Tensor:
        if self._arange is None or self._arange.numel() < b:
            self._arange = torch.arange(max(b, 256), device=self.device)
        return self._arange[:b]

    def layer(self, layer_idx: int, batch: int) -> torch.Tensor:
        """View [2, B, kv_heads, capacity, head_dim] of one layer."""
        kvh, hd = self.shape_tail
        per_layer = 2 * batch * kvh * self.capacity * hd
        return self.buf[layer_idx * per_layer:(layer_idx + 1) * per_layer].view(2, batch, kvh, self.capacity, hd)

    def views(self, layer_idx: int, batch: int, length: int) -> tuple:
        """(layer view, the same permuted to [B, cap, 2, kvh, hd] for appends, K [B, kvh, length,
        hd], V): built once per (layer, length) while the cached batch stays the same."""
        key = (layer_idx, batch, self.capacity, length)
        got = self._views.get(key)
        if got is None:
            if len(self._views) > 8 * self.num_layers:
                self._views.clear()
            rc = self.layer(layer_idx, batch)
            got = self._views[key] = (rc, rc.permute(1, 3, 0, 2, 4), rc[0, :, :, :length], rc[1, :, :, :length])
        return got

    def invalidate(self) -> None:
        self.key, self.capacity = None, 0
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
