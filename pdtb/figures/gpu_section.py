"""The "On a GPU" section of `docs/results.md` from one `scripts/gpu_check.sh --out DIR` run.

The "On a GPU" section of docs/results.md, rendered from one `scripts/gpu_check.sh --out DIR`
run: the GPU tests' outcome, the engine against `generate`, the decode roofline of a
Llama-3-8B shape and the decode kernel's launch settings.

    python -m pdtb.figures.results_doc --section gpu --gpu DIR [--commit-file F] --out docs/results.md
"""
from __future__ import annotations

import json
from pathlib import Path

GPU_HEADING = "## On a GPU"
# what each decode path `pdtb bench roofline --compare` times beside the engine's own
PATHS = {"unfused": "CUDA graphs with transformers' own RMSNorms", "triton": "the paged kernel run eagerly",
         "gather": "the pages gathered for torch attention, eagerly"}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(d: Path) -> str:
    log = d / "tests.log"
    if not log.exists():
        return "not run"
    lines = [ln.strip("= ") for ln in log.read_text().splitlines() if " passed" in ln or " failed" in ln]
    return lines[-1] if lines else "no summary line"


def engine_rows(d: Path) -> list[str]:
    out = []
    for name, label in (("engine-fp32", "float32, CUDA graphs"), ("engine-bf16", "bfloat16, CUDA graphs"),
                        ("engine-bf16-eager", "bfloat16, no graphs")):
        r = _load(d / f"{name}.json")
        if r:
            out.append(f"| {label} | {r['paged_tok_s']:.0f} | {r['hf_padded_tok_s']:.0f} | **{r['ratio']:.2f}x** "
                       f"| {r['ratio_paired_median']:.2f}x | {r['step_ms_median']:.2f} |")
    return out


def roofline_rows(r: dict, copy_gbps: float | None) -> list[str]:
    others = r["paths"][1:]
    head = ("| batch | step ms | roofline ms | **fraction** |"
            + (" fraction at the measured copy rate |" if copy_gbps else "")
            + "".join(f" {p} ms |" for p in others))
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for x in r["rows"]:
        cells = [str(x["batch"]), f"{x['step_ms']:.2f}", f"{x['roofline_ms']:.2f}", f"**{x['fraction']:.2f}**"]
        if copy_gbps:
            cells.append(f"{1000 * x['bytes_mb'] / copy_gbps / 1e3 / x['step_ms']:.2f}")
        cells += [f"{x[p + '_ms']:.2f}" for p in others]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def kernel_rows(k: dict) -> list[str]:
    from pdtb.engine.triton_decode import KernelConfig

    c = KernelConfig()
    out = ["| rows | KV MB | device copy GB/s (read + written) | engine's setting GB/s | best setting | best GB/s |",
           "|---|---|---|---|---|---|"]
    for r in k["rows"]:
        mine = [s for s in r["settings"] if str(s["splits"]).startswith("auto")
                and KernelConfig(**{f: s[f] for f in KernelConfig.__dataclass_fields__ if f in s}) == c]
        b = r["best"]
        best = (f"{b['block_n']} keys, {b['num_warps']} warps, {b['num_stages']} stages, "
                f"{'head-major, ' if b.get('head_major') else ''}{b['splits']} span(s)")
        out.append(f"| {r['batch']} | {r['bytes_mb']} | {r['copy_gbps']:.0f} | {mine[0]['gbps']:.0f} |" if mine else
                   f"| {r['batch']} | {r['bytes_mb']} | {r['copy_gbps']:.0f} | - |")
        out[-1] += f" {best} | {b['gbps']:.0f} |"
    return out


def gpu_section(d: str, stamp: str) -> list[str]:
    d = Path(d)
    env = (d / "env.txt").read_text().strip().replace("\n", "; ") if (d / "env.txt").exists() else "?"
    out = [GPU_HEADING, "", f"`PDTB_SYSTEM_PYTHON=1 bash scripts/gpu_check.sh` {stamp}: {env}.", "",
           f"GPU tests (the Triton kernels against float64, the fused RMSNorm against transformers' own, the "
           f"engine with the Triton kernels and CUDA graphs "
           f"token-identical to `generate`, one-sided writes into a GPU pool over CUDA IPC, a 1P+1D cluster on "
           f"one GPU over CUDA IPC token-identical to `generate`, and the rest of `tests/engine/test_cuda.py`): "
           f"{_tests(d)}.", ""]
    rows = engine_rows(d)
    if rows:
        out += ["`pdtb bench engine --device cuda --batch 32 [--dtype bfloat16] [--cuda-graphs off]`: the embedded "
                "model, 32 prompts of about 64 tokens, 128 new tokens each, against `generate` on a padded batch "
                "in the same run (best of 5 interleaved runs; the paired ratio is the median over them).", "",
                "| engine | paged tok/s | generate tok/s | ratio | paired ratio | median decode step (ms) |",
                "|---|---|---|---|---|---|", *rows, ""]
    roof = _load(d / "roofline-llama-3-8b.json")
    kern = _load(d / "kernel.json")
    copy = max((r["copy_gbps"] for r in kern["rows"]), default=None) if kern else None
    if roof:
        out += [f"`pdtb bench roofline --device cuda --random-init llama-3-8b --compare`: decode steps of a "
                f"Llama-3-8B shape with random weights in {roof['dtype']}, every row {roof['context']} tokens of "
                f"context, median of {roof['reps']}. The roofline is the bytes of weights and KV a step must move "
                f"over {roof['bandwidth_gbps']:.0f} GB/s ({roof['bandwidth_source']}); the fraction is roofline / "
                f"step time."
                + (f" The next column uses the device-to-device copy rate `pdtb bench decode-kernel` measured in "
                   f"the same run ({copy:.0f} GB/s, bytes read plus written) instead." if copy else "")
                + f" The engine's path is {roof['paths'][0]}"
                + (f" with its {roof['fused_norms']} RMSNorms fused" if roof.get("fused_norms") else "")
                + "; on the same rows, " + "; ".join(f"`{p}`: {PATHS.get(p, p)}" for p in roof["paths"][1:])
                + f". Kernel settings: `{roof.get('kernel_config')}`.", "", *roofline_rows(roof, copy), ""]
    if kern:
        out += [f"`pdtb bench decode-kernel`: one layer's decode attention ({kern['heads']} query heads, "
                f"{kern['kv_heads']} KV heads of {kern['head_dim']}, {kern['dtype']}, {kern['context']} keys a row "
                f"on scattered pages of {kern['page_size']}), GB/s of KV read; on the GPU each call is a CUDA graph "
                f"replayed {kern['reps']} times (mean), as the engine runs it.", "",
                *kernel_rows(kern), ""]
    return out


def gpu_page(d: str, stamp: str) -> str:
    """docs/gpu-results.md: the section as a page of its own."""
    body = gpu_section(d, stamp)
    return "\n".join(["# On a GPU", "", "Written by `PDTB_SYSTEM_PYTHON=1 bash scripts/gpu_check.sh` on a machine with a "
                      "GPU; scripts/results.sh, which writes [results.md](results.md), runs where there may be none. "
                      "What the check runs: [gpu.md](gpu.md).", "", *body[2:]]).rstrip("\n") + "\n"
