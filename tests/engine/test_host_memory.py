"""Pool memory on huge pages: the tensor is an ordinary zeroed one whatever the kernel grants."""
from __future__ import annotations

import torch

from pdtb.engine import host_memory
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool


def test_large_tensors_are_zeroed_contiguous_and_huge_page_aligned():
    shape = (3, 2, 1000, 16, 2, 32)  # 24 MiB of float32
    t = host_memory.zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    if host_memory._madvise() is not None:
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    t.view(-1)[-1] = 1.0  # the whole extent is writable
    assert t.sum() == 1.0


def test_small_tensors_stay_ordinary():
    t = host_memory.zeros((4, 8), torch.bfloat16)
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16 and not t.any()


def test_a_cpu_pool_uses_it():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")
    pool = PagePool(spec, num_pages=1024)  # 16 MiB
    assert pool.kv.is_contiguous() and not pool.kv.any()
    if host_memory._madvise() is not None:
        assert pool.kv.data_ptr() % host_memory.HUGE_PAGE == 0
