"""`pdtb bench steps`: what one engine step costs, by what it carries.

A minnow's inter-token gap is the length of the steps it shares. This measures, on one model
and thread count, a base step of short decode rows and the time each addition puts on it:
long decode rows (a whale decoding) and one prefill chunk of a long prompt at a given size
and offset (a whale prefilling beside them). Median of `--reps` interleaved repeats of each
composition. Each is timed as a decode step follows another in serving: a warm-up step of the
same composition fills the decode rows' read caches, and the timed step feeds every decode row
its next position, so it appends to those caches instead of gathering rows from their pages
(`gathered_rows_timed` counts rows the timed steps did gather; 0 unless a cache was too small).

    pdtb bench steps [--threads 1] [--rows 10] [--row-len 30] [--long-rows 1,2,4] [--long-len 1800]
                     [--chunks 16,64,512] [--offsets 0,1000] [--reps 15] [--json]
                     [--device cpu|cuda[:N]] [--dtype float32|bfloat16] [--random-init CONFIG]
    pdtb bench steps --grid [grid lists, see step_grid.py] [--json]

`--grid` measures a grid of step compositions instead (decode rows by context, prefill chunks
by size and offset, both together) as samples a step-cost model is fitted to (`pdtb sim
calibrate`). `--random-init CONFIG` times a model of that config's shape with random weights
(a config.json path or a shape shipped in pdtb/shapes/model_configs), no checkpoint needed.
On a GPU the device is synchronized before the timer is read.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

from pdtb.microbench.step_harness import build_engine, step_timer


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb bench steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded tiny model)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as the nodes)")
    ap.add_argument("--rows", type=int, default=10, help="short decode rows in every step")
    ap.add_argument("--row-len", type=int, default=30, help="context of a short row (tokens)")
    ap.add_argument("--long-rows", type=_ints, default=[1, 2, 4], help="long decode rows added (list)")
    ap.add_argument("--long-len", type=int, default=1800, help="context of a long row (tokens)")
    ap.add_argument("--chunks", type=_ints, default=[16, 64, 512], help="prefill chunk sizes added (list)")
    ap.add_argument("--offsets", type=_ints, default=[0, 1000], help="prompt offsets of the chunk (list)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None, help="repeats of each composition (default 15; --grid: 9)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--random-init", metavar="CONFIG", default=None,
                    help="random weights from a config.json path or a shipped shape (e.g. llama-3-8b) instead of --model")
    from pdtb.microbench.step_grid import add_grid_args, check_grid_args

    add_grid_args(ap)
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in --grid --json output
    if a.model and a.random_init:
        ap.error("--model and --random-init exclude each other")
    check_grid_args(ap, a)
    a.reps = a.reps if a.reps is not None else (9 if a.grid else 15)
    if not (a.long_rows and a.chunks and a.offsets):
        ap.error("--long-rows, --chunks and --offsets need at least one value each")
    if min([a.rows, a.row_len, a.long_len, a.reps, a.threads, a.page_size, *a.long_rows, *a.chunks]) < 1 or min(a.offsets) < 0:
        ap.error("sizes, counts and repeats must be positive (offsets non-negative)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.grid:
        from pdtb.microbench.step_grid import main_grid

        return main_grid(a)
    from pdtb.engine.runner import BatchChunk

    ps = a.page_size
    longest = max(max(a.offsets) + max(a.chunks), a.long_len + 1)
    pages = a.rows * (-(-(a.row_len + 1) // ps)) + (max(a.long_rows) + 1) * (-(-longest // ps))
    eng = build_engine(a, pages + 4)
    timed = step_timer(a.device)
    pool, rng = eng.pool, random.Random(a.seed)
    vocab = eng.info.vocab_size

    def owner(rid: str, tokens: int) -> list[int]:
        pool.allocate(rid, -(-tokens // ps))
        return pool.pages_of(rid)

    def decode(rid: str, ctx: int) -> tuple[BatchChunk, BatchChunk]:  # (warm-up, timed) steps' rows
        pages = owner(rid, ctx + 2)
        return (BatchChunk(rid, [rng.randrange(vocab)], ctx, pages, True),
                BatchChunk(rid, [rng.randrange(vocab)], ctx + 1, pages, True))

    base = [decode(f"row{i}", a.row_len) for i in range(a.rows)]
    longs = [decode(f"long{i}", a.long_len) for i in range(max(a.long_rows))]
    prompt = owner("prompt", longest)
    comps = {"base": base}
    for n in a.long_rows:
        comps[f"+{n} long row{'s' if n > 1 else ''} ({a.long_len})"] = base + longs[:n]
    for n in a.chunks:
        for off in a.offsets:
            chunk = BatchChunk("prompt", [rng.randrange(vocab) for _ in range(n)], off,
                               prompt[:-(-(off + n) // ps)], False)
            comps[f"+chunk {n} @ {off}"] = [*base, (chunk, chunk)]
    times: dict[str, list[float]] = {k: [] for k in comps}
    caches, gathered = eng.runner.read_cache, 0
    for _ in range(a.reps):
        for k, rows in comps.items():
            eng.runner.run([warm for warm, _ in rows])  # fills the composition's read caches
            before = caches.rows_gathered if caches is not None else 0
            times[k].append(timed(eng.runner, [step for _, step in rows]))
            gathered += (caches.rows_gathered if caches is not None else 0) - before
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"step_ms": med, "added_ms": {k: v - med["base"] for k, v in med.items() if k != "base"},
           "threads": a.threads, "rows": a.rows, "row_len": a.row_len, "reps": a.reps,
           "gathered_rows_timed": gathered}
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"base: {a.rows} decode rows of {a.row_len} tokens, {a.threads} thread(s): {med['base']:.2f} ms/step (median of {a.reps})")
    for k, v in res["added_ms"].items():
        print(f"  {k:28s} {med[k]:7.2f} ms  (+{v:.2f} ms, {med[k] / med['base']:.2f}x base)")
    if gathered:
        print(f"  ({gathered} decode rows were gathered from pages in timed steps: read caches too small)")
    return 0
