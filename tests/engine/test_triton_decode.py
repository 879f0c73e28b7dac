"""The Triton paged decode kernels (pdtb/engine/triton_decode.py) against a float64 reference.

On a GPU they run compiled; elsewhere in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before Triton is first imported). Skipped where Triton is not installed (the CPU
build of torch ships without it).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from pdtb.engine import triton_decode  # noqa: E402


def _interpreter_scalars() -> None:
    """Triton's interpreter holds a kernel's scalars as one-element arrays and turns one into a
    Python int (a loop's runtime bounds) with int(array), which numpy 2.4 refuses for arrays
    of one dimension. Its patch of the tensor class is wrapped to use .item() instead (checked
    on Triton 3.6.0 with numpy 2.4.6; interpreter only, compiled kernels do not pass here)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(original, "__name__", "") != "patched":
        interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalars()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(pages: int, page_size: int, kvh: int, hd: int, dtype, gen) -> torch.Tensor:
    """One layer's pool [2, pages, page_size, kv_heads, head_dim] of random values."""
    return torch.randn(2, pages, page_size, kvh, hd, generator=gen).to(device=DEVICE, dtype=dtype)


def reference(q, pool, tables, lens, scale):
    """Attention of each row's query heads over its first lens[r] keys, in float64."""
    rows, heads, hd = q.shape
    ps, kvh = pool.shape[2], pool.shape[3]
    out = torch.zeros(rows, heads, hd, dtype=torch.float64)
    for r in range(rows):
        n = lens[r]
        if n == 0:
            continue
        t = torch.arange(n)
        pages = torch.tensor(tables[r])[t // ps]
        k = pool[0].double().cpu()[pages, t % ps]  # [n, kvh, hd]
        v = pool[1].double().cpu()[pages, t % ps]
        for h in range(heads):
            kh = h // (heads // kvh)
            w = torch.softmax(q[r, h].double().cpu() @ k[:, kh].T * scale, dim=0)
            out[r, h] = w @ v[:, kh]
    return out


def run_kernel(kernel, q, pool, tables, lens, max_len=None):
    starts, flat = [], []
    for t in tables:
        starts.append(len(flat))
        flat.extend(t)
    as_t = lambda a: torch.tensor(a, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return kernel(q, pool[0], pool[1], as_t(flat or [0]), as_t(starts), as_t(lens),
                  max_len or max(max(lens), 1), q.shape[-1] ** -0.5)


@pytest.mark.parametrize("page_size,heads,kvh,hd", [(16, 4, 2, 32), (7, 8, 8, 64), (1, 32, 8, 128), (16, 6, 2, 80)])
def test_decode_matches_reference(page_size, heads, kvh, hd):
    gen = torch.Generator().manual_seed(page_size * 1000 + heads + hd)
    lens = [1, 5, 17, 100, 0, 333]
    pool = make_pool(sum(-(-n // page_size) for n in lens) + 3, page_size, kvh, hd, torch.float32, gen)
    order = torch.randperm(pool.shape[1], generator=gen).tolist()  # pages scattered through the pool
    tables = []
    for n in lens:
        k = -(-n // page_size)
        tables.append(order[:k])
        order = order[k:]
    q = torch.randn(len(lens), heads, hd, generator=gen).to(DEVICE)
    kernel = triton_decode.DecodeKernel(torch.device(DEVICE))
    got = run_kernel(kernel, q, pool, tables, lens)
    want = reference(q, pool, tables, lens, hd ** -0.5)
    assert got.shape == (len(lens), heads, hd) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    err = (got.double().cpu() - want).norm() / want.norm()
    assert err < 1e-5, err
    assert got[4].abs().max() == 0  # a row of no keys attends to nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_split_count(dtype):
    """Each split count gives the same attention: the spans' merge is exact up to rounding,
    whatever the grid. bfloat16 (tensor-core products) on a GPU only: the interpreter
    multiplies bfloat16 tiles as raw bits."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter has no bfloat16 tl.dot")
    gen = torch.Generator().manual_seed(7)
    lens, ps = [3, 64, 129, 250], 16
    pool = make_pool(64, ps, 2, 64, dtype, gen)
    tables = [list(range(i * 16, i * 16 + -(-n // ps))) for i, n in enumerate(lens)]
    q = torch.randn(len(lens), 8, 64, generator=gen).to(DEVICE, dtype)
    want = reference(q, pool, tables, lens, 64 ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for splits, cfg in ((1, ""), (2, "block_n=16,min_span=16"), (4, "block_n=64,num_warps=8,head_major=1"),
                        (32, "block_n=32,num_stages=2,min_span=32"), (8, "min_span=512")):
        kernel = triton_decode.DecodeKernel(torch.device(DEVICE), triton_decode.KernelConfig.parse(cfg))
        kernel.forced_splits = splits  # 1: the span kernel writes the output itself, no merge
        got = run_kernel(kernel, q, pool, tables, lens, max_len=4096)
        assert got.dtype == dtype
        assert (got.double().cpu() - want).norm() / want.norm() < tol, (splits, cfg)


def test_kernel_config_parse():
    cfg = triton_decode.KernelConfig.parse("block_n=64, num_warps=8")
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 8, triton_decode.KernelConfig().num_stages)
    assert triton_decode.KernelConfig.parse("block_n=16,min_span=16").min_span == 16
    for bad in ("block_n=48", "warps=4", "num_warps=0", "num_stages=x", "block_n=64,min_span=96"):
        with pytest.raises(ValueError, match="decode kernel config"):
            triton_decode.KernelConfig.parse(bad)


def test_choose_splits():
    assert triton_decode.choose_splits(64, 8, 1024, 264) == 1  # enough rows x heads already
    assert triton_decode.choose_splits(1, 8, 8192, 264) == 16  # one row: spans of 512 keys at least
    assert triton_decode.choose_splits(1, 8, 8192, 264, min_span=256) == 32  # up to 32 spans
    assert triton_decode.choose_splits(1, 8, 8192, 264, min_span=1024) == 8
    assert triton_decode.choose_splits(1, 8, 100, 264) == 1  # too short to split
    assert triton_decode.choose_splits(2, 2, 32768, 264, min_span=512) == 32  # capped, power of two


def test_store_writes_at_slots_and_skips_negative():
    gen = torch.Generator().manual_seed(3)
    ps, kvh, hd = 7, 2, 32
    cache = make_pool(5, ps, kvh, hd, torch.float32, gen)
    before = cache.clone()
    k = torch.randn(1, kvh, 4, hd, generator=gen).to(DEVICE)
    v = torch.randn(1, kvh, 4, hd, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 34, 8], device=DEVICE)
    triton_decode.DecodeKernel(torch.device(DEVICE)).store(cache, k, v, slots)
    want = before.view(2, -1, kvh, hd).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[0, s], want[1, s] = k[0, :, t], v[0, :, t]
    assert torch.equal(cache.view(2, -1, kvh, hd), want)
