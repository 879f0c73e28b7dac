"""Paged attention for stock transformers models.

The runner flattens every scheduled token of a step into one row (batch 1, T tokens) and
passes a `StepMetadata` to `model(...)`. Two hooks use it:

- `PagedKVCache.update` (called by each attention layer as `past_key_values.update`) writes
  the step's new K/V into the pool at `slot_mapping` and returns the K/V of every sequence,
  gathered page by page into a padded batch `[B, kv_heads, max_pages * page_size, head_dim]`.
- `paged_attention` (registered as attention implementation "pdtb_paged") pads the flat
  queries into `[B, heads, q_max, head_dim]`, runs SDPA with a per-sequence causal mask and
  scatters the result back to the flat row.

Slot arithmetic, for a token at position `pos` of a sequence with page table `pt`:

    page = pt[pos // page_size]       slot = page * page_size + pos % page_size

    pool.kv[layer, 0] viewed as [num_pages * page_size, kv_heads, head_dim] is indexed by slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_engine.read_cache import DecodeReadCache, ReadCachePlan

ATTN_NAME = "pdtb_paged"


@dataclass
class StepMetadata:
    """Per-step tensors, built once per step by the runner (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    block_tables: torch.Tensor  # [B, max_pages] page ids per sequence (padded with 0)
    q_gather: torch.Tensor  # [B, q_max] flat token index for each padded query slot
    q_scatter: torch.Tensor  # [T] padded index (b * q_max + j) of each flat token
    attn_mask: torch.Tensor  # [B, 1, groups * q_max, max_pages * page_size] additive (0 / -inf)
    flat_pages: torch.Tensor  # [B * max_pages] block_tables flattened, for index_select
    read_plan: ReadCachePlan | None = None  # pure-decode steps: use the read cache


class PagedKVCache:
    """Duck-typed `past_key_values` that reads and writes a PagePool's tensor."""

    def __init__(self, kv: torch.Tensor, meta: StepMetadata, read_cache: DecodeReadCache | None = None) -> None:
        self.kv = kv  # [layers, 2, pages, page_size, kv_heads, head_dim]
        self.meta = meta
        self.read_cache = read_cache

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        m = self.meta
        _, _, num_pages, page_size, kvh, hd = self.kv.shape
        b, p = m.block_tables.shape
        cache = self.kv[layer_idx]  # [2, pages, page_size, kv_heads, head_dim]
        new = torch.stack((key_states[0], value_states[0])).transpose(1, 2).to(cache.dtype)  # [2, T, kvh, hd]
        cache.view(2, num_pages * page_size, kvh, hd).index_copy_(1, m.slot_mapping, new)
        plan = m.read_plan
        if plan is not None:
            rc = self.read_cache.layer(layer_idx, b)  # [2, B, kvh, cap, hd]
            if plan.rebuild:
                pages = cache.index_select(1, m.flat_pages).view(2, b, p * page_size, kvh, hd)
                rc[:, :, :, : p * page_size].copy_(pages.transpose(2, 3))
            else:
                rc.permute(1, 3, 0, 2, 4).index_put_((plan.rows, plan.pos), new.transpose(0, 1))
            return rc[0, :, :, : plan.length], rc[1, :, :, : plan.length]
        gathered = cache.index_select(1, m.flat_pages).view(2, b, p * page_size, kvh, hd).transpose(2, 3)
        return gathered[0], gathered[1]  # each [B, kv_heads, L, head_dim]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only used when position_ids is None
        raise RuntimeError("PagedKVCache requires explicit position_ids")


def paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    pdtb_meta: StepMetadata | None = None, **kwargs):
    """Attention over gathered pages. `query` is [1, heads, T, head_dim]."""
    if pdtb_meta is None:
        raise RuntimeError("pdtb_paged attention called without step metadata")
    m = pdtb_meta
    b, q_max = m.q_gather.shape
    heads, hd = query.shape[1], query.shape[3]
    kvh = key.shape[1]
    groups = heads // kvh
    # GQA without copying K/V: the query heads that share a KV head are folded into the
    # query-length axis, [B, heads, q_max, hd] -> [B, kv_heads, groups * q_max, hd].
    q = query[0].transpose(0, 1)  # [T, heads, hd]
    q = q.unsqueeze(1) if q_max == 1 else q[m.q_gather]  # [B, q_max, heads, hd]; decode: T == B
    q = q.view(b, q_max, kvh, groups, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, groups * q_max, hd)
    k, v = key.to(q.dtype), value.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.attn_mask, scale=scaling)
    out = out.view(b, kvh, groups, q_max, hd).permute(0, 3, 1, 2, 4).reshape(b * q_max, heads, hd)
    if q_max > 1:
        out = out[m.q_scatter]
    return out.unsqueeze(0), None


def register() -> None:
    """Make "pdtb_paged" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
