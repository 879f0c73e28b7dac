"""The fused RMSNorm kernel (pdtb/engine/fused_norm.py) against transformers' RMSNorm modules.

On a GPU it runs compiled; elsewhere in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py before Triton is first imported). Skipped where Triton is not installed.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import tests.engine.test_triton_decode  # noqa: E402,F401  (its import adapts Triton's interpreter to numpy 2.4)
from pdtb.engine import fused_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def llama_norm(size: int, dtype, seed: int = 0, eps: float = 1e-5):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(size, eps=eps).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 0.5 + 1)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("size", [128, 100, 4096])
def test_kernel_matches_the_module(dtype, size):
    """Rows of the kernel's output equal LlamaRMSNorm's: float32 to rounding, 16-bit within one
    rounding of the result (the float32 sum inside the mean runs in another order)."""
    norm = llama_norm(size, dtype, seed=size)
    x = (torch.randn(1, 5, size, generator=torch.Generator().manual_seed(1)) * 4).to(DEVICE, dtype)
    with torch.inference_mode():
        want = norm(x)
        got = fused_norm.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        ulp = torch.finfo(dtype).eps
        assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-3).all()


def test_empty_input_and_a_strided_one():
    """No rows: an empty result. A view whose rows are not adjacent (a column slice of a wider
    tensor) is read with its row stride."""
    norm = llama_norm(64, torch.float32)
    with torch.inference_mode():
        assert fused_norm.rms_norm(torch.empty(0, 64, device=DEVICE), norm.weight, 1e-5).shape == (0, 64)
        wide = torch.randn(6, 80, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        torch.testing.assert_close(fused_norm.rms_norm(wide[:, :64], norm.weight, 1e-5), norm(wide[:, :64]),
                                   rtol=1e-5, atol=1e-5)


class ShiftedRMSNorm(torch.nn.Module):
    """Named like transformers' norms and holding the same attributes, but scaling by
    (1 + weight): the swap's probe must see the difference and keep it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * h.to(x.dtype)


def test_fuse_norms_swaps_only_what_it_reproduces(llama_dir):
    """Every LlamaRMSNorm of the tiny model (two a layer and the final one) is swapped, the
    parameters shared, not copied; logits equal the unfused model's; a second call swaps
    nothing; a look-alike norm with another formula is kept."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).to(DEVICE).eval()
    model.model.layers[0].extra_norm = ShiftedRMSNorm(model.config.hidden_size).to(DEVICE)
    ids = torch.tensor([[5, 9, 17, 3, 44, 8]], device=DEVICE)
    with torch.inference_mode():
        want = model(ids).logits
    params = {p.data_ptr() for p in model.parameters()}
    n = fused_norm.fuse_norms(model)
    assert n == 2 * model.config.num_hidden_layers + 1
    assert isinstance(model.model.norm, fused_norm.FusedRMSNorm)
    assert isinstance(model.model.layers[0].extra_norm, ShiftedRMSNorm)
    assert {p.data_ptr() for p in model.parameters()} == params
    with torch.inference_mode():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert fused_norm.fuse_norms(model) == 0
    fused_norm.set_fused(model, False)  # the wrapped modules run: the same logits
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-6, atol=1e-6)
