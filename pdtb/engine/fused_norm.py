"""RMSNorm as one Triton kernel, swapped into a stock transformers model on a GPU.

A decode step of a Llama-shaped model runs two RMSNorms per layer, each seven or eight
elementwise kernels in transformers (cast to float32, square, mean, add, rsqrt, multiply,
cast back, weight): over 500 launches a step for a 32-layer model, each a few microseconds
even when replayed from a CUDA graph, on tensors of a few hundred kilobytes. One program per
row does the same arithmetic in one pass:

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)

with the product taken in float32 and rounded once to the result dtype, as torch does for a
16-bit product, so the outputs differ from the module's only by the order of the float32
sum inside the mean.

This is the one place the engine reaches into modeling code: `fuse_norms` replaces a
submodule by assignment (a documented `torch.nn.Module` operation) and identifies the
modules by what transformers' RMSNorm classes hold (a class named `*RMSNorm`, a 1-D
`weight`, a float `variance_epsilon`). Each candidate is checked at swap time: on a probe
input the fused output must match the module's own, else the module is kept as it is (a
variant such as `(1 + weight)` scaling). Checked on transformers 5.17 (Llama, Qwen2/Qwen3,
Mistral) with Triton 3.6; tests/engine/test_fused_norm.py runs the kernel in Triton's interpreter.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None

if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x**2, -1) + eps))` over the last axis of `x` (contiguous in its
    last axis), the normalised value rounded to x's dtype before the weight, as transformers'
    RMSNorm; the result has torch's promoted dtype of weight and x."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, float(eps),
                                         BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(x.shape)


class FusedRMSNorm(nn.Module):
    """The fused kernel over `inner`'s weight and epsilon (the parameter is shared, not copied).
    An input the kernel does not take (not on a GPU, not contiguous in its last axis, another
    dtype) goes to `inner` as it is."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.eps = float(inner.variance_epsilon)
        self.enabled = True  # False: `inner` runs (set_fused; the benches' baseline)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or not _takes(x, self.inner.weight):
            return self.inner(x)
        return rms_norm(x, self.inner.weight, self.eps)


def _takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    return _runs_on(x) and x.dtype in _DTYPES and x.stride(-1) == 1 and x.device == w.device and w.is_contiguous()


def _runs_on(t: torch.Tensor) -> bool:
    """The kernel runs where `t` lies: a GPU, or anywhere in Triton's interpreter (tests)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _candidate(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return type(module).__name__.endswith("RMSNorm") and isinstance(w, torch.Tensor) and w.dim() == 1 \
        and isinstance(getattr(module, "variance_epsilon", None), float)


def _matches(module: nn.Module, fused: FusedRMSNorm) -> bool:
    """The fused output equals the module's own on a probe of three rows (within the rounding of
    one product in the weight's dtype)."""
    w = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(3, w.shape[0], generator=gen) * 3).to(device=w.device, dtype=w.dtype)
    with torch.inference_mode():
        want, got = module(x), fused(x)
    if want.shape != got.shape or want.dtype != got.dtype:
        return False
    tol = 1e-5 if w.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))


def fuse_norms(model: nn.Module) -> int:
    """Replace every RMSNorm of `model` the fused kernel reproduces by a `FusedRMSNorm`; return
    how many were replaced (0 without Triton or off a GPU)."""
    if triton is None:
        return 0
    swaps = []
    wrapped = {id(m.inner) for m in model.modules() if isinstance(m, FusedRMSNorm)}
    for name, module in model.named_modules():
        if id(module) in wrapped or not _candidate(module) or not _runs_on(module.weight):
            continue
        fused = FusedRMSNorm(module)
        if not _matches(module, fused):
            log.info("%s (%s) kept as it is: the fused RMSNorm does not reproduce it", name, type(module).__name__)
            continue
        swaps.append((name, fused))
    for name, fused in swaps:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, fused)
    return len(swaps)


def set_fused(model: nn.Module, on: bool) -> None:
    """Run the swapped norms fused (`on`) or as the modules they wrap: the same model timed both
    ways (a CUDA graph keeps the way it was captured in)."""
    for m in model.modules():
        if isinstance(m, FusedRMSNorm):
            m.enabled = on
