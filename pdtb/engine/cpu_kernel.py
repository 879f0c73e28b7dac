"""The project's C helpers for the CPU (csrc/*.c): built at first use, called via ctypes.

- csrc/paged_decode.c: decode attention straight over the paged pool (`load()`);
- csrc/copy_rows.c: a transfer's landing copy and checksum in one pass (`row_copier()`);
- csrc/rms_norm.c: RMSNorm with the residual add before it (`rms_norm()`, lean_forward.py).

The C files need nothing but a C compiler: no torch headers, no Python headers, so a build
takes about a second. It is compiled with the system compiler (`$CC`, else cc, gcc or clang)
at -O3 -march=native -fopenmp (or the fallbacks of FLAG_SETS) into the project's cache
(tiny_model.cache_root()/kernels/<key>/), the key hashing the sources, the compiler's version,
the flags and this CPU's model and feature flags, so a cache shared between machines never
hands one CPU another's build. A build is
written under a temporary name and renamed into place: nodes that start together may each
build, none loads half a file. Where no compiler works, `load()` returns None, says why once
in the log, and the runner keeps the torch path (read cache and batched matmuls).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from pdtb.engine.tiny_model import cache_root

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.c")))
BASE_FLAGS = ("-O3", "-std=gnu11", "-fno-math-errno", "-shared", "-fPIC")
# Tried in order, the first that builds wins: this CPU's instructions and OpenMP threads; then
# without -march=native (a compiler that does not know it); then without OpenMP (one thread:
# clang without libomp, say). The C files compile under all three.
FLAG_SETS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
BUILD_TIMEOUT_S = 120.0

_P = ctypes.c_void_p
_I = ctypes.c_int64


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines()[:64] if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep))  # the first processor's lines


def build(cache_dir: Path | None = None) -> Path:
    """Compile the C files if this machine has no build of them yet; return the library's path."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set CC, or install cc, gcc or clang)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} --version failed: {e}") from None
    errors = []
    for extra in FLAG_SETS:
        try:
            return _build_with(cc, version, (*BASE_FLAGS, *extra), cache_dir)
        except KernelBuildError as e:
            errors.append(str(e))
    raise KernelBuildError(errors[0])


def _build_with(cc: str, version: str, flags: tuple[str, ...], cache_dir: Path | None) -> Path:
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES), version.encode(),
                                     " ".join(flags).encode(), _cpu_signature().encode()])).hexdigest()[:16]
    out_dir = (cache_dir or cache_root() / "kernels") / key
    lib = out_dir / "libpdtb_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".libpdtb_cpu.so.tmp{os.getpid()}"
    try:
        res = subprocess.run([cc, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], capture_output=True,
                             text=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip().splitlines()
            raise KernelBuildError(f"{cc} {' '.join(flags)} failed: {msg[0] if msg else 'exit ' + str(res.returncode)}")
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cc} failed: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return lib


class DecodeKernel:
    """`pdtb_paged_decode_f32` with its argument types; see the C file for the layout."""

    name = "c"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pdtb_paged_decode_f32
        self._fn.restype = None
        self._fn.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I]
        self._scratch = torch.empty(0, dtype=torch.float32)  # per-thread score rows
        self._kv_of = torch.empty(0, dtype=torch.int64)  # the kv head of each query head

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                 page_start: torch.Tensor, lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """q [rows, heads, head_dim] float32 (rows may be strided); k, v: one layer's pool
        [pages, page_size, kv_heads, head_dim], contiguous; pages, page_start, lens: int64
        (see the C file). Returns [rows, heads, head_dim]."""
        rows, heads, hd = q.shape
        _, page_size, kvh, hd_k = k.shape
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        if not (k.is_contiguous() and v.is_contiguous() and hd_k == hd and heads % kvh == 0
                and q.dtype == k.dtype == v.dtype == torch.float32
                and all(t.dtype == torch.int64 and t.is_contiguous() for t in (pages, page_start, lens))):
            raise ValueError("paged decode kernel: float32, contiguous pool layers, matching head sizes and "
                             "contiguous int64 tables only")
        out = torch.empty((rows, heads, hd), dtype=torch.float32)
        threads = torch.get_num_threads()
        per = heads * (-(-max_len // 16) * 16)
        if self._scratch.numel() < threads * per:
            self._scratch = torch.empty(max(threads * per, 2 * self._scratch.numel()), dtype=torch.float32)
        if self._kv_of.numel() < heads:
            self._kv_of = torch.empty(heads, dtype=torch.int64)
        self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), pages.data_ptr(), page_start.data_ptr(),
                 lens.data_ptr(), out.data_ptr(), self._scratch.data_ptr(), per, self._kv_of.data_ptr(), rows,
                 heads, kvh, hd, page_size, scale, threads)
        return out


class RowCopier:
    """`pdtb_copy_rows_sum64`: copy payload rows into pool rows, returning the running sum64
    (`_nta`, for a source read once: see the C file)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = (lib.pdtb_copy_rows_sum64, lib.pdtb_copy_rows_sum64_nta)
        for fn in self._fns:
            fn.restype = ctypes.c_uint64
            fn.argtypes = [_P, _P, _P, _I, _I, ctypes.c_uint64]

    def __call__(self, dst_ptr: int, rows, src, row_bytes: int, acc: int, read_once: bool = False) -> int:
        """rows: int64 numpy array (the pool row of each payload row); src: a buffer of
        len(rows) * row_bytes bytes (a zmq frame's memoryview, a numpy array)."""
        src = np.frombuffer(src, dtype=np.uint8)
        if rows.dtype != np.int64 or not rows.flags.c_contiguous or len(src) != len(rows) * row_bytes \
                or row_bytes % 8:
            raise ValueError("copy_rows: int64 rows, whole rows of a multiple of 8 bytes")
        return self._fns[read_once](dst_ptr, rows.ctypes.data, src.ctypes.data, len(rows), row_bytes, acc)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The helpers' library, built if needed (once per process); None, logged once, where it
    cannot be built or loaded."""
    try:
        return ctypes.CDLL(str(build()))
    except (KernelBuildError, OSError) as e:
        log.warning("the C helpers are unavailable (torch attention and numpy copies instead): %s", e)
        return None


def load() -> DecodeKernel | None:
    """The decode attention kernel, or None (see `library`)."""
    lib = library()
    return None if lib is None else DecodeKernel(lib)


def row_copier() -> RowCopier | None:
    """The landing copy, or None (see `library`)."""
    lib = library()
    return None if lib is None else RowCopier(lib)


class RmsNorm:
    """`pdtb_add_rms_norm_f32`: `out = rms_norm(x) * w`, after `x += add` in place when `add`
    is given (see the C file). Float32, contiguous rows."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.pdtb_add_rms_norm_f32
        self._fn.restype = None
        self._fn.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None) -> torch.Tensor:
        dim = x.shape[-1]
        if not (x.dtype == w.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous() and w.numel() == dim
                and (add is None or (add.dtype == torch.float32 and add.is_contiguous() and add.shape == x.shape))):
            raise ValueError("rms_norm kernel: float32 contiguous rows, a weight of the row's size")
        out = torch.empty_like(x)
        self._fn(x.data_ptr(), None if add is None else add.data_ptr(), w.data_ptr(), out.data_ptr(),
                 x.numel() // dim, dim, eps)
        return out


def rms_norm() -> RmsNorm | None:
    """The RMSNorm helper, or None (see `library`)."""
    lib = library()
    return None if lib is None else RmsNorm(lib)
