"""`pdtb scorecard DIR`: every policy of every scenario in one table per scenario, each figure
beside fcfs's of the same scenario, the Pareto points marked.

DIR holds one folder per scenario (scripts/scorecard.sh writes them):
- run folders: one results file per policy (`pdtb bench serve` / `pdtb sim --out`), LABEL.json;
- sweep folders (their name ends in "-frontier"): one sweep file per policy (`pdtb bench sweep`).

Whales and minnows: the workload's classes "whale" and "minnow" where it has them; otherwise the
largest 5% of requests by context (prompt + output) are the whales, the essay's definition.

Per run: minnow TTFT p99 and ITL p99, whale TPOT p50 and E2E p50 (ms), output tok/s, goodput
(requests/s meeting the run's SLO targets, or all finished requests without targets), Jain's
index over tenants' page-seconds per weight (the tenants' device pages sampled on every decode
and colocated node, times the sampling interval) and, for simulated runs, tier moves (demotions, promotions,
preemptions) per second per 100 running requests and the simulator's wall time per step.
Per sweep: output tok/s at saturation and max goodput, and the minnows' p99s at the second load.
A point is Pareto when no other of its scenario is at least as good on every figure marked
for it and better on one: minnow TTFT p99, minnow ITL p99, whale E2E p50 (lower) and output
tok/s (higher); in a sweep, minnow TTFT p99 (lower), saturation tok/s and max goodput (higher).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdtb.figures.service import jain_index
from pdtb.figures.summary import percentile as summary_percentile
from pdtb.common import CliError

SCORECARD_HEADING = "## Scorecard: every policy, five scenarios"
TOP_FRAC = 0.05  # whales, where the workload does not say: the largest 5% of requests by context
RUN_KEYS = ("minnow_ttft_p99", "minnow_itl_p99", "whale_tpot_p50", "whale_e2e_p50", "out_tok_s", "goodput_rps",
            "jain_page_s", "moves_per_s_per_100", "sim_ms_per_step")
RUN_PARETO = {"minnow_ttft_p99": -1, "minnow_itl_p99": -1, "whale_e2e_p50": -1, "out_tok_s": 1}
SWEEP_KEYS = ("minnow_ttft_p99", "minnow_itl_p99", "saturation_tok_s", "max_goodput_rps")
SWEEP_PARETO = {"minnow_ttft_p99": -1, "saturation_tok_s": 1, "max_goodput_rps": 1}
HEADS = {"minnow_ttft_p99": "minnow TTFT p99 ms", "minnow_itl_p99": "minnow ITL p99 ms",
         "whale_tpot_p50": "whale TPOT p50 ms", "whale_e2e_p50": "whale E2E p50 ms", "out_tok_s": "out tok/s",
         "goodput_rps": "goodput req/s", "jain_page_s": "Jain page-s", "moves_per_s_per_100": "moves/s/100 running",
         "sim_ms_per_step": "sim ms/step", "saturation_tok_s": "saturation tok/s", "max_goodput_rps": "max goodput req/s"}


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of unsorted `xs` (summary.percentile's rule); None if empty."""
    return summary_percentile(sorted(xs), q) if xs else None


def classes(requests: list[dict]) -> list[str]:
    """'whale' or 'minnow' per request (see the module doc)."""
    named = {r.get("class") for r in requests}
    if {"whale", "minnow"} & named:
        return ["whale" if r.get("class") == "whale" else "minnow" for r in requests]
    size = [r["prompt_tokens"] + r.get("requested_output_tokens", r.get("output_tokens", 0)) for r in requests]
    k = max(1, round(TOP_FRAC * len(requests))) if requests else 0
    top = set(sorted(range(len(requests)), key=lambda i: (-size[i], i))[:k])
    return ["whale" if i in top else "minnow" for i in range(len(requests))]


def page_seconds(doc: dict, weights: dict | None = None) -> dict[str, float]:
    """Tenant -> device page-seconds per weight over the run's samples, on the decode and
    colocated nodes (the pool the shares split; a prompt on a prefill node is counted there
    once it is handed off)."""
    out: dict[str, float] = {}
    samples = doc.get("samples") or []
    for a, b in zip(samples, samples[1:]):
        dt = b["t"] - a["t"]
        for n in a.get("nodes", []):
            if n.get("role", "decode") == "prefill":
                continue
            for t, pages in (n.get("tenant_pages") or {}).items():
                out[t] = out.get(t, 0.0) + pages * dt / float((weights or {}).get(t, 1.0))
    return out


def run_figures(doc: dict) -> dict:
    """One run's figures (see the module doc)."""
    reqs = doc["requests"]
    kinds = classes(reqs)
    ttft, itl, tpot, e2e = {"whale": [], "minnow": []}, {"whale": [], "minnow": []}, {"whale": []}, {"whale": []}
    for r, k in zip(reqs, kinds):
        if r.get("status") != "ok" or r.get("first_token_time") is None:
            continue
        ttft[k].append(1000.0 * (r["first_token_time"] - r["send_time"]))
        times = r.get("token_times") or []
        itl[k] += [1000.0 * (b - a) for a, b in zip(times, times[1:])]
        if k == "whale":
            e2e["whale"].append(1000.0 * (r["end_time"] - r["send_time"]))
            if len(times) > 1:
                tpot["whale"].append(1000.0 * (times[-1] - times[0]) / (len(times) - 1))
    overall = doc["summary"]["overall"]
    weights = ((doc.get("meta") or {}).get("options") or {}).get("tenant_weights")
    ps = page_seconds(doc, weights if isinstance(weights, dict) else None)
    out = {"minnow_ttft_p99": percentile(ttft["minnow"], 99), "minnow_itl_p99": percentile(itl["minnow"], 99),
           "whale_tpot_p50": percentile(tpot["whale"], 50), "whale_e2e_p50": percentile(e2e["whale"], 50),
           "out_tok_s": overall.get("output_tok_s"), "goodput_rps": overall.get("goodput_rps"),
           "jain_page_s": jain_index(list(ps.values())), "moves_per_s_per_100": None, "sim_ms_per_step": None,
           "requests": len(reqs), "failed": overall.get("failed", 0)}
    sim = (doc.get("meta") or {}).get("sim")
    if sim:
        moves = sum(sum(v.values()) for v in (sim.get("evictions") or {}).values())
        running = [sum(n.get("running", 0) for n in s.get("nodes", [])) for s in doc.get("samples") or []]
        mean_running = sum(running) / len(running) if running else 0.0
        span = sim.get("simulated_s") or 0.0
        if span > 0 and mean_running > 0:
            out["moves_per_s_per_100"] = moves / span / (mean_running / 100.0)
        steps = sum((sim.get("steps") or {}).values()) if isinstance(sim.get("steps"), dict) else sim.get("steps")
        if steps:
            out["sim_ms_per_step"] = 1000.0 * sim["wall_s"] / steps
    return out


def sweep_figures(doc: dict) -> dict:
    from pdtb.figures.frontier import point

    levels = sorted({lv["load"] for lv in doc["levels"]})
    at = levels[1] if len(levels) > 1 else (levels[0] if levels else 0.0)
    p = point(doc, "minnow", at)
    return {"minnow_ttft_p99": p["ttft_p99_ms"], "minnow_itl_p99": p["itl_p99_ms"],
            "saturation_tok_s": p["saturation_tok_s"], "max_goodput_rps": p["max_goodput_rps"], "at_load": at}


def pareto(rows: list[dict], sense: dict[str, int]) -> list[bool]:
    """Per row: True unless another row is at least as good on every key of `sense` (-1 lower
    is better, +1 higher) and strictly better on one. A missing figure is the worst."""
    def v(r, k):
        x = r.get(k)
        return (float("-inf") if x is None else sense[k] * x)
    out = []
    for r in rows:
        dominated = any(q is not r and all(v(q, k) >= v(r, k) for k in sense) and any(v(q, k) > v(r, k) for k in sense)
                        for q in rows)
        out.append(not dominated)
    return out


def scenario(folder: Path) -> dict:
    """One scenario's rows: figures per policy, ratios to fcfs, Pareto marks."""
    sweep = folder.name.endswith("-frontier")
    rows = []
    for f in sorted(folder.glob("*.json")):
        doc = json.loads(f.read_text())
        if sweep and (doc.get("meta") or {}).get("kind") != "sweep":
            continue
        if not sweep and "requests" not in doc:
            continue
        figs = sweep_figures(doc) if sweep else run_figures(doc)
        rows.append({"label": f.stem, "policy": (doc.get("meta") or {}).get("policy", f.stem), **figs})
    keys, sense = (SWEEP_KEYS, SWEEP_PARETO) if sweep else (RUN_KEYS, RUN_PARETO)
    base = next((r for r in rows if r["label"] == "fcfs"), None)
    for r, front in zip(rows, pareto(rows, sense)):
        r["pareto"] = front
        r["ratio"] = {k: (r[k] / base[k] if base and r.get(k) is not None and base.get(k) else None) for k in keys}
    return {"name": folder.name, "kind": "sweep" if sweep else "run", "keys": list(keys), "rows": rows}


def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 1 and digits else f"{x:,.{digits}f}"


def table(sc: dict) -> list[str]:
    keys = sc["keys"]
    head = ["policy", "Pareto"] + [HEADS[k] for k in keys]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sc["rows"]:
        cells = [r["label"], "**yes**" if r["pareto"] else ""]
        for k in keys:
            ratio = r["ratio"].get(k)
            cell = fmt(r.get(k))
            if ratio is not None and r["label"] != "fcfs" and k not in ("jain_page_s", "sim_ms_per_step",
                                                                         "moves_per_s_per_100"):
                cell += f" ({ratio:.2f}x)"
            cells.append(cell)
        out.append("| " + " | ".join(cells) + " |")
    return out


REPEAT_KEYS = ("minnow_ttft_p99", "minnow_itl_p99", "whale_tpot_p50", "whale_e2e_p50", "out_tok_s", "goodput_rps")


def noise_verdict(ratios: list[float], spread: float | None) -> str:
    """Whether a policy's ratios to fcfs leave the run-to-run spread: "beyond noise" when every
    repeat's ratio lies outside [1/spread, spread] on the same side, else "within noise"."""
    if not ratios or spread is None:
        return "-"
    if all(r > spread for r in ratios) or all(r < 1 / spread for r in ratios):
        return "beyond noise"
    return "within noise"


def repeats_table(root: Path, policy: str = "memfair") -> list[str]:
    """Run-to-run noise of the real quick scenario: DIR/repeats/r*/MODE-{fcfs,POLICY}.json
    (scripts/scorecard.sh --repeats N), each figure's POLICY/fcfs ratio in every repeat, the run-to-run
    spread (largest over smallest across repeats) of fcfs's figure and of POLICY's, the larger of
    the two, and whether the ratios leave it. [] without repeats."""
    runs = sorted(d for d in (root / "repeats").glob("r*") if d.is_dir()) if (root / "repeats").is_dir() else []
    out = []
    for mode in ("colocated", "disagg"):
        pairs = []
        for d in runs:
            a, b = d / f"{mode}-{policy}.json", d / f"{mode}-fcfs.json"
            if a.exists() and b.exists():
                pairs.append((run_figures(json.loads(a.read_text())), run_figures(json.loads(b.read_text()))))
        if len(pairs) < 2:
            continue
        if not out:
            out = [f"| mode | figure | {policy} / fcfs, each repeat | own spread, the larger of the two | the difference |",
                   "|---|---|---|---|---|"]
        for k in REPEAT_KEYS:
            ratios = [m[k] / f[k] for m, f in pairs if m.get(k) is not None and f.get(k)]
            spreads = []
            for own in ([f[k] for _, f in pairs if f.get(k)], [m[k] for m, _ in pairs if m.get(k)]):
                if own and min(own) > 0:
                    spreads.append(max(own) / min(own))
            spread = max(spreads) if len(spreads) == 2 else None
            out.append(f"| {mode} | {HEADS[k]} | {', '.join(f'{r:.2f}x' for r in ratios)} | "
                       f"{'-' if spread is None else f'{spread:.2f}x'} | {noise_verdict(ratios, spread)} |")
    return out


def results_section(folder: str, command: str, stamp: str) -> list[str]:
    """The scorecard section of docs/results.md from one scripts/scorecard.sh run."""
    root = Path(folder)
    text = (root / "scorecard.md").read_text().splitlines()
    out = [SCORECARD_HEADING, "", f"`{command}`, {stamp}. Every figure beside fcfs's in the same run; "
           "**yes**: on the Pareto front of its scenario (minnow TTFT and ITL p99, whale E2E p50, output tok/s). "
           "Whales: the workload's whale class, else the largest 5% of requests by context. "
           "What each scenario is: `bash scripts/scorecard.sh --help`.", ""]
    out += [line.replace("### ", "### Scenario ") if line.startswith("### ") else line for line in text]
    noise = repeats_table(root)
    if noise:
        out += ["### Run-to-run noise of the real quick scenario", "",
                "The real quick comparison of fcfs and memfair run again (`--repeats`; the first repeat "
                "the scenario's own runs where they are results.sh's). In brackets: the larger of fcfs's and "
                "memfair's own run-to-run spread (largest over smallest); **beyond noise**: memfair's ratio to fcfs "
                "leaves that spread the same way in every repeat; any other difference is within noise. The simulator is deterministic: its figures repeat exactly.", "", *noise, ""]
    top5 = root / "sim-essay-top5.json"
    if top5.exists():
        t = json.loads(top5.read_text())
        ev = t["evictions"]
        ratio = (lambda e: "inf (none alone)" if e["ratio"] is None and e["with_whales"] else
                 "-" if e["ratio"] is None else f"{e['ratio']:.2f}x")
        out += ["### The essay's claims with 5% whales in memory", "",
                "`pdtb sim reproduce essay --minnow-rate 4 --whale-interval 5 --whales 5` (one H100, colocated).", "",
                "| claim | this run | essay |", "|---|---|---|",
                f"| top-5% share of the KV in use, mean (fcfs) | {100 * t['top5']['used_mean']:.0f}% | ~80% |",
                f"| top-5% share of HBM, mean / max (fcfs) | {100 * t['top5']['pool_mean']:.0f}% / "
                f"{100 * t['top5']['pool_max']:.0f}% | |",
                f"| minnow evictions, with / without whales (fcfs) | {ratio(ev['fcfs'])} | 2-4x |",
                f"| same, memfair | {ratio(ev['memfair'])} | |",
                f"| memfair / fcfs, minnow TTFT p99 | {t['memfair_over_fcfs']['minnow_ttft_p99']:.2f}x | |",
                f"| memfair / fcfs, minnow ITL p99 | {t['memfair_over_fcfs']['minnow_itl_p99']:.2f}x | |", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb scorecard", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a scorecard folder (scripts/scorecard.sh --out)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    root = Path(a.dir)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.json"))) if root.is_dir() else []
    if not folders:
        raise CliError(f"scorecard: no scenario folders with results files in {a.dir}")
    cards = [scenario(f) for f in folders]
    if a.json:
        print(json.dumps(cards, indent=1))
        return 0
    lines = []
    for sc in cards:
        lines += [f"### {sc['name']}", "", *table(sc), ""]
    text = "\n".join(lines)
    (root / "scorecard.md").write_text(text)
    (root / "scorecard.json").write_text(json.dumps(cards, indent=1))
    print(text)
    noise = repeats_table(root)
    if noise:
        print("\n".join(["### run-to-run noise of the real quick scenario", "", *noise, ""]))
    return 0
