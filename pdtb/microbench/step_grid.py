"""`pdtb bench steps --grid`: step time over a grid of step compositions, as samples for a
step-cost model (`pdtb sim calibrate`).

Compositions, each one engine step:

    decode    R rows, each reading C context tokens          R in --grid-rows, C in --grid-ctx
    prefill   K chunks of N tokens, each at prompt offset O   K in --grid-chunk-counts, N in
                                                              --grid-chunks, O in --grid-offsets
    mixed     R rows of C tokens plus one chunk of N at O     (--mixed: the chunks in turn, all, none)

A sample records the composition as a `pdtb.sim.cost.StepShape` would: decode_ctx sums the
rows' context including the token fed this step (a row at position C - 1 reads C tokens),
prefill_attn sums N * O + N * (N + 1) / 2 over the chunks. Timing as in the rest of
`pdtb bench steps`: each repeat runs a warm-up step of the composition (rows one position
earlier) and then the timed step; compositions interleave; a sample keeps the median.

    {"kind": "step-samples", "device", "model", "threads", "dtype", "page_size", "page_bytes",
     "reps", "command", "machine": {"accelerator", "cpu", "cores", "memory_gib", "python", "versions"},
     "samples": [{"decode_rows", "decode_ctx", "prefill_chunks", "prefill_tokens",
                          "prefill_attn", "ms"}, ...]}
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
from dataclasses import dataclass


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_grid_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--grid", action="store_true", help="measure a grid of compositions (samples for pdtb sim calibrate)")
    ap.add_argument("--grid-rows", type=_ints, default=[1, 4, 16, 32], help="decode rows per step (list)")
    ap.add_argument("--grid-ctx", type=_ints, default=[32, 512, 2048], help="context of each decode row, >= 2 (list)")
    ap.add_argument("--grid-chunks", type=_ints, default=[16, 128, 512], help="prefill chunk sizes (list)")
    ap.add_argument("--grid-offsets", type=_ints, default=[0, 1024], help="prompt offsets of a chunk (list)")
    ap.add_argument("--grid-chunk-counts", type=_ints, default=[1, 2], help="chunks per prefill-only step (list)")
    ap.add_argument("--mixed", choices=["cycle", "all", "none"], default="cycle",
                    help="steps of decode rows plus a chunk: each decode composition with the next (size, offset) "
                         "in turn (cycle), with every one (all), or none")


def check_grid_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    lists = (a.grid_rows, a.grid_ctx, a.grid_chunks, a.grid_offsets, a.grid_chunk_counts)
    if not all(lists):
        ap.error("every --grid-* list needs at least one value")
    if min(a.grid_rows + a.grid_chunks + a.grid_chunk_counts) < 1 or min(a.grid_ctx) < 2 or min(a.grid_offsets) < 0:
        ap.error("grid sizes must be positive (contexts >= 2, offsets non-negative)")


@dataclass(frozen=True)
class Composition:
    """One step of the grid."""

    rows: int = 0  # decode rows
    ctx: int = 0  # context each decode row reads, the fed token included
    chunks: int = 0  # prefill chunks
    chunk_len: int = 0  # tokens of each chunk
    offset: int = 0  # prompt offset of each chunk

    def shape(self) -> dict:
        """The StepShape fields of this step (pdtb.sim.cost), as plain ints."""
        n = self.chunk_len
        return {"decode_rows": self.rows, "decode_ctx": self.rows * self.ctx, "prefill_chunks": self.chunks,
                "prefill_tokens": self.chunks * n, "prefill_attn": self.chunks * (n * self.offset + n * (n + 1) // 2)}


def compositions(a: argparse.Namespace) -> list[Composition]:
    decode = [Composition(r, c) for r in a.grid_rows for c in a.grid_ctx]
    chunk = [(n, o) for n in a.grid_chunks for o in a.grid_offsets]
    prefill = [Composition(chunks=k, chunk_len=n, offset=o) for k in a.grid_chunk_counts for n, o in chunk]
    if a.mixed == "all":
        pairs = [(d, c) for d in decode for c in chunk]
    elif a.mixed == "cycle":  # each decode composition with the next chunk in turn: every kind, few steps
        pairs = [(d, chunk[i % len(chunk)]) for i, d in enumerate(decode)]
    else:
        pairs = []
    mixed = [Composition(d.rows, d.ctx, 1, n, o) for d, (n, o) in pairs]
    return decode + prefill + mixed


class _Rows:
    """Pages and step rows of the grid: max(R) decode rows per context, max(K) prompts."""

    def __init__(self, eng, a: argparse.Namespace) -> None:
        from pdtb.engine.runner import BatchChunk

        self._chunk, self.pool, ps = BatchChunk, eng.pool, a.page_size
        self.rng, self.vocab = random.Random(a.seed), eng.info.vocab_size
        self.decode = {c: [self._alloc(f"d{c}_{i}", c, ps) for i in range(max(a.grid_rows))] for c in a.grid_ctx}
        longest = max(a.grid_offsets) + max(a.grid_chunks)
        self.prompts = [self._alloc(f"p{j}", longest, ps) for j in range(max(a.grid_chunk_counts))]
        self.ps = ps

    @staticmethod
    def pages_needed(a: argparse.Namespace) -> int:
        ps, longest = a.page_size, max(a.grid_offsets) + max(a.grid_chunks)
        return max(a.grid_rows) * sum(-(-c // ps) for c in a.grid_ctx) + max(a.grid_chunk_counts) * -(-longest // ps)

    def _alloc(self, rid: str, tokens: int, ps: int) -> tuple[str, list[int]]:
        self.pool.allocate(rid, -(-tokens // ps))
        return rid, self.pool.pages_of(rid)

    def step(self, comp: Composition, warm: bool) -> list:
        """The rows of `comp`: decode rows at position ctx - 1 (ctx - 2 for the warm-up step)."""
        pos = comp.ctx - (2 if warm else 1)
        rows = [self._chunk(rid, [self.rng.randrange(self.vocab)], pos, pages, True)
                for rid, pages in self.decode.get(comp.ctx, [])[:comp.rows]]
        end = comp.offset + comp.chunk_len
        for rid, pages in self.prompts[:comp.chunks]:
            toks = [self.rng.randrange(self.vocab) for _ in range(comp.chunk_len)]
            rows.append(self._chunk(rid, toks, comp.offset, pages[:-(-end // self.ps)], False))
        return rows


def measure(eng, a: argparse.Namespace, comps: list[Composition]) -> list[dict]:
    """Median milliseconds of each composition over `a.reps` interleaved repeats."""
    from pdtb.microbench.step_harness import step_timer

    rows, timed = _Rows(eng, a), step_timer(a.device)
    times: list[list[float]] = [[] for _ in comps]
    for _ in range(a.reps):
        for i, comp in enumerate(comps):
            eng.runner.run(rows.step(comp, warm=True))  # fills the rows' read caches, as serving has
            times[i].append(timed(eng.runner, rows.step(comp, warm=False)))
    return [{**c.shape(), "ms": round(statistics.median(t), 4)} for c, t in zip(comps, times)]


def machine_of(device: str) -> dict:
    """The host's facts and the device the steps ran on (a calibration carries them)."""
    import torch

    from pdtb.common import host_facts

    h = host_facts()
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else h["cpu"]
    return {"accelerator": name, **h}


def main_grid(a: argparse.Namespace) -> int:
    from pdtb.microbench.step_harness import build_engine

    comps = compositions(a)
    eng = build_engine(a, _Rows.pages_needed(a) + 4)
    longest = max(max(a.grid_ctx), max(a.grid_offsets) + max(a.grid_chunks))
    if longest > eng.info.max_model_len:
        from pdtb.common import CliError

        raise CliError(f"the grid reaches {longest} tokens; the model holds {eng.info.max_model_len}")
    samples = measure(eng, a, comps)
    res = {"kind": "step-samples", "device": a.device, "model": eng.info.model_dir, "threads": a.threads,
           "dtype": a.dtype, "page_size": a.page_size, "page_bytes": eng.spec.bytes_per_page,
           "reps": a.reps, "command": "pdtb bench steps " + shlex.join(a.argv), "machine": machine_of(a.device),
           "samples": samples}
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"{len(samples)} compositions, {a.device} {a.dtype}, {a.threads} thread(s), median of {a.reps}")
    print(f"{'rows':>5} {'ctx':>7} {'chunks':>6} {'tokens':>6} {'attn':>9} {'ms':>9}")
    for s in samples:
        print(f"{s['decode_rows']:5d} {s['decode_ctx']:7d} {s['prefill_chunks']:6d} {s['prefill_tokens']:6d} "
              f"{s['prefill_attn']:9d} {s['ms']:9.3f}")
    return 0

