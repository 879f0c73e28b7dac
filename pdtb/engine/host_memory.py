"""Zeroed CPU tensors on transparent huge pages, where the kernel allows it.

A KV pool is one large tensor that transfers write into (the receiver's landing copy) and
attention reads from, page by page, all over it. On 4 KiB pages a scattered read misses the
TLB every 4 KiB; Linux's transparent huge pages (2 MiB) cut those misses 512-fold, but in the
common `madvise` mode (/sys/kernel/mm/transparent_hugepage/enabled) only for memory that asks.
`zeros()` allocates 2 MiB more than it needs, advises the 2 MiB-aligned part it returns before
anything touches it, then zeroes it, which faults it in as huge pages where the kernel has
them to give. Measured on a 2-core machine: landing 4 MiB chunks into a 128 MiB pool at 24.5
GB/s against 21.1 on 4 KiB pages. Where madvise is unavailable or THP is off, the tensor is an
ordinary zeroed one; nothing depends on the advice being taken.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where storage is made or moved: a pool without storage needs no torch)
    import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors are not worth the spare 2 MiB


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor, on huge pages where the kernel gives them."""
    import torch
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advise = _madvise()
    if advise is None or nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    part = raw[start:start + nbytes]
    advise(part.data_ptr(), nbytes - nbytes % HUGE_PAGE, MADV_HUGEPAGE)  # refusal: 4 KiB pages, no harm
    out = part.view(dtype).view(shape)
    out.zero_()
    return out
