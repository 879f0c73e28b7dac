"""Paged decode attention on a GPU: Triton kernels that read each row's pages where they lie.

The GPU twin of csrc/paged_decode.c, with the same call (`DecodeKernel.__call__`): the rows'
page tables back to back (`pages`, `page_start`), each row's key count (`lens`), one layer's
pool `[pages, page_size, kv_heads, head_dim]` for K and for V. Nothing is gathered into a
padded batch and no mask is built.

Split-K ("flash decoding"): a row's keys are cut into `splits` equal spans, one program per
(row, kv head, span). The program holds the kv head's group of query heads as one tile
(`[G_PAD, head_dim]`, GQA without copying K/V), walks its span `BLOCK_N` keys at a time
(token t of the row lies at slot `pages[page_start + t // page_size] * page_size + t %
page_size`), and keeps an online softmax in float32. A second kernel merges the spans by
their log-sum-exp. Each row sizes its spans from its own length, so the grid depends only on
the number of rows and `splits`: a CUDA graph captured once serves every length.

`store` writes a step's new K/V into the pool at their slots; a slot below zero is skipped
(the padding rows of a CUDA graph's batch write nothing).

float32 pools use IEEE products (`input_precision="ieee"`), so a float32 engine matches
transformers' float32 attention; 16-bit pools use the tensor cores. The kernels run in
Triton's interpreter on the CPU (TRITON_INTERPRET=1), which is how tests/engine/test_triton_decode.py
checks them against a float64 reference on machines without a GPU. Checked on Triton 3.6.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None

BLOCK_N = 64  # keys per inner step of a span
MAX_SPLITS = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def choose_splits(rows: int, kv_heads: int, max_len: int, programs: int, min_span: int = 512) -> int:
    """Spans per row: enough (row, kv head, span) programs to reach `programs` (a multiple of
    the multiprocessors), no span shorter than `min_span` keys at `max_len`, a power of two
    at most MAX_SPLITS. Depends on host integers only, so it is fixed for a captured graph."""
    want = -(-programs // max(1, rows * kv_heads))
    most = max(1, max_len // min_span)
    return min(MAX_SPLITS, _next_pow2(max(1, min(want, most))))


if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, start_ptr, lens_ptr, o_ptr, lse_ptr, out_ptr,
                      stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_or, stride_oh,
                      splits, scale, PS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr,
                      HD_PAD: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
                      HEAD_MAJOR: tl.constexpr, MIN_SPAN):
        if HEAD_MAJOR:  # a row's kv heads run side by side: they read the same token records
            kh = tl.program_id(0)
            row = tl.program_id(1)
            heads = tl.num_programs(0) * G
        else:
            row = tl.program_id(0)
            kh = tl.program_id(1)
            heads = tl.num_programs(1) * G
        s = tl.program_id(2)
        length = tl.load(lens_ptr + row)
        first = tl.load(start_ptr + row)
        span = tl.maximum(tl.cdiv(tl.cdiv(length, splits), BLOCK) * BLOCK, MIN_SPAN)
        lo = s * span
        hi = tl.minimum(lo + span, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD_PAD)
        gm = g < G
        dm = d < HD
        q = tl.load(q_ptr + row * stride_qr + (kh * G + g)[:, None] * stride_qh + d[None, :],
                    mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HD_PAD], tl.float32)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            nm = n < hi
            page = tl.load(pages_ptr + first + n // PS, mask=nm, other=0).to(tl.int64)
            slot = page * PS + n % PS
            kv_mask = nm[:, None] & dm[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            sc = tl.where(nm[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if DIRECT:  # one span per row: this is the row's attention, no merge
            tl.store(out_ptr + row * stride_or + (kh * G + g)[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])
        else:
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
            base = (row * heads + kh * G + g) * splits + s  # [rows, heads, splits] layout
            tl.store(lse_ptr + base, lse, mask=gm)
            tl.store(o_ptr + base[:, None] * HD + d[None, :], out, mask=gm[:, None] & dm[None, :])

    @triton.jit
    def _merge_kernel(o_ptr, lse_ptr, out_ptr, stride_or, stride_oh, splits,
                      HD: tl.constexpr, HD_PAD: tl.constexpr, S_PAD: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, HD_PAD)
        sm = s < splits
        base = (row * heads + h) * splits
        lse = tl.load(lse_ptr + base + s, mask=sm, other=float("-inf"))
        top = tl.max(lse, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top)
        den = tl.sum(w, 0)
        part = tl.load(o_ptr + (base + s)[:, None] * HD + d[None, :], mask=sm[:, None] & (d < HD)[None, :], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + row * stride_or + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HD)

    @triton.jit
    def _store_kernel(k_new, v_new, slots_ptr, k_ptr, v_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_cs, stride_ch, HD: tl.constexpr, HD_PAD: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        d = tl.arange(0, HD_PAD)
        m = (d < HD) & (slot >= 0)
        k = tl.load(k_new + t * stride_kt + h * stride_kh + d, mask=m)
        v = tl.load(v_new + t * stride_vt + h * stride_vh + d, mask=m)
        at = slot * stride_cs + h * stride_ch + d
        tl.store(k_ptr + at, k.to(k_ptr.dtype.element_ty), mask=m)
        tl.store(v_ptr + at, v.to(v_ptr.dtype.element_ty), mask=m)


@dataclass(frozen=True)
class KernelConfig:
    """Launch settings of the span kernel (`pdtb bench decode-kernel` measures them)."""

    # Defaults: the best of `pdtb bench decode-kernel` (each call a replayed CUDA graph) for one
    # Llama-3-8B layer (bfloat16, 1,024 keys a row) at 64 and 128 rows on an H200, 3,900 and
    # 4,050 GB/s of KV read with one span a row. Spans of 256 keys at least: as fast there (one
    # span either way) and 1.3-1.4x spans of 512 at 1 and 8 rows, where more spans fill the GPU.
    block_n: int = BLOCK_N  # keys per inner step
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2  # spans are added until (rows x kv heads x spans) reaches this x SMs
    min_span: int = 256  # keys a span covers at least (a shorter row uses fewer spans)
    head_major: int = 0  # 1: programs ordered kv head first, so a row's heads run side by side

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """`block_n=64,num_warps=8,...` (any subset of the fields)."""
        kw = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            if key not in cls.__dataclass_fields__ or not value.isdigit() or (int(value) < 1 and key != "head_major"):
                raise ValueError(f"decode kernel config: {item!r} is not one of "
                                 f"{', '.join(cls.__dataclass_fields__)} = a positive integer")
            kw[key] = int(value)
        cfg = cls(**kw)
        if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1) or cfg.min_span % cfg.block_n:
            raise ValueError("decode kernel config: block_n is a power of two, at least 16, and divides min_span")
        return cfg


class DecodeKernel:
    """Decode attention over the paged pool (the C kernel's call, see cpu_kernel.DecodeKernel)."""

    name = "triton"

    def __init__(self, device: torch.device, config: KernelConfig | None = None) -> None:
        self.config = config or KernelConfig()
        # multiprocessors (Triton's interpreter, in tests: a small number)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.programs = self.config.programs_per_sm * self.sms
        self.forced_splits: int | None = None  # a fixed span count, spans as short as one block (the kernel bench)

    def configure(self, config: KernelConfig) -> None:
        """New launch settings (before any CUDA graph is captured with this kernel)."""
        self.config = config
        self.programs = config.programs_per_sm * self.sms

    def splits(self, rows: int, kv_heads: int, max_len: int) -> int:
        if self.forced_splits:
            return self.forced_splits
        return choose_splits(rows, kv_heads, max_len, self.programs, self.config.min_span)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor,
                 page_start: torch.Tensor, lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
        """q [rows, heads, head_dim] (head_dim contiguous); k, v: one layer's pool [pages,
        page_size, kv_heads, head_dim]; pages, page_start, lens: integer tensors on the pool's
        device. Returns [rows, heads, head_dim] in q's dtype."""
        rows, heads, hd = q.shape
        _, ps, kvh, hd_k = k.shape
        if hd_k != hd or heads % kvh or q.stride(2) != 1 or k.stride(3) != 1 or v.stride(3) != 1 \
                or k.stride(0) != ps * k.stride(1) or v.stride(0) != ps * v.stride(1):
            raise ValueError("triton paged decode: matching head sizes, pool pages laid out "
                             "[pages, page_size, kv_heads, head_dim] with head_dim contiguous")
        if q.dtype != k.dtype:
            q = q.to(k.dtype)
        out = torch.empty((rows, heads, hd), dtype=q.dtype, device=q.device)
        if rows == 0:
            return out
        splits = self.splits(rows, kvh, max_len)
        direct = splits == 1
        part, lse = (out, out) if direct else self._buffers(rows, heads, splits, hd, q.device)
        group = heads // kvh
        hd_pad = max(16, _next_pow2(hd))
        c = self.config
        min_span = c.block_n if self.forced_splits else c.min_span  # a forced count is taken as it is
        _split_kernel[(kvh, rows, splits) if c.head_major else (rows, kvh, splits)](
            q, k, v, pages, page_start, lens, part, lse, out,
            q.stride(0), q.stride(1), k.stride(1), k.stride(2), v.stride(1), v.stride(2), out.stride(0),
            out.stride(1), splits, float(scale), PS=ps, G=group, G_PAD=max(16, _next_pow2(group)), HD=hd,
            HD_PAD=hd_pad, BLOCK=c.block_n, IEEE=k.dtype == torch.float32, DIRECT=direct,
            HEAD_MAJOR=bool(c.head_major), MIN_SPAN=min_span, num_warps=c.num_warps, num_stages=c.num_stages)
        if not direct:
            _merge_kernel[(rows, heads)](part, lse, out, out.stride(0), out.stride(1), splits,
                                         HD=hd, HD_PAD=hd_pad, S_PAD=max(2, _next_pow2(splits)))
        return out

    def _buffers(self, rows: int, heads: int, splits: int, hd: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 partial outputs and log-sum-exps of the spans. Fresh tensors each call: a CUDA
        graph keeps the ones its capture allocated (in its private pool)."""
        return (torch.empty((rows, heads, splits, hd), dtype=torch.float32, device=device),
                torch.empty((rows, heads, splits), dtype=torch.float32, device=device))

    def store(self, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new K/V (`[1, kv_heads, T, head_dim]`) into one layer's pool `cache` ([2, pages,
        page_size, kv_heads, head_dim]) at `slots` [T]; a negative slot writes nothing."""
        t = slots.shape[0]
        if t == 0:
            return
        _, _, ps, kvh, hd = cache.shape
        kc, vc = cache[0], cache[1]
        if key.stride(3) != 1 or value.stride(3) != 1 or kc.stride(3) != 1 or kc.stride(0) != ps * kc.stride(1):
            raise ValueError("triton KV store: head_dim contiguous, pool pages laid out [pages, page_size, kv_heads, head_dim]")
        _store_kernel[(t, kvh)](key, value, slots, kc, vc, key.stride(2), key.stride(1), value.stride(2),
                                value.stride(1), kc.stride(1), kc.stride(2), HD=hd, HD_PAD=_next_pow2(hd))


@functools.cache
def load(device: str) -> DecodeKernel | None:
    """The Triton decode kernel for a CUDA `device`, or None (no Triton in this torch build,
    logged once): the runner then gathers pages for torch attention."""
    if triton is None:
        log.info("triton is not installed: GPU decode attention gathers pages (torch path)")
        return None
    return DecodeKernel(torch.device(device))
