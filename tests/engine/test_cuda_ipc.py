"""CUDA IPC locators of GPU pools (pdtb/engine/cuda_ipc.py): what travels in a Grant, and the
checks a sender makes before it opens a peer's pool. The round trip between two processes on
a GPU is in tests/engine/test_cuda.py (test_shm_over_cuda_ipc_bit_identical)."""
from __future__ import annotations

import pytest
import torch

from pdtb.engine import cuda_ipc
from pdtb.engine.shared_memory import Locator, SharedMemoryError, boot_id

FIELDS = {"device": 0, "handle": b"h" * 64, "storage_size_bytes": 4096, "storage_offset_bytes": 0,
          "ref_counter_handle": b"r" * 16, "ref_counter_offset": 0, "event_handle": b"e" * 64,
          "event_sync_required": True, "offset": 0, "nbytes": 4096}


def locator(fields=FIELDS, host=None) -> Locator:
    return Locator(cuda_ipc.PREFIX + cuda_ipc.encode_fields(fields), "ab" * 16, host or boot_id())


def test_fields_round_trip():
    loc = locator()
    assert cuda_ipc.is_cuda_locator(loc.path) and not cuda_ipc.is_cuda_locator("/proc/1/fd/3")
    assert cuda_ipc.decode_fields(loc.path) == FIELDS
    assert cuda_ipc.decode_fields(locator({**FIELDS, "event_handle": None}).path)["event_handle"] is None


@pytest.mark.parametrize("path", [
    "cuda-ipc:zz",  # not hex
    "cuda-ipc:" + b"\xc1".hex(),  # not msgpack
    "cuda-ipc:" + cuda_ipc.encode_fields([1, 2]),  # not a map
    "cuda-ipc:" + cuda_ipc.encode_fields({**FIELDS, "handle": "text"}),  # a field of the wrong type
    "cuda-ipc:" + cuda_ipc.encode_fields({k: v for k, v in FIELDS.items() if k != "nbytes"}),  # one missing
    "cuda-ipc:" + cuda_ipc.encode_fields({**FIELDS, "extra": 1}),  # one too many
    "/proc/1/fd/3",
])
def test_malformed_locators_are_refused(path):
    with pytest.raises(SharedMemoryError):
        cuda_ipc.decode_fields(path)


def test_open_refuses_another_host_and_another_geometry():
    with pytest.raises(SharedMemoryError, match="another host"):
        cuda_ipc.open_pool(locator(host="another-boot"), (1024,), torch.float32)
    with pytest.raises(SharedMemoryError, match="not 8192"):
        cuda_ipc.open_pool(locator(), (2048,), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where no GPU is visible")
def test_open_without_a_gpu_says_so():
    with pytest.raises(SharedMemoryError, match="not visible"):
        cuda_ipc.open_pool(locator(), (1024,), torch.float32)


def test_export_needs_a_contiguous_cuda_tensor():
    with pytest.raises(ValueError, match="contiguous CUDA"):
        cuda_ipc.CudaSharedBuffer(torch.zeros(4))
