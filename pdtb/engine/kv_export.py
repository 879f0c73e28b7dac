"""`KVExportHeader`/`KVExport`: one request's pages as contiguous buffer + header.

Export one request's pages as a contiguous buffer plus a small typed header, and import it.

This is the unit the transport moves: `KVExport.header` travels as msgpack, `KVExport.data`
as raw bytes. Layout of `data` (see KVSpec):

    data[layer, k_or_v, i, slot, kv_head, head_dim]   i = index in the request's page table

Only the first `num_tokens` slots are meaningful; the tail of the last page is padding.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool


@dataclass(frozen=True)
class KVExportHeader:
    """Everything a receiver needs to validate and place an export before reading its bytes."""

    request_id: str  # owner of the pages on both sides
    num_tokens: int  # tokens whose K/V are in the pages
    num_pages: int  # pages in the payload == spec.pages_for(num_tokens) - skip_pages
    spec: KVSpec  # geometry and dtype of every page
    skip_pages: int = 0  # leading pages of the page table left out (the receiver has them cached)

    def __post_init__(self) -> None:
        if self.num_pages + self.skip_pages != self.spec.pages_for(self.num_tokens) or self.num_pages < 1:
            raise ValueError(f"num_pages {self.num_pages} after {self.skip_pages} skipped does not hold "
                             f"{self.num_tokens} tokens")

    @property
    def payload_bytes(self) -> int:
        return self.num_pages * self.spec.bytes_per_page

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVExportHeader":
        return cls(request_id=d["request_id"], num_tokens=d["num_tokens"],
                   num_pages=d["num_pages"], spec=KVSpec(**d["spec"]), skip_pages=d.get("skip_pages", 0))


SUM_BLOCK_BYTES = 64 * 1024  # granularity of the payload checksums an export carries


@dataclass
class KVExport:
    header: KVExportHeader
    data: torch.Tensor  # contiguous, shape spec.page_shape(num_pages)
    # sum64 (uint64 word sum mod 2**64) of each SUM_BLOCK_BYTES block of `data`, taken while
    # the bytes are still in cache from the gather; the transport folds these into its chunk
    # checksums instead of reading the payload again. None: the transport sums it itself.
    block_sums: np.ndarray | None = None

    def as_bytes_view(self) -> memoryview:
        """Zero-copy byte view of the payload (CPU tensors only)."""
        return memoryview(self.data.view(torch.uint8).reshape(-1).numpy())


def export_request(pool: PagePool, request_id: str, num_tokens: int, skip_pages: int = 0,
                   out: torch.Tensor | None = None) -> KVExport:
    """Copy `request_id`'s pages out of `pool` into one contiguous CPU-or-device tensor,
    leaving out its first `skip_pages` (the receiver holds them cached; at least one page is sent).
    `out`: a uint8 tensor of exactly the payload's bytes to copy into (a sender's
    export_buffer), used where it is on the pool's device; otherwise a new tensor."""
    pages = pool.pages_of(request_id)
    need = pool.spec.pages_for(num_tokens)
    if len(pages) < need:
        raise ValueError(f"{request_id} holds {len(pages)} pages, needs {need} for {num_tokens} tokens")
    if not 0 <= skip_pages < need:
        raise ValueError(f"cannot skip {skip_pages} of {need} pages")
    header = KVExportHeader(request_id, num_tokens, need - skip_pages, pool.spec, skip_pages)
    if out is not None and (out.device != pool.kv.device or out.numel() != header.payload_bytes):
        out = None
    data = pool.export_pages(pages[skip_pages:need], out)
    return KVExport(header, data, block_sums(data))


def block_sums(data: torch.Tensor) -> np.ndarray:
    """sum64 of each SUM_BLOCK_BYTES block of a contiguous tensor's bytes (the last block may be
    short; a tail under 8 bytes counts zero-padded), as uint64."""
    flat = data.contiguous().view(torch.uint8).reshape(-1)
    n, per = flat.numel(), SUM_BLOCK_BYTES
    whole = n // per
    parts = []
    if whole:
        body = flat[:whole * per]
        if body.device.type == "cpu":
            words = body.numpy().view("<u8").reshape(whole, per // 8)
            parts.append(np.add.reduce(words, axis=1, dtype=np.uint64))
        else:  # int64 sums wrap like uint64 sums
            s = body.view(torch.int64).reshape(whole, per // 8).sum(1).cpu().numpy()
            parts.append(s.view(np.uint64))
    if n > whole * per:
        tail = flat[whole * per:].cpu().numpy()
        pad = np.zeros(-(-tail.size // 8) * 8, dtype=np.uint8)
        pad[:tail.size] = tail
        parts.append(np.array([np.add.reduce(pad.view("<u8"), dtype=np.uint64)], np.uint64))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def import_request(pool: PagePool, export: KVExport, owner: str | None = None) -> list[int] | None:
    """Allocate pages in `pool` and copy the export into them. None if the pool is too full."""
    h = export.header
    if h.spec != pool.spec:
        raise ValueError(f"export spec {h.spec} does not match pool spec {pool.spec}")
    pages = pool.allocate(owner or h.request_id, h.num_pages)
    if pages is None:
        return None
    pool.import_pages(pages, export.data)
    return pages
