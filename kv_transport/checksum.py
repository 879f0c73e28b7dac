"""Incremental payload checksums, computed chunk by chunk on both sides.

- "sum64": sum of the payload read as little-endian uint64 words, modulo 2**64 (a tail
  shorter than 8 bytes is zero-padded). It runs at memory speed, about 7x zlib.crc32 on
  one core (64 MiB not in cache); order within a chunk is not covered, but chunks are
  checked by index and offset, and loopback TCP/IPC already protect bytes in flight. This is the default so that
  verifying costs little next to moving the bytes (see README, "Checksums").
- "crc32": zlib.crc32, for when a stronger check is worth a 2-3x lower ceiling on 2 cores.

Chunk boundaries are multiples of 8 bytes (wire.WireLimits.chunk_align), so summing chunk by
chunk gives the same value as summing the whole payload.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

MASK64 = (1 << 64) - 1
_U64 = np.dtype("<u8")


def initial(algo: str) -> int:
    """Checksum of the empty payload."""
    return 0


def update(algo: str, value: int, data) -> int:
    """Fold `data` (a bytes-like object or a tensor) into the running checksum `value`."""
    if isinstance(data, torch.Tensor):
        return _update_tensor(algo, value, data)
    if algo == "crc32":
        return zlib.crc32(data, value)
    if algo == "sum64":
        return _sum64(value, memoryview(data).cast("B"))
    raise ValueError(f"unknown checksum {algo!r}")


def _sum64(value: int, view: memoryview) -> int:
    whole = len(view) & ~7
    if whole:
        words = np.frombuffer(view, dtype=_U64, count=whole // 8)
        value = (value + int(np.add.reduce(words))) & MASK64
    if whole != len(view):
        tail = bytes(view[whole:]) + b"\0" * (8 - (len(view) - whole))
        value = (value + int.from_bytes(tail, "little")) & MASK64
    return value


def _update_tensor(algo: str, value: int, data: torch.Tensor) -> int:
    flat = data.contiguous().view(torch.uint8).reshape(-1)
    if algo == "sum64" and flat.device.type != "cpu":
        # On an accelerator: int64 sums wrap like uint64 sums; only the tail needs care.
        whole = flat.numel() & ~7
        s = int(flat[:whole].view(torch.int64).sum().item()) if whole else 0
        value = (value + s) & MASK64
        if whole != flat.numel():
            value = _sum64(value, memoryview(flat[whole:].cpu().numpy()))
        return value
    return update(algo, value, memoryview(flat.cpu().numpy()))


def running_from_blocks(blocks: np.ndarray, block_bytes: int, chunk_bytes: int, nbytes: int,
                        whole: bool = False) -> list[int] | None:
    """Running sum64 after each `chunk_bytes` chunk of an `nbytes` payload, from the sums of its
    `block_bytes` blocks (pdtb.engine.kv_export.block_sums); with `whole`, just [the sum of
    everything]. None when the blocks do not cover the payload or chunks do not start on
    block boundaries."""
    if len(blocks) != -(-nbytes // block_bytes):
        return None
    if whole or nbytes == 0:
        return [int(np.add.reduce(blocks, dtype=np.uint64))]
    if chunk_bytes % block_bytes:
        return None
    running = np.cumsum(blocks, dtype=np.uint64)  # wraps modulo 2**64, like the sum itself
    per = chunk_bytes // block_bytes
    return [int(running[min((i + 1) * per, len(blocks)) - 1])
            for i in range(-(-nbytes // chunk_bytes))]


def of(algo: str, data) -> int:
    """Checksum of a whole payload."""
    return update(algo, initial(algo), data)
