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

ATTN_NAME = "pdtb_paged"


@dataclass
class StepMetadata:
    """Per-step tensors, built once per step by the runner (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    block_tables: torch.Tensor  # [B, max_pages] page ids per sequence (padded with 0)
    q_gather: torch.Tensor  # [B, q_max] flat token index for each padded query slot
    q_scatter: torch.Tensor  # [T] padded index (b * q_max + j) of each flat token
    attn_mask: torch.Tensor  # [B, 1, q_max, max_pages * page_size] True = may attend


class PagedKVCache:
    """Duck-typed `past_key_values` that reads and writes a PagePool's tensor."""

    def __init__(self, kv: torch.Tensor, meta: StepMetadata) -> None:
        self.kv = kv  # [layers, 2, pages, page_size, kv_heads, head_dim]
        self.meta = meta

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        m = self.meta
        _, _, num_pages, page_size, kvh, hd = self.kv.shape
        b, p = m.block_tables.shape
        out = []
        for which, new in ((0, key_states), (1, value_states)):
            cache = self.kv[layer_idx, which]
            cache.view(num_pages * page_size, kvh, hd)[m.slot_mapping] = new[0].transpose(0, 1).to(cache.dtype)
            gathered = cache[m.block_tables].view(b, p * page_size, kvh, hd)
            out.append(gathered.transpose(1, 2))
        return out[0], out[1]

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
    q = query[0].transpose(0, 1)[m.q_gather].transpose(1, 2)  # [B, heads, q_max, hd]
    k, v = key.to(q.dtype), value.to(q.dtype)
    groups = heads // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m.attn_mask, scale=scaling)
    out = out.transpose(1, 2).reshape(b * q_max, heads, hd)[m.q_scatter]
    return out.unsqueeze(0), None


def register() -> None:
    """Make "pdtb_paged" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
