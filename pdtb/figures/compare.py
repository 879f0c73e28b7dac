"""`pdtb compare [--markdown]`: per-run figures with ratios vs the baseline policy, and what the
whale class paid (TTFT, TPOT p50).

`pdtb compare RESULTS.json ...`: one line per run with the headline fairness figures, and
ratios against the baseline policy of the same mode measured in the same run of the script;
then, when the runs have a `--cost-class` (default whale), what that class paid: its TTFT p50,
TPOT p50 and end-to-end p50 (with its ratio to the baseline).

    mode  policy  minnow TTFT p99 (x fcfs)  minnow ITL p99 (x fcfs)  output tok/s (x fcfs)  failed
          fair-share worst (the fair-share Jain index's worst window)  whale TTFT p50  whale TPOT p50
          whale E2E p50 (x fcfs)
"""
from __future__ import annotations

import argparse
import json

from pdtb.figures.results import load_results


def rows_of(paths: list[str], klass: str, cost_class: str | None = None) -> list[dict]:
    rows = []
    for p in paths:
        r = load_results(p)
        m, s = r["meta"], r["summary"]
        c = s["per_class"].get(klass)  # a run without that class shows "-", not other figures
        w = s["per_class"].get(cost_class) if cost_class else None
        rows.append({"mode": m.get("mode"), "policy": m.get("policy"), "file": p,
                     "ttft_p99_ms": c["ttft_ms"]["p99"] if c else None, "itl_p99_ms": c["itl_ms"]["p99"] if c else None,
                     "tok_s": s["overall"]["output_tok_s"], "failed": s["overall"]["failed"],
                     "share_jain_min": s.get("fairness", {}).get("share_jain_min"),
                     "cost_ttft_p50_ms": w["ttft_ms"]["p50"] if w else None,
                     "cost_tpot_p50_ms": w["tpot_ms"]["p50"] if w else None,
                     "cost_e2e_p50_ms": w["e2e_ms"]["p50"] if w and "e2e_ms" in w else None})
    return rows


def with_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Ratios against the one `baseline` run of each mode. Raises ValueError when a mode has
    several (which one is the baseline would be a guess)."""
    base: dict = {}
    for r in rows:
        if r["policy"] == baseline:
            if r["mode"] in base:
                raise ValueError(f"several {baseline} runs in mode {r['mode']}: {base[r['mode']]['file']} and "
                                 f"{r['file']}; compare one run's results at a time")
            base[r["mode"]] = r
    for r in rows:
        b = base.get(r["mode"])
        for k in ("ttft_p99_ms", "itl_p99_ms", "tok_s", "cost_e2e_p50_ms"):
            ok = b is not None and b.get(k) and r.get(k) is not None
            r[f"{k}_ratio"] = r[k] / b[k] if ok else None
    return rows


def _f(v, d=1):
    return "-" if v is None else f"{v:.{d}f}"


def ordered(rows: list[dict], baseline: str) -> list[dict]:
    """Mode by mode, the baseline first, then the policies by name."""
    return sorted(rows, key=lambda r: (r["mode"] or "", r["policy"] != baseline, r["policy"] or ""))


def markdown_table(rows: list[dict], klass: str, baseline: str, cost_class: str | None) -> list[str]:
    """The comparison as a markdown table (lines), ratios in bold where they are below 1."""
    costs = cost_class and any(r["cost_ttft_p50_ms"] is not None for r in rows)
    head = ["mode", "policy", f"{klass} TTFT p99 (ms)", f"x {baseline}", f"{klass} ITL p99 (ms)", f"x {baseline}",
            "output tok/s", f"x {baseline}", "failed", "fair-share worst"]
    if costs:
        head += [f"{cost_class} TTFT p50 (ms)", f"{cost_class} TPOT p50 (ms)", f"{cost_class} E2E p50 (ms)",
                 f"x {baseline}"]

    def ratio(v):
        return "-" if v is None else (f"**{v:.2f}**" if v < 1 else f"{v:.2f}")

    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ordered(rows, baseline):
        cells = [r["mode"] or "?", r["policy"] or "?", _f(r["ttft_p99_ms"]), ratio(r["ttft_p99_ms_ratio"]),
                 _f(r["itl_p99_ms"]), ratio(r["itl_p99_ms_ratio"]), _f(r["tok_s"]), _f(r["tok_s_ratio"], 2),
                 str(r["failed"]), _f(r["share_jain_min"], 3)]
        if costs:
            cells += [_f(r["cost_ttft_p50_ms"], 0), _f(r["cost_tpot_p50_ms"]), _f(r.get("cost_e2e_p50_ms"), 0),
                      _f(r.get("cost_e2e_p50_ms_ratio"), 2)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb compare", description=__doc__)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--class", dest="klass", default="minnow", help="request class to compare (default minnow)")
    ap.add_argument("--baseline", default="fcfs")
    ap.add_argument("--cost-class", default="whale", help="class whose TTFT/TPOT p50 show what it paid (default whale)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table (docs/results.md)")
    a = ap.parse_args(argv)
    try:
        rows = with_ratios(rows_of(a.results, a.klass, a.cost_class), a.baseline)
    except ValueError as e:
        ap.error(str(e))
    if a.json:
        print(json.dumps(rows))
        return 0
    if a.markdown:
        print("\n".join(markdown_table(rows, a.klass, a.baseline, a.cost_class)))
        return 0
    costs = any(r["cost_ttft_p50_ms"] is not None for r in rows)
    print(f"{'mode':10} {'policy':9} {a.klass + ' TTFT p99 ms':>18} {'x' + a.baseline:>7} "
          f"{a.klass + ' ITL p99 ms':>17} {'x' + a.baseline:>7} {'output tok/s':>12} {'x' + a.baseline:>7} {'failed':>6}"
          f" {'fair-share worst':>16}"
          f"{'  ' + a.cost_class + ' TTFT p50 ms' if costs else ''}{'  ' + a.cost_class + ' TPOT p50 ms' if costs else ''}"
          f"{'  ' + a.cost_class + ' E2E p50 ms' if costs else ''}{'  x' + a.baseline if costs else ''}")
    labels = [(r["mode"], r["policy"]) for r in rows]
    for r in ordered(rows, a.baseline):
        twin = labels.count((r["mode"], r["policy"])) > 1  # same labels: say which file it is
        print(f"{r['mode'] or '?':10} {r['policy'] or '?':9} {_f(r['ttft_p99_ms']):>18} {_f(r['ttft_p99_ms_ratio'], 2):>7} "
              f"{_f(r['itl_p99_ms']):>17} {_f(r['itl_p99_ms_ratio'], 2):>7} {_f(r['tok_s']):>12} "
              f"{_f(r['tok_s_ratio'], 2):>7} {r['failed']:>6} {_f(r['share_jain_min'], 3):>16}"
              + (f"  {_f(r['cost_ttft_p50_ms']):>{len(a.cost_class) + 12}}  {_f(r['cost_tpot_p50_ms']):>{len(a.cost_class) + 12}}"
                 f"  {_f(r['cost_e2e_p50_ms']):>{len(a.cost_class) + 11}}  {_f(r['cost_e2e_p50_ms_ratio'], 2):>{len(a.baseline) + 3}}"
                 if costs else "") + (f"  ({r['file']})" if twin else ""))
    return 0
