"""The decode attention's two CPU paths (two matmuls for batches of rows with two or more
threads, SDPA otherwise) against SDPA on the same inputs, masks included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdtb.engine import paged_attention as pa


def _case(b: int, length: int, masked_tail: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kvh, groups, hd = 2, 2, 32
    cache = torch.randn(2, b, kvh, length + 16, hd, generator=g)  # read-cache-like: strided view
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]
    q = torch.randn(b, kvh * groups, hd, generator=g)
    mask = torch.zeros(b, 1, 1, length)
    for row in range(b):  # rows of different lengths, as in a real decode batch
        cut = length - (row * masked_tail) % max(1, length // 2)
        mask[row, :, :, cut:] = float("-inf")
    return q, k, v, mask


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _count_matmul(monkeypatch) -> list:
    calls = []
    real = pa._matmul_attention

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(pa, "_matmul_attention", counting)
    return calls


@pytest.mark.parametrize("b,length", [(1, 64), (4, 128), (32, 208), (3, 1500), (6, 700)])
def test_decode_attention_matches_sdpa(b, length, threads, monkeypatch):
    q, k, v, mask = _case(b, length, masked_tail=7)
    kvh, hd = k.shape[1], k.shape[3]
    want = F.scaled_dot_product_attention(q.reshape(b, kvh, -1, hd), k, v, attn_mask=mask, scale=0.2)
    calls = _count_matmul(monkeypatch)
    got = pa._decode_attention(q, k, v, mask, 0.2)
    assert got.shape == q.shape
    torch.testing.assert_close(got, want.reshape(q.shape), rtol=1e-5, atol=1e-5)
    # the matmul path ran for (32, 208) and (6, 700) with two threads, SDPA for the rest
    assert bool(calls) == (threads == 2 and (b, length) in {(32, 208), (6, 700)})


def test_matmul_decode_choice():
    assert pa.use_matmul_decode(32, 208, 2) and pa.use_matmul_decode(4, 256, 2)
    assert not pa.use_matmul_decode(32, 208, 1)  # one thread: SDPA
    assert not pa.use_matmul_decode(3, 1700, 2)  # few rows: SDPA
    assert not pa.use_matmul_decode(8, 100, 2)  # few keys in all: SDPA


def test_matmul_attention_default_scale_and_no_mask():
    q, k, v, _ = _case(2, 600, masked_tail=0)
    b, kvh, hd = q.shape[0], k.shape[1], k.shape[3]
    qq = q.reshape(b, kvh, -1, hd)
    torch.testing.assert_close(pa._matmul_attention(qq, k, v, None, hd ** -0.5),
                               F.scaled_dot_product_attention(qq, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [(2, 5), (5, 3)])
def test_groups_of_a_mixed_step_are_runs_of_flat_tokens(sizes, threads, monkeypatch):
    """A step of two decode groups (length buckets, spans of flat rows) and a prefill row of 3
    tokens after them: every flat token gets its own row's attention, against SDPA run per
    group on the same inputs (GQA by repeating K/V), on both sides of the matmul threshold."""
    (b1, b2), kvh, groups, hd, q_len = sizes, 2, 2, 32, 3
    heads = kvh * groups
    qa, ka, va, ma = _case(b1, 100, masked_tail=5, seed=1)
    qb, kb, vb, mb = _case(b2, 600, masked_tail=9, seed=2)
    gen = torch.Generator().manual_seed(3)
    length = 48
    kp, vp = (torch.randn(1, kvh, length, hd, generator=gen) for _ in range(2))
    qp = torch.randn(q_len, heads, hd, generator=gen)
    causal = torch.full((q_len, length), float("-inf"))
    for j in range(q_len):
        causal[j, :40 + j + 1] = 0  # the chunk's queries at positions 40..42
    t0 = b1 + b2
    no_pages = torch.zeros(0, dtype=torch.long)
    prefill = pa.AttnGroup(no_pages, 0, causal[None, None].repeat(1, 1, groups, 1),
                           q_gather=torch.arange(t0, t0 + q_len)[None], pad_index=torch.arange(q_len))
    spans = [pa.AttnGroup(no_pages, 0, m, span=(a, a + n)) for a, n, m in ((0, b1, ma), (b1, b2, mb))]
    meta = pa.StepMetadata(torch.zeros(0, dtype=torch.long), [*spans, prefill])
    q_flat = torch.cat([qa, qb, qp])  # [T, heads, hd]
    calls = _count_matmul(monkeypatch)
    got = pa.attend(meta, q_flat, [(ka, va), (kb, vb), (kp, vp)], 0.2)[None]
    assert bool(calls) == (threads == 2 and sizes == (2, 5))  # 5 rows x 600 keys: the matmul path
    want = [F.scaled_dot_product_attention(q.reshape(len(q), kvh, groups, hd), k, v, attn_mask=m, scale=0.2)
            .reshape(q.shape) for q, k, v, m in ((qa, ka, va, ma), (qb, kb, vb, mb))]
    rep = lambda x: x.repeat_interleave(groups, dim=1)  # noqa: E731
    want.append(F.scaled_dot_product_attention(qp.transpose(0, 1)[None], rep(kp), rep(vp), attn_mask=causal,
                                               scale=0.2)[0].transpose(0, 1))
    torch.testing.assert_close(got[0], torch.cat(want), rtol=1e-5, atol=1e-5)
