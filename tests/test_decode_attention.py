"""The decode attention's two CPU paths (two matmuls for batches of rows with two or more
threads, SDPA otherwise) against SDPA on the same inputs, masks included."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model_engine import paged_attention as pa


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


@pytest.mark.parametrize("b,length", [(2, 100), (5, 600)])
def test_group_attention_of_decode_rows_in_slot_order(b, length, threads, monkeypatch):
    """A decode group whose rows are not in the step's flat order (read-cache slots): each
    flat token gets its own row's attention, on both sides of the size threshold."""
    q, k, v, mask = _case(b, length, masked_tail=5, seed=1)
    kvh, hd = k.shape[1], k.shape[3]
    flat = torch.randn(b + 2, q.shape[1], hd)  # two more tokens in the step (another group's)
    where = torch.randperm(b + 2)[:b]  # flat position of group row r
    flat[where] = q
    g = pa.AttnGroup(where[:, None], torch.arange(b), where, where[:0], 0, mask)
    calls = _count_matmul(monkeypatch)
    got = pa._group_attention(flat, k, v, g, 0.2)  # group order: row r at index r
    assert bool(calls) == (threads == 2 and b == 5)  # the matmul path: two threads, 5 rows
    want = F.scaled_dot_product_attention(q.reshape(b, kvh, -1, hd), k, v, attn_mask=mask, scale=0.2)
    torch.testing.assert_close(got, want.reshape(q.shape), rtol=1e-5, atol=1e-5)
