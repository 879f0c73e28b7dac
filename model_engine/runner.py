"""Model runner: turns a scheduled batch into one forward pass over the paged pool.

Input: a list of `(sequence, num_new_tokens, page_table)` chunks. Sequence i contributes
tokens [start_i, start_i + n_i) where start_i = its num_computed_tokens; the flat row is

    | seq0 tokens | seq1 tokens | ... |      T = sum(n_i)

Output: last-position logits for the chunks that end at the sequence's last known token
(those are the ones that sample a token this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model_engine.paged_attention import PagedKVCache, StepMetadata


@dataclass
class BatchChunk:
    """One sequence's share of a step."""

    token_ids: list[int]  # the new tokens fed this step
    start_pos: int  # position of token_ids[0]
    page_table: list[int]  # pages covering positions [0, start_pos + len(token_ids))
    wants_logits: bool  # True when this chunk ends at the sequence's last token


class ModelRunner:
    """Owns the model and the device tier's KV tensor; runs one step at a time."""

    def __init__(self, model, kv: torch.Tensor, page_size: int, device: str | torch.device) -> None:
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.device = torch.device(device)

    def build_metadata(self, chunks: list[BatchChunk]) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor]:
        ps = self.page_size
        lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.long)
        starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.long)
        b, total = len(chunks), int(lens.sum())
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        seq_idx = torch.repeat_interleave(torch.arange(b), lens)
        cu_end = torch.cumsum(lens, 0)
        cu_start = cu_end - lens
        offs = torch.arange(total) - cu_start[seq_idx]
        pos = starts[seq_idx] + offs
        # Block tables: one padded [B, max_pages] tensor filled by a single scatter.
        npages = torch.tensor([len(c.page_table) for c in chunks], dtype=torch.long)
        max_pages = int(npages.max())
        flat_pages = torch.tensor([p for c in chunks for p in c.page_table], dtype=torch.long)
        prow = torch.repeat_interleave(torch.arange(b), npages)
        pcol = torch.arange(len(flat_pages)) - (torch.cumsum(npages, 0) - npages)[prow]
        block_tables = torch.zeros((b, max_pages), dtype=torch.long)
        block_tables[prow, pcol] = flat_pages
        slot_mapping = block_tables[seq_idx, pos // ps] * ps + pos % ps
        q_max = int(lens.max())
        j = torch.arange(q_max)
        q_gather = cu_start[:, None] + torch.minimum(j[None, :], (lens - 1)[:, None])
        q_scatter = seq_idx * q_max + offs
        q_pos = pos[q_gather]  # padded query slots repeat the last real query: harmless
        attn_mask = (torch.arange(max_pages * ps)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
        want = torch.tensor([c.wants_logits for c in chunks], dtype=torch.bool)
        logits_idx = (cu_end - 1)[want]
        dev = self.device
        meta = StepMetadata(slot_mapping.to(dev), block_tables.to(dev), q_gather.to(dev),
                            q_scatter.to(dev), attn_mask.to(dev))
        return ids.to(dev)[None], pos.to(dev)[None], meta, logits_idx.to(dev)

    @torch.inference_mode()
    def run(self, chunks: list[BatchChunk]) -> torch.Tensor:
        """Forward the chunks; return float32 logits [num_wanting_logits, vocab]."""
        ids, pos, meta, logits_idx = self.build_metadata(chunks)
        if logits_idx.numel() == 0:
            logits_idx = torch.tensor([ids.shape[1] - 1], device=self.device)  # lm_head on one row only
            keep_none = True
        else:
            keep_none = False
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=PagedKVCache(self.kv, meta),
                         use_cache=True, logits_to_keep=logits_idx, pdtb_meta=meta)
        if keep_none:
            return out.logits[0, :0].float()
        return out.logits[0].float()
