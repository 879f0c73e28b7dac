"""Allocator settings for large receive buffers.

Keep freed ZeroMQ receive buffers mapped (glibc), so they are not page-faulted in again.

libzmq's I/O thread mallocs one buffer per received message (4 MiB per chunk). With a few
chunks in flight, freeing them grows the top of that thread's heap past glibc's trim
threshold (dynamically 2x the largest freed mmap chunk, so 8 MiB here), glibc returns the
pages to the kernel, and the next chunk faults every page back in: measured 30,000 extra minor
faults per 512 MiB received and about half the receive throughput on 2 cores. A raw pyzmq
receiver that frees each message at once keeps fewer buffers alive and does not hit this.

`keep_freed_memory()` raises the trim threshold and pins the mmap threshold (which also turns
off glibc's dynamic adjustment). It is process-wide libc state: the receiver applies it on
start when `TransportConfig.tune_malloc` is set (the default); the cost is that up to
`trim_threshold` bytes of freed memory stay in the process.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MiB = 1 << 20


def keep_freed_memory(trim_threshold: int = 256 * MiB, mmap_threshold: int = 32 * MiB) -> bool:
    """Apply the glibc settings above. Returns False where they are not available."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if not ok:
        log.warning("mallopt refused the transport's malloc settings")
    return ok
