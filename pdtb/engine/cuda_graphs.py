"""Decode steps replayed from CUDA graphs, one graph per bucketed batch size.

A decode step of a stock transformers model launches hundreds of small kernels from Python;
on a GPU the launches, not the memory traffic, set its time. A step of `n` one-token rows
that all sample is run instead by replaying the graph captured for the smallest bucket
`b >= n` (BUCKETS, up to the engine's max_num_seqs):

- the graph reads fixed device buffers: token ids, positions, pool slots, key counts, and the
  rows' page tables back to back with each row's offset (room for `width = ceil(max_model_len
  / page_size)` pages a row); a step writes its rows into them (two host-to-device copies)
  and replays;
- rows [n, b) are padding: slot -1 (the Triton store writes nothing), 0 keys (the decode
  kernel attends to nothing), so no pool page is touched for them;
- the attention is the Triton paged kernel (triton_decode.py), whose grid depends on the
  bucket only, so one capture serves every context length up to max_model_len.

Graphs share one memory pool and are captured lazily (the first step of a bucket) or all at
once by `capture_all` (the engine's warm-up). A capture that fails turns graphs off for the
engine, logged with the reason; steps then run eagerly through the same kernel. Steps with
prefill rows, more rows than the largest bucket or a row past max_model_len run eagerly.

On the CPU (tests) the same buffers are filled and the captured function is called instead of
replayed, so the bucketing, padding and page-table layout are checked token for token against
transformers' generate without a GPU (tests/engine/test_cuda_graphs.py).
"""
from __future__ import annotations

import itertools
import logging
from bisect import bisect_left

import numpy as np
import torch

from pdtb.engine.paged_attention import AttnGroup, StepMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, kv: torch.Tensor, page_size: int, kernel, max_rows: int, max_len: int) -> None:
        self.model, self.kv, self.page_size, self.kernel = model, kv, page_size, kernel
        self.device = kv.device
        self.buckets = tuple(b for b in BUCKETS if b < max_rows) + (max_rows,)
        self.width = -(-max_len // page_size)
        rows = self.buckets[-1]
        # ids, positions, slots, key counts, page-table offsets: one [5, rows] buffer, one copy
        # per step; the rows' page tables back to back in `pages`, a second copy of only their
        # length (64 rows of 1,024 tokens: 4,160 ids, not 64 x width)
        self.small = torch.zeros(5, rows, dtype=torch.int64, device=self.device)
        self.pages = torch.zeros(rows * self.width, dtype=torch.int64, device=self.device)
        self.host_small = np.zeros((5, rows), np.int64)
        self.graphs: dict[int, object] = {}  # bucket -> callable returning the logits [b, vocab]
        self.mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.disabled: str | None = None  # why graphs are off (a capture failed)
        self.replays = 0  # steps served from a graph

    def bucket(self, n: int) -> int | None:
        i = bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(self, chunks) -> torch.Tensor | None:
        """Float32 logits [n, vocab] of a decode step served from a graph, in the chunks'
        order; None when the step is not one (the caller runs it eagerly)."""
        if self.disabled is not None:
            return None
        n = len(chunks)
        b = self.bucket(n)
        if b is None or not self._fill(chunks, b):
            return None
        entry = self.graphs.get(b)
        if entry is None:
            entry = self._capture(b)
            if entry is None:
                return None
        self.replays += 1
        return entry()[:n].to(torch.float32, copy=True)

    def _fill(self, chunks, b: int) -> bool:
        hs, ps, width = self.host_small[:, :b], self.page_size, self.width
        n = len(chunks)
        ids, pos, slots, starts, tables = [], [], [], [], []
        at = 0
        for c in chunks:
            p = c.start_pos
            if len(c.token_ids) != 1 or not c.wants_logits or p // ps >= width:
                return False
            pt = c.page_table
            if len(pt) > width:  # the kernel reads only the pages of the row's p + 1 keys
                pt = pt[:width]
            ids.append(c.token_ids[0])
            pos.append(p)
            slots.append(pt[p // ps] * ps + p % ps)
            starts.append(at)
            tables.append(pt)
            at += len(pt)
        _pad(hs)  # padding rows: 0 keys at offset 0, no page read
        hs[0, :n], hs[1, :n], hs[2, :n], hs[4, :n] = ids, pos, slots, starts
        hs[3, :n] = hs[1, :n] + 1
        self.small[:, :b].copy_(torch.from_numpy(hs))
        self.pages[:at].copy_(torch.from_numpy(np.fromiter(itertools.chain.from_iterable(tables), np.int64, at)))
        return True

    def _forward_fn(self, b: int):
        ids, pos, slots, lens, starts = (self.small[i, :b] for i in range(5))
        group = AttnGroup(None, 0, None, span=(0, b), pages=self.pages, page_start=starts,
                          lens=lens, max_len=self.width * self.page_size)
        meta = StepMetadata(slots, [group], self.kv, kernel=self.kernel)
        model = self.model

        def forward() -> torch.Tensor:
            meta.layers_run.clear()
            return model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=0,
                         pdtb_meta=meta).logits[0]
        return forward

    def _capture(self, b: int):
        forward = self._forward_fn(b)
        if self.device.type != "cuda":
            self.graphs[b] = forward
            return forward
        try:
            out, graph = self._record(forward)
        except Exception as e:  # a model whose forward cannot be captured: eager from now on
            self.disabled = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            log.warning("CUDA graph capture of a %d-row decode step failed (%s); decode steps run eagerly",
                        b, self.disabled)
            return None

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        self.graphs[b] = replay
        return replay

    def _record(self, forward):
        """Warm up on a side stream (library handles, Triton compiles), then capture."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = forward()
        return out, graph

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every bucket not captured yet, largest first (the pool then holds the largest
        graph's memory, which the smaller ones reuse); the buffers hold padding only, so no pool
        page is written. Returns the number of graphs held."""
        _pad(self.host_small)
        self.small.copy_(torch.from_numpy(self.host_small))
        self.pages.zero_()
        for b in reversed(self.buckets):
            if self.disabled is not None:
                break
            if b not in self.graphs:
                self._capture(b)
        return len(self.graphs)


def _pad(small: np.ndarray) -> None:
    """Every row of a [5, rows] ids/positions/slots/key-counts/page-offsets block a padding row:
    token 0 at position 0, slot -1 (nothing written), 0 keys (nothing read)."""
    small[:] = 0
    small[2] = -1
