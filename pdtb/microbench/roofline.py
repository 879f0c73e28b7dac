"""`pdtb bench roofline`: decode step time against the memory roofline, by batch size.

A decode step reads every weight once and every row's KV once, so its floor on a device is

    roofline = (weight bytes + KV bytes read + KV bytes written) / memory bandwidth

where the weight bytes are every parameter but the input embedding (a step reads only its
rows' entries of it; a tied embedding is read whole by the output layer and counted), the KV
read is each row's context plus its new token at every layer, and the KV written its new token.
The bandwidth is the device's datasheet figure where the device is known (H100 SXM, H200, A100
80GB: pdtb/shapes/accelerators.py), else the measured rate of a large copy on the device (bytes
read plus written per second), and `--bandwidth GB/s` sets it. For each batch size the engine
runs a decode step of that many rows of `--context` tokens (a warm-up step, then the median of
`--reps` timed ones, the device synchronized around each) and prints the step time, the
roofline and the fraction of it reached (roofline / step time). The engine's decode path is
timed (on a GPU: CUDA graphs over the Triton paged kernel, the RMSNorms fused); `--compare`
also times, on the same rows, graphs captured with transformers' own RMSNorms (`unfused`),
the kernel run eagerly and the pages gathered for torch attention.

    pdtb bench roofline [--random-init llama-3-8b | --model DIR] [--device cuda] [--dtype bfloat16]
                        [--batches 1,2,4,8,16,32,64,128] [--context 1024] [--reps 5]
                        [--bandwidth GBPS] [--compare] [--json]

With `--random-init` (default llama-3-8b) the model has that config's shape and random weights:
no checkpoint is needed, and an 8B model in bfloat16 fits one 80 GB GPU with the KV of 128
rows of 1024 tokens. On the CPU, `--model` (default: the embedded tiny model) and float32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from pdtb.common import CliError


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb bench roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-init", metavar="CONFIG", default=None,
                    help="random weights of a config's shape (default llama-3-8b on a GPU)")
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default on the CPU: the embedded tiny model)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV each row attends to")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (default: datasheet or measured)")
    ap.add_argument("--kernel-config", default=None, metavar="K=V,...",
                    help="launch settings of the Triton decode kernel (triton_decode.KernelConfig fields)")
    ap.add_argument("--compare", action="store_true",
                    help="also time the engine's other decode paths on the same rows (the paged kernel without "
                         "CUDA graphs; pages gathered for torch attention)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.model and a.random_init:
        ap.error("--model and --random-init exclude each other")
    gpu = a.device.startswith("cuda")
    if not a.model and not a.random_init and gpu:
        a.random_init = "llama-3-8b"
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    if not a.batches or min(a.batches) < 1 or a.context < 1 or a.reps < 1:
        ap.error("--batches, --context and --reps must be positive")
    return a


def datasheet_bandwidth(device: str) -> tuple[float | None, str]:
    """(bytes/s, where it comes from) for a known GPU, else (None, "")."""
    import torch

    if not device.startswith("cuda"):
        return None, ""
    from pdtb.shapes.accelerators import accelerator

    name = torch.cuda.get_device_name(torch.device(device)).upper()
    for key, entry in (("H200", "h200"), ("H100 80GB HBM3", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb")):
        if key in name:
            return accelerator(entry).hbm_bytes_per_s, f"datasheet ({entry})"
    return None, ""


def measured_bandwidth(device: str, nbytes: int, reps: int = 5) -> float:
    """Bytes read plus written per second by a copy of `nbytes` on `device`, best of `reps`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)
    best = 0.0
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def weight_bytes(model, batch: int) -> int:
    """Parameter bytes a decode step of `batch` rows reads (see the module docstring)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings()
    if out is None or out.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def kv_bytes(spec, batch: int, context: int) -> int:
    """KV bytes a decode step reads (context + the new token) and writes (the new token)."""
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.torch_dtype.itemsize
    return batch * (context + 2) * per_token


def build(a: argparse.Namespace, num_pages: int):
    ns = argparse.Namespace(random_init=a.random_init, model=a.model, device=a.device, dtype=a.dtype,
                            page_size=a.page_size, threads=a.threads)
    from pdtb.microbench.step_harness import build_engine

    return build_engine(ns, num_pages)


def run(a: argparse.Namespace) -> dict:
    import torch

    from pdtb.microbench.step_harness import step_timer
    from pdtb.engine.fused_norm import set_fused
    from pdtb.engine.runner import BatchChunk

    ps = a.page_size
    per_row = -(-(a.context + 2) // ps)
    eng = build(a, per_row * max(a.batches) + 4)
    bw, source = (a.bandwidth * 1e9, "--bandwidth") if a.bandwidth else datasheet_bandwidth(a.device)
    if bw is None:
        bw, source = measured_bandwidth(a.device, (1 << 30) if a.device.startswith("cuda") else (256 << 20)), "measured copy"
    timed = step_timer(a.device)
    pool, vocab = eng.pool, eng.info.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(max(a.batches)):
        pool.allocate(f"r{i}", per_row)
        pages = pool.pages_of(f"r{i}")
        tok = lambda: int(torch.randint(3, vocab, (1,), generator=gen))  # noqa: E731
        rows.append((BatchChunk(f"r{i}", [tok()], a.context, pages, True),
                     BatchChunk(f"r{i}", [tok()], a.context + 1, pages, True)))
    runner = eng.runner
    if a.kernel_config and getattr(runner.kernel, "name", "") == "triton":
        from pdtb.engine.triton_decode import KernelConfig

        runner.kernel.configure(KernelConfig.parse(a.kernel_config))
    paths = decode_paths(runner, eng.fused_norms)
    paths = paths if a.compare else paths[:1]
    out = []
    for b in a.batches:
        nbytes = weight_bytes(runner.model, b) + kv_bytes(eng.spec, b, a.context)
        roof = 1000 * nbytes / bw
        row = {"batch": b, "bytes_mb": round(nbytes / 1e6, 1), "roofline_ms": round(roof, 3)}
        for name, kernel, graphs, fused in paths:  # each path times the same rows
            runner.kernel, runner.graphs = kernel, graphs
            set_fused(runner.model, fused)
            times = []
            for _ in range(a.reps):
                runner.run([warm for warm, _ in rows[:b]])
                times.append(timed(runner, [step for _, step in rows[:b]]))
            ms = statistics.median(times)
            if name == paths[0][0]:
                row.update(path=name, step_ms=round(ms, 3), fraction=round(roof / ms, 3),
                           tokens_per_s=round(1000 * b / ms, 1))
            else:
                row[f"{name}_ms"] = round(ms, 3)
                row[f"{name}_fraction"] = round(roof / ms, 3)
        runner.kernel, runner.graphs = paths[0][1], paths[0][2]
        set_fused(runner.model, True)
        out.append(row)
    return {"model": a.random_init or a.model or "embedded tiny model", "device": a.device, "dtype": a.dtype,
            "context": a.context, "reps": a.reps, "bandwidth_gbps": round(bw / 1e9, 1), "bandwidth_source": source,
            "paths": [name for name, *_ in paths], "rows": out, "fused_norms": eng.fused_norms,
            "kernel_config": str(getattr(runner.kernel, "config", "")) or None}


def decode_paths(runner, fused_norms: int = 0) -> list[tuple[str, object, object, bool]]:
    """(name, kernel, graphs, norms fused) of each way the runner can run a decode step, the
    engine's own first: CUDA graphs over the paged kernel; where the engine fused its RMSNorms,
    graphs captured with transformers' own norms (`unfused`); the kernel run eagerly; pages
    gathered for torch attention."""
    paths = []
    g = runner.graphs
    if g is not None:
        paths.append(("graphs", runner.kernel, g, True))
        if fused_norms:
            from pdtb.engine.cuda_graphs import DecodeGraphs

            plain = DecodeGraphs(runner.model, runner.kv, runner.page_size, runner.kernel,
                                 max_rows=g.buckets[-1], max_len=g.width * g.page_size)
            paths.append(("unfused", runner.kernel, plain, False))
    if runner.kernel is not None:
        paths.append((getattr(runner.kernel, "name", "kernel"), runner.kernel, None, True))
    paths.append(("gather", None, None, True))
    return paths


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        res = run(a)
    except ValueError as e:
        raise CliError(str(e).splitlines()[0]) from None
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"roofline: {res['model']} on {res['device']} ({res['dtype']}), context {res['context']}, "
          f"bandwidth {res['bandwidth_gbps']} GB/s ({res['bandwidth_source']}), median of {res['reps']}")
    others = res["paths"][1:]
    print(f"  decode path: {res['paths'][0]}" + (f" (also timed: {', '.join(others)})" if others else ""))
    print(f"  {'batch':>5} {'step ms':>9} {'MB read+written':>16} {'roofline ms':>12} {'fraction':>9} {'tokens/s':>10}"
          + "".join(f" {name + ' ms':>12} {'fraction':>9}" for name in others))
    for r in res["rows"]:
        print(f"  {r['batch']:>5} {r['step_ms']:>9.3f} {r['bytes_mb']:>16.1f} {r['roofline_ms']:>12.3f} "
              f"{r['fraction']:>9.3f} {r['tokens_per_s']:>10.1f}"
              + "".join(f" {r[name + '_ms']:>12.3f} {r[name + '_fraction']:>9.3f}" for name in others))
    return 0


if __name__ == "__main__":
    sys.exit(main())
