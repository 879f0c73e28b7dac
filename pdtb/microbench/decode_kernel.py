"""`pdtb bench decode-kernel`: the Triton paged decode kernel's memory bandwidth, by launch setting.

One layer's decode attention of `--batches` rows of `--context` keys each, their pages
scattered through the pool, timed for each launch setting (keys per inner step, warps,
pipeline stages, program order) and each span count; the bytes are the K and V the rows read
once. On a GPU each call is captured in a CUDA graph and replayed, as the engine's decode steps
run it, so no launch cost from Python is counted. Prints, per batch size, the GB/s of each
setting and the best (and the best with the span count the engine picks, under each span
rule of `--programs-per-sm` x `--min-span`), against a
device-to-device copy of the same bytes measured in the same run (the practical ceiling). A
setting past the device's limits (shared memory) is skipped and listed.

    pdtb bench decode-kernel [--device cuda] [--dtype bfloat16] [--heads 32] [--kv-heads 8]
                             [--head-dim 128] [--page-size 16] [--context 1024]
                             [--batches 1,8,64,128] [--splits 1,2,4,8] [--block-n 32,64,128]
                             [--warps 4,8] [--stages 2,3,4] [--head-major 0,1] [--programs-per-sm 2,4]
                             [--min-span 256,512] [--reps 20] [--json]

The default shape is one layer of Llama-3-8B. `KernelConfig` (triton_decode.py) holds the
settings the engine uses.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time

from pdtb.common import CliError


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv):
    ap = argparse.ArgumentParser(prog="pdtb bench decode-kernel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64, 128])
    ap.add_argument("--splits", type=_ints, default=[1, 2, 4, 8])
    ap.add_argument("--block-n", type=_ints, default=[32, 64, 128])
    ap.add_argument("--warps", type=_ints, default=[4, 8])
    ap.add_argument("--stages", type=_ints, default=[2, 3, 4])
    ap.add_argument("--head-major", type=_ints, default=[0, 1], help="program order (KernelConfig.head_major)")
    ap.add_argument("--programs-per-sm", type=_ints, default=[2, 4],
                    help="span rules the engine's own span count is timed under (KernelConfig.programs_per_sm)")
    ap.add_argument("--min-span", type=_ints, default=[256, 512], help="... and KernelConfig.min_span")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads or min(a.batches + a.splits + [a.context, a.reps, a.page_size]) < 1:
        ap.error("heads must be a multiple of kv heads; sizes must be positive")
    return a


def settings(a) -> list:
    """The launch settings swept: `--block-n` x `--warps` x `--stages` x `--head-major`."""
    from pdtb.engine.triton_decode import KernelConfig

    return [KernelConfig(block_n=b, num_warps=w, num_stages=st, head_major=m)
            for b, w, st, m in itertools.product(a.block_n, a.warps, a.stages, a.head_major)]


def run(a) -> dict:
    import torch

    from pdtb.engine import triton_decode
    from pdtb.engine.loader import resolve_dtype

    if triton_decode.triton is None:
        raise CliError("pdtb bench decode-kernel needs Triton (a CUDA build of torch ships it)")
    dev = torch.device(a.device)
    dtype = resolve_dtype(a.dtype)
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    per_row = -(-a.context // a.page_size)
    rows_max = max(a.batches)
    pages = per_row * rows_max
    pool = torch.randn(2, pages, a.page_size, a.kv_heads, a.head_dim, generator=gen).to(dev, dtype)
    perm = torch.randperm(pages, generator=gen).to(dev)
    elem = pool.element_size()

    def timed(fn) -> float:
        """Seconds of one call: on a GPU, one call captured in a CUDA graph (as the engine runs
        it, no launch cost from Python) replayed `reps` times back to back, the mean; on the
        CPU the median of `reps` calls."""
        fn()
        sync()
        if cuda:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            sync()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                graph.replay()
            sync()
            return (time.perf_counter() - t0) / a.reps
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = []
    for b in a.batches:
        nbytes = b * a.context * a.kv_heads * a.head_dim * 2 * elem  # K and V, read once
        q = torch.randn(b, a.heads, a.head_dim, generator=gen).to(dev, dtype)
        flat = perm[:b * per_row].contiguous()
        start = torch.arange(b, device=dev, dtype=torch.int64) * per_row
        lens = torch.full((b,), a.context, device=dev, dtype=torch.int64)
        src = pool.reshape(-1)[: nbytes // elem]
        dst = torch.empty_like(src)
        copy_s = timed(lambda: dst.copy_(src))  # noqa: B023
        row = {"batch": b, "bytes_mb": round(nbytes / 1e6, 1), "copy_gbps": round(2 * nbytes / copy_s / 1e9, 1),
               "settings": [], "skipped": []}
        for cfg in settings(a):
            kernel = triton_decode.DecodeKernel(dev, cfg)
            # a forced span count, then the engine's own choice under each span rule
            for splits, rule in [*((n, None) for n in a.splits),
                                 *((None, r) for r in itertools.product(a.programs_per_sm, a.min_span))]:
                kernel.forced_splits = splits
                setting = {"block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                           "head_major": cfg.head_major}
                if rule:
                    pps, span = rule
                    kernel.configure(dataclasses.replace(cfg, programs_per_sm=pps, min_span=max(span, cfg.block_n)))
                    setting.update(programs_per_sm=pps, min_span=kernel.config.min_span,
                                   splits=f"auto ({kernel.splits(b, a.kv_heads, a.context)})")
                else:
                    setting["splits"] = splits
                try:
                    s = timed(lambda: kernel(q, pool[0], pool[1], flat, start, lens, a.context,  # noqa: B023
                                             a.head_dim ** -0.5))
                except Exception as e:  # a setting past the device's limits (shared memory, say)
                    row["skipped"].append({**setting, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
                    break
                row["settings"].append({**setting, "us": round(s * 1e6, 1), "gbps": round(nbytes / s / 1e9, 1)})
        if not row["settings"]:
            raise CliError(f"no launch setting ran at {b} rows: {row['skipped'][0]['error']}")
        row["best"] = max(row["settings"], key=lambda r: r["gbps"])
        auto = [r for r in row["settings"] if str(r["splits"]).startswith("auto")]
        row["best_auto"] = max(auto, key=lambda r: r["gbps"]) if auto else None  # spans as the engine picks them
        out.append(row)
    return {"device": a.device, "dtype": a.dtype, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
            "page_size": a.page_size, "context": a.context, "reps": a.reps, "rows": out}


def pick(res: dict, rows: int) -> str:
    """The `KernelConfig.parse` text of the fastest setting at `rows` rows among those timed with
    the span count the engine picks, with the span rule it was picked under ('' when that
    batch size was not run)."""
    from pdtb.engine.triton_decode import KernelConfig

    for r in res["rows"]:
        b = r.get("best_auto") if r["batch"] == rows else None
        if b:
            return ",".join(f"{k}={v}" for k, v in b.items() if k in KernelConfig.__dataclass_fields__)
    return ""


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--pick"]:  # `--pick ROWS < results.json`: the setting to run the engine at
        if len(argv) != 2 or not argv[1].isdigit():
            raise CliError("usage: python -m pdtb.microbench.decode_kernel --pick ROWS < decode-kernel.json")
        text = pick(json.load(sys.stdin), int(argv[1]))
        print(text)
        return 0 if text else 1
    a = parse(argv)
    res = run(a)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"decode kernel: {res['heads']} heads / {res['kv_heads']} kv heads x {res['head_dim']}, {res['dtype']}, "
          f"context {res['context']}, page size {res['page_size']} on {res['device']} (median of {res['reps']})")
    for r in res["rows"]:
        best = r["best"]
        print(f"  batch {r['batch']:>4}: {r['bytes_mb']} MB of KV; device copy {r['copy_gbps']} GB/s (read + written)")
        if r["skipped"]:
            print(f"    ({len(r['skipped'])} setting(s) past the device's limits skipped: {r['skipped'][0]['error']})")
        for s in sorted(r["settings"], key=lambda s: -s["gbps"])[:6]:  # the six fastest
            mark = "  <- best" if s is best else ""
            print(f"    block_n {s['block_n']:>3} warps {s['num_warps']} stages {s['num_stages']} "
                  f"head-major {s['head_major']} splits {s['splits']!s:>8}"
                  + (f" ({s['programs_per_sm']}/SM, spans >= {s['min_span']})" if "min_span" in s else "") + ": "
                  f"{s['us']:>9.1f} us {s['gbps']:>8.1f} GB/s{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
