"""Model runner: turns a scheduled batch into one forward pass over the paged pool.

Input: a list of `(sequence, num_new_tokens, page_table)` chunks. Sequence i contributes
tokens [start_i, start_i + n_i) where start_i = its num_computed_tokens; the flat row is

    | seq0 tokens | seq1 tokens | ... |      T = sum(n_i)

Output: last-position logits for the chunks that end at the sequence's last known token
(those are the ones that sample a token this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdtb.engine.paged_attention import AttnGroup, StepMetadata
from pdtb.engine.read_cache import BUCKET_EDGES, ReadCaches, bucket_of, key_length


@dataclass
class BatchChunk:
    """One sequence's share of a step."""

    request_id: str  # whose chunk this is (keys the decode read cache)
    token_ids: list[int]  # the new tokens fed this step
    start_pos: int  # position of token_ids[0]
    page_table: list[int]  # pages covering positions [0, start_pos + len(token_ids))
    wants_logits: bool  # True when this chunk ends at the sequence's last token


# Prefill rows share an attention call only while padding them to one shape (queries to the
# longest chunk, keys to the longest context) costs at most PAD_SLACK times their own work: one
# 2,000-token chunk beside five 100-token ones would otherwise pad all six to 2,000 x 2,000.
PAD_SLACK = 1.5
# A prompt's first chunk of at least this many tokens is an attention call of its own, causal
# without a mask (SDPA's is_causal skips the upper triangle a mask only zeroes: 2x fewer
# operations, and bit-identical outputs, measured on the CPU); smaller ones batch with others.
CAUSAL_ALONE = 64


def prefill_groups(lens: np.ndarray, starts: np.ndarray, npages: np.ndarray) -> list[np.ndarray]:
    """The prefill rows' attention groups, as index arrays into the given rows: rows ordered
    by context and chunk size, consecutive ones sharing a group while PAD_SLACK holds; a long
    first chunk (CAUSAL_ALONE) alone. Concatenated, the groups are every row once."""
    n = len(lens)
    if n <= 1:
        return [np.arange(n)] if n else []
    keys = npages  # (pages: the padded key length is max_pages * page_size)
    alone = (starts == 0) & (lens >= CAUSAL_ALONE)
    groups = [np.array([i]) for i in np.flatnonzero(alone)]
    rest = np.flatnonzero(~alone)
    rest = rest[np.lexsort((lens[rest], keys[rest]))]
    cur: list[int] = []
    work = q_max = k_max = 0
    for i in rest:
        q, k = int(lens[i]), int(keys[i])
        nq, nk, nw = max(q_max, q), max(k_max, k), work + q * k
        if cur and (len(cur) + 1) * nq * nk > PAD_SLACK * nw:
            groups.append(np.array(cur))
            cur, work, nq, nk, nw = [], 0, q, k, q * k
        cur.append(int(i))
        work, q_max, k_max = nw, nq, nk
    if cur:
        groups.append(np.array(cur))
    return groups


class ModelRunner:
    """Owns the model and the device tier's KV tensor; runs one step at a time."""

    def __init__(self, model, kv: torch.Tensor, page_size: int, device: str | torch.device,
                 kernel=None) -> None:
        cfg = model.config
        self.groups = cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.device = torch.device(device)
        self.kernel = kernel  # cpu_kernel / triton_decode DecodeKernel: decode rows read their pages in place
        self.graphs = None  # cuda_graphs.DecodeGraphs: decode steps replayed from CUDA graphs
        self.lean = None  # lean_forward.LeanForward: the model's layers without transformers' wrappers
        self.read_cache = ReadCaches(kv.shape[0], kv.shape[4], kv.shape[5], kv.dtype, self.device) \
            if self.device.type == "cpu" and kernel is None else None

    def build_metadata(self, chunks: list[BatchChunk]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor | None]:
        """(input ids, positions, attention metadata, the flat rows whose logits are returned,
        in the chunks' order; None: every row, flat order being the chunks' order)."""
        steady = self._kernel_decode(chunks) if self.kernel is not None else self._steady_decode(chunks)
        if steady is not None:
            return steady
        # Index arithmetic in numpy: one small op costs ~1 us there against ~5-10 us in torch,
        # and this runs every step (it was a tenth of a decode step when written with torch ops).
        ps = self.page_size
        b = len(chunks)
        lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, b)
        starts = np.fromiter((c.start_pos for c in chunks), np.int64, b)
        npages = np.fromiter((len(c.page_table) for c in chunks), np.int64, b)
        # Flat order: decode rows (one token each) by length bucket (read_cache.bucket_of), each
        # bucket in its read cache's slot order, then the prefill rows in step order. Every
        # attention group is then a contiguous run of flat tokens, so a group's outputs are
        # concatenated and not scattered; the logits are gathered back into step order.
        decode = lens == 1
        # == bucket_of(position + 1); the kernel reads each row's own keys: one group for all
        bucket = np.zeros(b, np.int64) if self.kernel is not None else np.searchsorted(BUCKET_EDGES, starts + 1)
        parts, plans = [], []
        for k in np.unique(bucket[decode]):
            rows = np.flatnonzero(decode & (bucket == k))
            plan = None
            if self.read_cache is not None:
                d_pos = starts[rows]
                plan = self.read_cache[int(k)].plan(tuple(chunks[i].request_id for i in rows), d_pos,
                                                    key_length(int(d_pos.max())), int(npages[rows].max()) * ps)
                if plan is not None and plan.order is not None:
                    rows = rows[plan.order]  # group row r is cache row r
            parts.append(rows)
            plans.append(plan)
        prefill = np.flatnonzero(~decode)
        pf_groups = prefill_groups(lens[prefill], starts[prefill], npages[prefill])
        prefill = prefill[np.concatenate(pf_groups)] if pf_groups else prefill
        perm = np.concatenate([*parts, prefill]) if parts else prefill  # step index of each flat row
        lens, starts, npages = lens[perm], starts[perm], npages[perm]
        total, max_pages = int(lens.sum()), int(npages.max())
        ordered = [chunks[i] for i in perm]
        ids = np.fromiter((t for c in ordered for t in c.token_ids), np.int64, total)
        seq_idx = np.repeat(np.arange(b), lens)
        cu_end = np.cumsum(lens)
        cu_start = cu_end - lens
        pos = starts[seq_idx] + (np.arange(total) - cu_start[seq_idx])
        block_tables = np.zeros((b, max_pages), np.int64)
        flat = np.fromiter((p for c in ordered for p in c.page_table), np.int64, int(npages.sum()))
        block_tables[np.arange(max_pages)[None, :] < npages[:, None]] = flat  # row-major fill
        slot_mapping = block_tables[seq_idx, pos // ps] * ps + pos % ps
        groups, first = [], 0
        for rows, plan in zip(parts, plans):  # decode rows: flat row == flat token
            n = len(rows)
            groups.append(self._decode_group(first, pos[first:first + n], plan, npages[first:first + n],
                                             block_tables[first:first + n]))
            first += n
        for members in pf_groups:  # prefill rows: flat rows [first, b), group after group
            n = len(members)
            groups.append(self._prefill_group(np.arange(first, first + n), lens, cu_start, pos, npages, block_tables))
            first += n
        want = np.fromiter((c.wants_logits for c in chunks), bool, b)
        at = np.empty(b, np.int64)
        at[perm] = np.arange(b)  # flat row of each chunk
        t = self._t
        return t(ids)[None], t(pos)[None], StepMetadata(t(slot_mapping), groups, self.kv, kernel=self.kernel), \
            t((cu_end - 1)[at[want]])

    def _kernel_decode(self, chunks: list[BatchChunk]):
        """Metadata of a step of decode rows only, for the C kernel: the rows stay in step order
        as one group, whatever their lengths, and the kernel reads each row's pages where they
        lie (page tables back to back, `page_start` the offset of each). None when a chunk is
        not a one-token row that samples (the general path handles the step)."""
        rows = self._one_token_rows(chunks)
        if rows is None:
            return None
        ids, pos, slots = rows
        pages, starts = [], []
        for c in chunks:
            starts.append(len(pages))
            pages.extend(c.page_table)
        t = self._list
        lens = [p + 1 for p in pos]
        group = AttnGroup(None, 0, None, span=(0, len(chunks)), pages=t(pages), page_start=t(starts),
                          lens=t(lens), max_len=max(lens))
        return t(ids)[None], t(pos)[None], StepMetadata(t(slots), [group], self.kv, kernel=self.kernel), None

    def _one_token_rows(self, chunks: list[BatchChunk]):
        """(token ids, positions, pool slots) of a step made only of one-token rows that sample
        (a decode step); None otherwise."""
        ps = self.page_size
        ids, pos, slots = [], [], []
        for c in chunks:
            if len(c.token_ids) != 1 or not c.wants_logits:
                return None
            p = c.start_pos
            ids.append(c.token_ids[0])
            pos.append(p)
            slots.append(c.page_table[p // ps] * ps + p % ps)
        return ids, pos, slots

    def _list(self, a: list[int]) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.int64, device=self.device)

    def _steady_decode(self, chunks: list[BatchChunk]):
        """Metadata of a decode step whose rows are, bucket by bucket, the same as the last
        step's in the same order (their read caches hold them): only positions, slots and masks
        change, so none of the general path's padding arithmetic is needed. None otherwise."""
        rcs = self.read_cache
        rows = None if rcs is None else self._one_token_rows(chunks)
        if rows is None:
            return None
        ids, pos, slots = rows
        members: dict[int, list[int]] = {}  # bucket -> row indices, in order
        for i, p in enumerate(pos):
            members.setdefault(bucket_of(p + 1), []).append(i)
        pos_np = np.asarray(pos, np.int64)
        steady = []
        for k, rows in members.items():
            rc = rcs[k]
            if rc.key is None or len(rc.key) != len(rows):
                return None
            in_slots = [-1] * len(rows)  # the bucket's rows in cache-row (slot) order
            for i in rows:
                r = rc.slot_of.get(chunks[i].request_id)
                if r is None:
                    return None
                in_slots[r] = i
            g_pos = pos_np[in_slots]
            length = key_length(int(g_pos.max()))
            if length > rc.capacity or not rc.holds(g_pos):
                return None  # the cache must grow or gather a row: the general path does it
            steady.append((rc, in_slots, g_pos, length))
        # Plan only once every bucket is known to be steady: planning advances a cache's
        # `covered`, so a bucket planned here and again by the general path (because a later
        # bucket was not steady) would see its own rows as stale and gather them all afresh.
        plans = [(in_slots, g_pos, rc.plan(rc.key, g_pos, length, 0)) for rc, in_slots, g_pos, length in steady]
        # The model sees the rows bucket by bucket, each in its cache's slot order: every group
        # is then a contiguous span of the flat rows, read and written with slices instead of
        # per-layer gathers and scatters (5% of a 32-row step). One gather of the final hidden
        # states (`logits_to_keep`) puts the logits back in the step's order.
        perm = [i for rows, _, _ in plans for i in rows]  # step index of each flat row
        groups, start = [], 0
        for rows, g_pos, plan in plans:
            groups.append(self._decode_group(start, g_pos, plan))
            start += len(rows)
        t = self._t
        order = np.asarray(perm, np.int64)
        logits_idx = None if perm == list(range(len(perm))) else t(np.argsort(order))
        return t(np.asarray(ids, np.int64)[order])[None], t(pos_np[order])[None], \
            StepMetadata(t(np.asarray(slots, np.int64)[order]), groups, self.kv), logits_idx

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _decode_group(self, first: int, g_pos, plan, g_npages=None, g_tables=None) -> AttnGroup:
        """Decode rows that are flat rows [first, first + len(g_pos)), one query each at
        positions `g_pos`, in the order of their read cache's slots (`plan`; None: no read
        cache, their pages are gathered). `g_npages` / `g_tables`: their page counts and block
        tables, for gathering pages (none in a steady step, which gathers nothing)."""
        if self.kernel is not None:  # pages read in place: page tables back to back, no padding
            starts = np.concatenate(([0], np.cumsum(g_npages)[:-1]))
            flat = g_tables[np.arange(g_tables.shape[1])[None, :] < g_npages[:, None]]  # row-major
            t = self._t
            return AttnGroup(None, 0, None, span=(first, first + len(g_pos)), pages=t(flat), page_start=t(starts),
                             lens=t(g_pos + 1), max_len=int(g_pos.max()) + 1)
        max_pages = 0 if g_npages is None else int(g_npages.max())
        keys = plan.length if plan is not None else max_pages * self.page_size
        allowed = np.arange(keys)[None, :] <= g_pos[:, None]  # [n, L]
        mask = torch.from_numpy(np.where(allowed, np.float32(0), np.float32("-inf"))[:, None, None, :])
        pages = np.zeros(0, np.int64) if g_tables is None else g_tables[:, :max_pages].reshape(-1)
        return AttnGroup(self._t(pages), max_pages, mask.to(device=self.device, dtype=self.kv.dtype), plan,
                         span=(first, first + len(g_pos)))

    def _prefill_group(self, rows, lens, cu_start, pos, npages, block_tables) -> AttnGroup:
        """Attention metadata for the prefill rows `rows` (consecutive flat rows)."""
        ps = self.page_size
        max_pages = int(npages[rows].max())
        g_lens, g_start = lens[rows], cu_start[rows]
        q_max = int(g_lens.max())
        t = self._t
        if len(rows) == 1 and pos[g_start[0]] == 0:  # a prompt's first chunk alone: causal, no mask
            return AttnGroup(t(block_tables[rows, :max_pages].reshape(-1)), max_pages, None,
                             span=(int(g_start[0]), int(g_start[0]) + q_max), causal=q_max)
        j = np.arange(q_max)
        q_gather = g_start[:, None] + np.minimum(j[None, :], (g_lens - 1)[:, None])  # [B_g, q_max]
        valid = j[None, :] < g_lens[:, None]
        pad_index = (np.arange(len(rows))[:, None] * q_max + j[None, :])[valid]
        q_pos = pos[q_gather]  # padded query slots repeat the last real query: harmless
        keys = max_pages * ps
        allowed = np.arange(keys)[None, None, :] <= q_pos[:, :, None]  # [B_g, q_max, L]
        mask = np.where(allowed, np.float32(0), np.float32("-inf"))
        mask = np.repeat(mask[:, None], self.groups, axis=1).reshape(len(rows), 1, self.groups * q_max, keys)
        return AttnGroup(t(block_tables[rows, :max_pages].reshape(-1)), max_pages,
                         torch.from_numpy(mask).to(device=self.device, dtype=self.kv.dtype),
                         q_gather=t(q_gather), pad_index=t(pad_index))

    @torch.inference_mode()
    def run(self, chunks: list[BatchChunk]) -> torch.Tensor:
        """Forward the chunks; return float32 logits [num_wanting_logits, vocab]."""
        if self.graphs is not None:
            logits = self.graphs.run(chunks)
            if logits is not None:
                return logits
        try:  # planning a read cache counts this step's appends: if the step fails, forget it
            ids, pos, meta, logits_idx = self.build_metadata(chunks)
            keep_none = False
            if logits_idx is None:  # every row samples: no gather before lm_head
                logits_idx = 0
            elif logits_idx.numel() == 0:
                logits_idx = torch.tensor([ids.shape[1] - 1], device=self.device)  # lm_head on one row only
                keep_none = True
            if self.lean is not None:
                logits = self.lean(ids, pos, meta, logits_idx)
            else:  # no cache object: the attention function reads and writes the pool (paged_attention)
                logits = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=logits_idx,
                                    pdtb_meta=meta).logits[0]
        except BaseException:
            if self.read_cache is not None:
                self.read_cache.invalidate()  # its rows' `covered` counted this step's appends
            raise
        return logits[:0].float() if keep_none else logits.float()
