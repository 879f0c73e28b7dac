"""The C paged decode kernel against a float64 reference computed row by row from the pages,
over the shapes it specialises (head_dim 32/64/128/256) and the generic one, GQA groups, page
sizes and thread counts; its build cache and its fallback. The RMSNorm helper against a float64
reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pdtb.engine import cpu_kernel

kernel = cpu_kernel.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler: the kernel cannot be built here")


def make_case(lens, page_size, heads, kv_heads, head_dim, seed=0, num_pages=None, poison=True):
    """A layer's pool with every row's pages scattered over it; pages no row owns hold NaN, so a
    kernel reading past a row's table or length cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lens]
    num_pages = num_pages or sum(need) + 7
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(perm[used:used + n])
        used += n
    if poison:
        free = perm[used:]
        k[free] = float("nan")
        v[free] = float("nan")
        for t, n in zip(tables, lens):  # slots past each row's length, in its last page
            last = t[-1] if t else None
            if last is not None and n % page_size:
                k[last, n % page_size:] = float("nan")
                v[last, n % page_size:] = float("nan")
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k, v, tables


def reference(q, k, v, tables, lens, scale):
    rows, heads, hd = q.shape
    group = heads // k.shape[2]
    out = torch.empty(rows, heads, hd, dtype=torch.float64)
    for b, (table, n) in enumerate(zip(tables, lens)):
        kb = k[table].reshape(-1, k.shape[2], hd)[:n].double()
        vb = v[table].reshape(-1, v.shape[2], hd)[:n].double()
        for h in range(heads):
            w = torch.softmax(kb[:, h // group] @ q[b, h].double() * scale, 0)
            out[b, h] = w @ vb[:, h // group]
    return out


def run_kernel(q, k, v, tables, lens, scale):
    pages = torch.tensor([p for t in tables for p in t], dtype=torch.int64)
    starts = torch.tensor(np.concatenate(([0], np.cumsum([len(t) for t in tables])[:-1])), dtype=torch.int64)
    return kernel(q, k, v, pages, starts, torch.tensor(lens, dtype=torch.int64), max(lens), scale)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 48])  # 48: the generic (scalar) path
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 7, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_reference(head_dim, heads, kv_heads, page_size, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lens = [1, 2, 15, 16, 17, 33, 130, 5]
    q, k, v, tables = make_case(lens, page_size, heads, kv_heads, head_dim, seed=page_size + heads)
    scale = head_dim ** -0.5
    out = run_kernel(q, k, v, tables, lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k, v, tables, lens, scale), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_peaked_scores_and_strided_queries():
    """Large logits (a nearly one-hot softmax: the max subtraction and the exp's clamp at work)
    and query rows that are a strided view, as the model's flat rows are."""
    lens = [300, 1, 64]
    q, k, v, tables = make_case(lens, 16, 4, 2, 32, seed=3)
    scale = 8.0  # scores of tens of units: most weights underflow to 0
    flat = torch.randn(2 * len(lens), 4, 32)
    flat[::2] = q
    out = run_kernel(flat[::2], k, v, tables, lens, scale)
    torch.testing.assert_close(out.double(), reference(q, k, v, tables, lens, scale), atol=1e-5, rtol=1e-4)


@needs_kernel
def test_kernel_refuses_what_it_cannot_read():
    q, k, v, tables = make_case([4], 16, 4, 2, 32, poison=False)
    with pytest.raises(ValueError):
        run_kernel(q.double(), k.double(), v.double(), tables, [4], 1.0)
    with pytest.raises(ValueError):
        run_kernel(q, k.transpose(1, 2), v, tables, [4], 1.0)  # not the pool's layout
    with pytest.raises(ValueError):  # int32 tables would be read as int64
        kernel(q, k, v, torch.tensor(tables[0], dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
               torch.tensor([4]), 4, 1.0)


@needs_kernel
def test_build_is_cached_per_machine(tmp_path, monkeypatch):
    first = cpu_kernel.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernel.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # reused
    monkeypatch.setattr(cpu_kernel, "_cpu_signature", lambda: "another cpu")
    assert cpu_kernel.build(tmp_path) != first  # another CPU never loads this build


@needs_kernel
@pytest.mark.parametrize("extra", cpu_kernel.FLAG_SETS)
def test_every_fallback_build_computes_the_same(extra, tmp_path, monkeypatch):
    """The builds tried after -march=native -fopenmp (no native instructions; no OpenMP: one
    thread) give the same answers."""
    import ctypes
    import subprocess

    cc = cpu_kernel._compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    lib = cpu_kernel._build_with(cc, version, (*cpu_kernel.BASE_FLAGS, *extra), tmp_path)
    k = cpu_kernel.DecodeKernel(ctypes.CDLL(str(lib)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    lens = [1, 17, 130, 40]
    q, kp, vp, tables = make_case(lens, 16, 4, 2, 64, seed=9)
    pages = torch.tensor([p for t in tables for p in t], dtype=torch.int64)
    starts = torch.tensor(np.concatenate(([0], np.cumsum([len(t) for t in tables])[:-1])), dtype=torch.int64)
    out = k(q, kp, vp, pages, starts, torch.tensor(lens), max(lens), 0.125)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, tables, lens, 0.125), atol=2e-5, rtol=1e-4)


def test_no_compiler_is_a_clear_error_and_the_engine_falls_back(llama_dir, tmp_path, monkeypatch):
    from conftest import make_engine

    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    with pytest.raises(cpu_kernel.KernelBuildError, match="no C compiler"):
        cpu_kernel.build(tmp_path)
    monkeypatch.setattr(cpu_kernel, "load", lambda: None)
    engine = make_engine(llama_dir)
    assert engine.runner.kernel is None and engine.runner.read_cache is not None


def test_a_compiler_error_names_the_compiler(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernel, "SOURCES", (bad,))
    if cpu_kernel._compiler() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(cpu_kernel.KernelBuildError, match="failed"):
        cpu_kernel.build(tmp_path)
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob(".*tmp*"))  # nothing half-written


@pytest.mark.parametrize("rows,dim", [(1, 384), (7, 100), (0, 64), (32, 4096)])
def test_rms_norm_matches_reference(rows, dim):
    norm = cpu_kernel.rms_norm()
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x, add = (torch.randn(rows, dim, generator=gen) * 3 for _ in range(2))
    w = torch.randn(dim, generator=gen)
    summed = x.double() + add.double()
    want = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = norm(x, w, 1e-6, add=add)
    assert torch.equal(x, (summed.float()))  # the residual add, in place, exact in float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (dim,), w, 1e-6), rtol=2e-6, atol=2e-6)


def test_rms_norm_refuses_what_it_cannot_read():
    norm = cpu_kernel.rms_norm()
    with pytest.raises(ValueError, match="float32"):
        norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        norm(torch.zeros(2, 8), torch.ones(8), 1e-6, add=torch.zeros(2, 4))
