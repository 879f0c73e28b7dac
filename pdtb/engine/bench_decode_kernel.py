"""`pdtb bench decode-kernel`: the Triton paged decode kernel's memory bandwidth, by launch setting.

One layer's decode attention of `--batches` rows of `--context` keys each, their pages
scattered through the pool, timed for each launch setting (keys per inner step, warps,
pipeline stages, program order) and each span count; the bytes are the K and V the rows read once. Prints,
per batch size, the GB/s of each setting and the best, against a device-to-device copy of
the same bytes measured in the same run (the practical ceiling).

    pdtb bench decode-kernel [--device cuda] [--dtype bfloat16] [--heads 32] [--kv-heads 8]
                             [--head-dim 128] [--page-size 16] [--context 1024]
                             [--batches 1,8,64,128] [--splits 1,2,4,8,16] [--reps 20] [--json]

The default shape is one layer of Llama-3-8B. `KernelConfig` (triton_decode.py) holds the
settings the engine uses.
"""
from __future__ import annotations

import argparse
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
    ap.add_argument("--splits", type=_ints, default=[1, 2, 4, 8, 16])
    ap.add_argument("--block-n", type=_ints, default=[32, 64])
    ap.add_argument("--warps", type=_ints, default=[4, 8])
    ap.add_argument("--stages", type=_ints, default=[2, 3])
    ap.add_argument("--head-major", type=_ints, default=[0, 1], help="program order (KernelConfig.head_major)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads or min(a.batches + a.splits + [a.context, a.reps, a.page_size]) < 1:
        ap.error("heads must be a multiple of kv heads; sizes must be positive")
    return a


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
        fn()
        sync()
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
               "settings": []}
        for block_n, warps, stages, major in itertools.product(a.block_n, a.warps, a.stages, a.head_major):
            cfg = triton_decode.KernelConfig(block_n=block_n, num_warps=warps, num_stages=stages, head_major=major)
            kernel = triton_decode.DecodeKernel(dev, cfg)
            for splits in [*a.splits, None]:  # None: the span count the engine would choose
                kernel.forced_splits = splits
                s = timed(lambda: kernel(q, pool[0], pool[1], flat, start, lens, a.context,  # noqa: B023
                                         a.head_dim ** -0.5))
                label = splits if splits else f"auto ({kernel.splits(b, a.kv_heads, a.context)})"
                row["settings"].append({"block_n": block_n, "num_warps": warps, "num_stages": stages,
                                        "head_major": major, "splits": label, "us": round(s * 1e6, 1),
                                        "gbps": round(nbytes / s / 1e9, 1)})
        row["best"] = max(row["settings"], key=lambda r: r["gbps"])
        out.append(row)
    return {"device": a.device, "dtype": a.dtype, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
            "page_size": a.page_size, "context": a.context, "reps": a.reps, "rows": out}


def main(argv=None) -> int:
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
        for s in sorted(r["settings"], key=lambda s: -s["gbps"])[:6]:
            mark = "  <- best" if s is best else ""
            print(f"    block_n {s['block_n']:>3} warps {s['num_warps']} stages {s['num_stages']} "
                  f"head-major {s['head_major']} splits {s['splits']!s:>8}: "
                  f"{s['us']:>9.1f} us {s['gbps']:>8.1f} GB/s{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
