"""A GPU pool another process on this host can map: CUDA IPC handles, for one-sided KV writes.

The GPU twin of shared_memory.SharedBuffer. The decode node's device pool stays an ordinary
torch allocation; `CudaSharedBuffer` exports it once with the IPC handle CUDA gives for its
allocation, and a peer on the same GPU host opens it as a tensor over the same device memory
(`open_pool`). A one-sided sender then copies its pages into the reserved ones with device
copies (kv_transport/shm_backend.py), and synchronizes before it lets go of its write slot.

The handle travels inside the Grant's locator path as `cuda-ipc:<hex of a msgpack map>` of
plain fields (bytes and integers: never a pickle, so a peer's message cannot run code here).
The token is random per buffer, as for a memfd buffer.

This is the one file that touches torch's IPC internals: `torch.multiprocessing.reductions.
reduce_tensor` (whose CUDA branch calls `UntypedStorage._share_cuda_`) to export, and its
`rebuild_cuda_tensor` (`UntypedStorage._new_shared_cuda`) to open: the functions torch's own
multiprocessing pickler uses for CUDA tensors. Checked on torch 2.11 (CUDA 13.0) and read on
2.13; tests/engine/test_cuda_ipc.py runs the round trip between two processes on a GPU, and the
encoding and its checks everywhere.
"""
from __future__ import annotations

import secrets

import msgpack
import torch

from pdtb.engine.shared_memory import Locator, SharedMemoryError, boot_id

PREFIX = "cuda-ipc:"
# reduce_tensor's argument tuple for a CUDA tensor, by position
_FIELDS = ("device", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle",
           "ref_counter_offset", "event_handle", "event_sync_required")


class CudaSharedBuffer:
    """A CUDA tensor exported through an IPC handle, with a peer-visible locator."""

    def __init__(self, kv: torch.Tensor) -> None:
        if not kv.is_cuda or not kv.is_contiguous():
            raise ValueError("a CUDA IPC pool is a contiguous CUDA tensor")
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(kv)
        # (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage bytes,
        #  storage offset bytes, requires_grad, ref counter handle, ref counter offset, event
        #  handle, event sync required)
        fields = dict(zip(_FIELDS, (args[6], *args[7:10], *args[11:15])))
        fields["offset"] = args[3]
        fields["nbytes"] = kv.numel() * kv.element_size()
        self.kv = kv
        self.nbytes = fields["nbytes"]
        self.locator = Locator(PREFIX + encode_fields(fields), secrets.token_hex(16), boot_id())

    def close(self) -> None:
        """Nothing to drop: the allocation lives as long as the pool's tensor."""


def encode_fields(fields: dict) -> str:
    return msgpack.packb(fields, use_bin_type=True).hex()


def decode_fields(path: str) -> dict:
    """The export fields of a `cuda-ipc:` locator path; SharedMemoryError if malformed."""
    if not path.startswith(PREFIX):
        raise SharedMemoryError(f"not a CUDA IPC locator: {path[:40]!r}")
    try:
        fields = msgpack.unpackb(bytes.fromhex(path[len(PREFIX):]), raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise SharedMemoryError(f"malformed CUDA IPC locator ({e})") from None
    want = {"device": int, "handle": bytes, "storage_size_bytes": int, "storage_offset_bytes": int,
            "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": (bytes, type(None)),
            "event_sync_required": bool, "offset": int, "nbytes": int}
    if not isinstance(fields, dict) or set(fields) != set(want) \
            or any(not isinstance(fields[k], t) for k, t in want.items()):
        raise SharedMemoryError("malformed CUDA IPC locator (fields)")
    return fields


def is_cuda_locator(path: str) -> bool:
    return path.startswith(PREFIX)


def open_pool(loc: Locator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The peer's pool as a CUDA tensor of `shape` over its memory; SharedMemoryError where it
    cannot be opened (another host, no CUDA here, a size that does not match, a stale handle)."""
    if loc.host != boot_id():
        raise SharedMemoryError(f"the pool is on another host (boot id {loc.host[:8]}...)")
    f = decode_fields(loc.path)
    elem = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    if numel * elem != f["nbytes"]:
        raise SharedMemoryError(f"the pool has {f['nbytes']} bytes, not {numel * elem} of this geometry")
    if not torch.cuda.is_available() or f["device"] >= torch.cuda.device_count():
        raise SharedMemoryError(f"cuda:{f['device']} is not visible to this process")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(reversed(stride)), f["offset"],
                                   torch.UntypedStorage, dtype, f["device"], f["handle"], f["storage_size_bytes"],
                                   f["storage_offset_bytes"], False, f["ref_counter_handle"],
                                   f["ref_counter_offset"], f["event_handle"], f["event_sync_required"])
    except RuntimeError as e:
        raise SharedMemoryError(f"cannot open the peer's CUDA pool: {str(e).splitlines()[0][:200]}") from None
