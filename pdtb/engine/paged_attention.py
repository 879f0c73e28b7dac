"""Paged attention for stock transformers models.

The runner flattens every scheduled token of a step into one row (batch 1, T tokens) and
passes a `StepMetadata` to `model(...)`. The step's sequences are split into attention groups
by query length (decode rows, one query each; prefill rows, many), so a 512-token prefill
chunk does not pad every decode row of the same step to 512 queries.

The model runs with `use_cache=False` and no cache object: transformers' only contact with the
pool is the attention function registered through its public `AttentionInterface` (as
"pdtb_paged"), which receives each layer's new K/V after RoPE and the step's metadata through
the forward's `**kwargs` (`pdtb_meta`). Per layer it does two things:

- `read_pages` writes the step's new K/V into the pool at `slot_mapping` (through the
  kernel's `store` where it has one: the Triton kernel on a GPU), then gathers each
  group's pages into a padded batch `[B_g, kv_heads, max_pages_g * page_size, head_dim]` (or,
  for a steady decode batch, reads the decode read cache).
- `attend` runs each group:
  where the engine has a paged decode kernel (`StepMetadata.kernel`: csrc/paged_decode.c on
  a float32 CPU pool, triton_decode.py on a GPU), the decode rows are one group that the
  kernel runs straight over the pool's pages, each row its own keys (nothing gathered, padded
  or masked); otherwise
  a decode group is a slice of the flat rows (one query each; two matmuls or SDPA), a prefill
  group pads its queries into `[B_g, heads, q_max_g, head_dim]` and runs SDPA with a
  per-sequence causal mask, and a prompt's first chunk alone runs SDPA with `is_causal`
  (the runner groups prefill rows of like sizes: runner.prefill_groups). The runner orders the flat tokens so that the groups are
  consecutive runs of them (decode buckets first, then prefill rows), so the outputs are
  simply concatenated.

Slot arithmetic, for a token at position `pos` of a sequence with page table `pt`:

    page = pt[pos // page_size]       slot = page * page_size + pos % page_size

    pool.kv[layer, k_or_v] viewed as [num_pages * page_size, kv_heads, head_dim] is indexed by slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdtb.engine.read_cache import ReadCachePlan

ATTN_NAME = "pdtb_paged"


@dataclass
class AttnGroup:
    """Sequences of one step that share an attention call: decode rows (`span`: they are the
    flat rows [start, end), one query each) or prefill rows (`q_gather`, `pad_index`: their
    queries padded to the longest chunk)."""

    flat_pages: torch.Tensor | None  # [B_g * max_pages] page ids, row-major, padded with page 0 (None: kernel)
    max_pages: int  # pages per row in flat_pages
    attn_mask: torch.Tensor | None  # [B_g, 1, groups * q_max, L] additive (0 / -inf); None: kernel
    read_plan: ReadCachePlan | None = None  # decode rows: use the read cache
    span: tuple[int, int] | None = None  # decode group: its flat rows [start, end)
    q_gather: torch.Tensor | None = None  # prefill: [B_g, q_max] flat token index of each padded query slot
    pad_index: torch.Tensor | None = None  # prefill: [n_g] padded slot (b * q_max + j) of each of its tokens
    # a prompt's first chunk alone (flat rows `span`): its tokens attend causally to its first
    # `causal` keys, SDPA's is_causal with no mask; 0: not such a group
    causal: int = 0
    # decode rows read in place by the C kernel (StepMetadata.kernel), no gather, no padding:
    pages: torch.Tensor | None = None  # the rows' page tables back to back
    page_start: torch.Tensor | None = None  # [B_g] offset of each row's table in `pages`
    lens: torch.Tensor | None = None  # [B_g] keys of each row (its new token's position + 1)
    max_len: int = 0  # max(lens)

    @property
    def num_rows(self) -> int:
        if self.causal:
            return 1
        return self.span[1] - self.span[0] if self.span is not None else self.q_gather.shape[0]


@dataclass
class StepMetadata:
    """Per-step tensors, built once per step by the runner (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    groups: list[AttnGroup]
    kv: torch.Tensor | None = None  # the pool [layers, 2, pages, page_size, kv_heads, head_dim]
    kernel: object = None  # cpu_kernel.DecodeKernel for the groups that carry `lens`
    layers_run: list[int] = field(default_factory=list)  # layer_idx of each attention call, in order


def read_pages(m: StepMetadata, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> list:
    """Write the step's new K/V (`[1, kv_heads, T, head_dim]`, RoPE applied) into layer `layer`
    of the pool at `slot_mapping`, then return what each group attends over, in group order:
    the layer's pool pages themselves for the C kernel, the read cache's rows, or the group's
    pages gathered into a padded batch `[B_g, kv_heads, max_pages_g * page_size, head_dim]`."""
    _, _, num_pages, page_size, kvh, hd = m.kv.shape
    cache = m.kv[layer]  # [2, pages, page_size, kv_heads, head_dim]
    store = getattr(m.kernel, "store", None)
    if store is not None:  # the GPU kernel's own store (a negative slot writes nothing)
        store(cache, key_states, value_states, m.slot_mapping)
        new = None
    else:
        new = torch.stack((key_states[0], value_states[0])).transpose(1, 2)  # [2, T, kvh, hd]
        if new.dtype != cache.dtype:
            new = new.to(cache.dtype)
        cache.view(2, num_pages * page_size, kvh, hd).index_copy_(1, m.slot_mapping, new)
    out = []
    for g in m.groups:
        b, plan = g.num_rows, g.read_plan
        if g.lens is not None:  # the kernel reads this layer's pool, the new tokens included
            out.append((cache[0], cache[1]))  # each [pages, page_size, kv_heads, head_dim]
        elif plan is not None:
            rc, rows_view, k, v = plan.cache.views(layer, b, plan.length)  # rc [2, B, kvh, cap, hd]
            if plan.rebuild:
                rc[:, :, :, : g.max_pages * page_size].copy_(_gather_pages(cache, g.flat_pages, b, g.max_pages))
            else:
                if plan.move_src is not None:  # rows kept from the last step, all moved at once
                    whole = plan.cache.layer(layer)  # old rows may lie past row B
                    whole.index_copy_(1, plan.move_dst, whole.index_select(1, plan.move_src))
                if plan.fresh is not None:  # rows the cache did not hold: gather their pages
                    _gather_rows(cache, rc, g, plan.fresh, page_size)
                mine = new[:, g.span[0]:g.span[1]]  # [2, B_g, kvh, hd], a view
                rows_view.index_put_((plan.rows, plan.pos), mine.transpose(0, 1))
            out.append((k, v))
        else:
            kv = _gather_pages(cache, g.flat_pages, b, g.max_pages)
            out.append((kv[0], kv[1]))  # each [B_g, kv_heads, L, head_dim]
    return out


def _gather_pages(cache, flat_pages: torch.Tensor, rows: int, max_pages: int) -> torch.Tensor:
    """The pages of `rows` rows (`flat_pages`: `max_pages` page ids per row, row-major) of one
    layer's cache [2, pages, page_size, kvh, hd], as [2, rows, kvh, max_pages * page_size, hd]."""
    _, _, page_size, kvh, hd = cache.shape
    got = cache.index_select(1, flat_pages).view(2, rows, max_pages * page_size, kvh, hd)
    return got.transpose(2, 3)


def _gather_rows(cache, rc, g: AttnGroup, rows: torch.Tensor, page_size: int) -> None:
    """Copy the pages of the group's rows `rows` into those rows of the read cache `rc`."""
    pages = g.flat_pages.view(-1, g.max_pages).index_select(0, rows).reshape(-1)
    rc[:, :, :, :g.max_pages * page_size].index_copy_(1, rows, _gather_pages(cache, pages, rows.numel(), g.max_pages))


def _group_attention(q_flat, k, v, g: AttnGroup, scaling) -> torch.Tensor:
    """Prefill rows (queries padded to the group's longest chunk): q_flat [T, heads, hd] ->
    this group's outputs [n_g, heads, hd] in group token order."""
    b, q_max = g.q_gather.shape
    heads, hd = q_flat.shape[1], q_flat.shape[2]
    kvh = k.shape[1]
    groups = heads // kvh
    # GQA without copying K/V: the query heads that share a KV head are folded into the
    # query-length axis, [B, heads, q_max, hd] -> [B, kv_heads, groups * q_max, hd].
    q = q_flat[g.q_gather]  # [B, q_max, heads, hd]
    q = q.view(b, q_max, kvh, groups, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, groups * q_max, hd)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=g.attn_mask, scale=scaling)
    out = out.view(b, kvh, groups, q_max, hd).permute(0, 3, 1, 2, 4).reshape(b * q_max, heads, hd)
    return out[g.pad_index]


def _causal_attention(q_flat, k, v, n: int, scaling) -> torch.Tensor:
    """A first chunk of `n` tokens (positions 0..n-1) over its own keys: q_flat [n, heads, hd],
    k/v [1, kv_heads, >= n, hd] -> [n, heads, hd]."""
    q = q_flat.transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
    k, v = k[:, :, :n], v[:, :, :n]
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def _kernel_attention(kernel, q_flat, k_pool, v_pool, g: AttnGroup, scaling) -> torch.Tensor:
    """Decode rows [span) through the C kernel, straight from the pool's pages."""
    q = q_flat[g.span[0]:g.span[1]]
    if q.dtype != k_pool.dtype:
        q = q.to(k_pool.dtype)
    return kernel(q, k_pool, v_pool, g.pages, g.page_start, g.lens, g.max_len,
                  scaling if scaling is not None else q.shape[-1] ** -0.5)


def _decode_attention(q_flat, k, v, mask, scaling) -> torch.Tensor:
    """One query per row, rows in flat order: the GQA fold is a view, no gather or permute.
    q_flat [B, heads, hd] -> [B, heads, hd]."""
    b, heads, hd = q_flat.shape
    kvh = k.shape[1]
    q = q_flat.reshape(b, kvh, heads // kvh, hd)  # head h reads kv head h // groups
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    if not q.is_cuda and use_matmul_decode(b, k.shape[2], torch.get_num_threads()):
        out = _matmul_attention(q, k, v, mask, scaling if scaling is not None else hd ** -0.5)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, hd)


# On the CPU, SDPA's flash kernel tiles for long query blocks; with one query per row (times
# the GQA fold) and two threads it spends much of its time on set-up and splitting work. Two
# batched matmuls and a softmax are faster there for a batch of rows with a few thousand keys
# in all: with 2 threads, batch 32 x 208 keys 307 against 457 us per layer, 16 x 300 keys 242
# against 289 us. With a single thread SDPA is as fast or faster at every size measured (32 x
# 208: 319 against 369 us), and with one or two rows it is faster at any thread count (1 x
# 1,700 keys: 77 against 108 us), since then there is little to batch (tests/
# test_decode_attention.py; figures from one 2-core machine).
MATMUL_DECODE_MIN_KEYS = 1024
MATMUL_DECODE_MIN_ROWS = 4


def use_matmul_decode(rows: int, keys: int, threads: int) -> bool:
    """Whether a CPU decode group of `rows` rows attending `keys` keys each uses the two-matmul
    attention instead of SDPA (see above)."""
    return threads > 1 and rows >= MATMUL_DECODE_MIN_ROWS and rows * keys >= MATMUL_DECODE_MIN_KEYS


def _matmul_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for [B, kvh, g, hd] queries over [B, kvh, L, hd] keys."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores.add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def paged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    pdtb_meta: StepMetadata | None = None, **kwargs):
    """The registered attention function: `query` [1, heads, T, head_dim], `key`/`value`
    [1, kv_heads, T, head_dim] (the step's new tokens, RoPE applied). Writes K/V into the pool
    and attends over each row's pages; `attention_mask` is unused (transformers builds none
    for an attention name it has no mask function for; the groups carry their own)."""
    if pdtb_meta is None:
        raise RuntimeError("pdtb_paged attention called without step metadata (pdtb_meta)")
    layer = module.layer_idx
    pdtb_meta.layers_run.append(layer)
    kv = read_pages(pdtb_meta, layer, key, value)
    return attend(pdtb_meta, query[0].transpose(0, 1), kv, scaling).unsqueeze(0), None


def attend(m: StepMetadata, q_flat: torch.Tensor, kv: list, scaling) -> torch.Tensor:
    """Each group's attention over its (k, v) from `read_pages`: q_flat [T, heads, hd] ->
    [T, heads, hd]. Groups are contiguous runs of flat tokens, in flat order (decode spans,
    then prefill rows), so their outputs are concatenated."""
    outs = [_kernel_attention(m.kernel, q_flat, k, v, g, scaling) if g.lens is not None
            else _causal_attention(q_flat[g.span[0]:g.span[1]], k, v, g.causal, scaling) if g.causal
            else _decode_attention(q_flat[g.span[0]:g.span[1]], k, v, g.attn_mask, scaling) if g.span is not None
            else _group_attention(q_flat, k, v, g, scaling) for g, (k, v) in zip(m.groups, kv)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def register() -> None:
    """Make "pdtb_paged" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
