"""`pdtb report RESULTS.json [...] --out DIR`: a markdown report comparing runs side by side
(one column per run, labelled "mode/policy" from its meta) and PNG plots next to it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdtb.figures.slo_misses import TPOT_PARTS, TTFT_PARTS
from pdtb.figures.results import check_results, fmt, md_table, read_json, run_label

PLOTS = (("ttft_cdf.png", "TTFT CDF per class"), ("itl_cdf.png", "ITL CDF per class"),
         ("service.png", "accumulated service per tenant"), ("kv_pages.png", "KV pages over time"),
         ("p99_bars.png", "p99 TTFT and ITL per class"))

# (row label, path into a STATS dict, digits)
CLASS_ROWS = (("TTFT p50 (ms)", ("ttft_ms", "p50"), 1), ("TTFT p99 (ms)", ("ttft_ms", "p99"), 1),
              ("ITL p99 (ms)", ("itl_ms", "p99"), 1), ("TPOT p50 (ms)", ("tpot_ms", "p50"), 1),
              ("TPOT p99 (ms)", ("tpot_ms", "p99"), 1), ("output tok/s", ("output_tok_s",), 1),
              ("total tok/s (prompt + output)", ("total_tok_s",), 1), ("requests/s", ("request_rps",), 2),
              ("goodput (req/s)", ("goodput_rps",), 2), ("SLO attainment", ("slo_attainment",), 3),
              ("requests (failed)", None, 0))


def _tail(path: str, depth: int) -> str:
    return "/".join(Path(path).with_suffix("").parts[-depth:])


def labels_for(paths: list[str], runs: list[dict]) -> list[str]:
    """'mode/policy' per run, unique: a repeated label gets the file name added, then its
    parent folders as far as needed (a/r.json and b/r.json), or its position (a file twice)."""
    base = [run_label(r["meta"]) for r in runs]
    out = []
    for i, (b, p) in enumerate(zip(base, paths)):
        same = [q for q, c in zip(paths, base) if c == b]
        if len(same) == 1:
            out.append(b)
            continue
        depth = next((d for d in range(1, len(Path(p).parts) + 1)
                      if [_tail(q, d) for q in same].count(_tail(p, d)) == 1), None)
        out.append(f"{b} ({_tail(p, depth)})" if depth else f"{b} ({_tail(p, len(Path(p).parts))} #{i + 1})")
    return out


def _get(stats: dict | None, path):
    v = stats
    for k in path:
        v = None if v is None else v.get(k)
    return v


def markdown(runs: dict[str, dict]) -> str:
    """The report text for {label: results}."""
    labels = list(runs)
    out = ["# pd-testbed benchmark report", "", "## Runs", ""]
    out += md_table(["run", "workload", "arrival", "requests", "failed", "duration (s)", "seed"],
                  [[lab, f"`{r['meta'].get('workload')}`", str(r["meta"].get("arrival", "-")),
                    str(r["summary"]["overall"]["count"]), str(r["summary"]["overall"]["failed"]),
                    fmt(r["summary"].get("duration_s")), str(r["meta"].get("seed"))] for lab, r in runs.items()])
    groups = [("overall", lambda r: r["summary"]["overall"])]
    classes = sorted({c for r in runs.values() for c in r["summary"]["per_class"]})
    groups += [(f"class {c}", (lambda c: lambda r: r["summary"]["per_class"].get(c))(c)) for c in classes]
    rows = []
    for name, pick in groups:
        for row_label, path, digits in CLASS_ROWS:
            cells = []
            for r in runs.values():
                s = pick(r)
                cells.append("-" if s is None else (f"{s['count']} ({s['failed']})" if path is None
                                                   else fmt(_get(s, path), digits)))
            rows.append([f"**{name}** {row_label}"] + cells)
    for row_label, key, digits in (("fair-share Jain index, mean over windows", "share_jain_mean", 3),
                                   ("fair-share Jain index, worst window", "share_jain_min", 3),
                                   ("max service gap", "max_service_gap", 0),
                                   ("Jain index of completed / demanded service", "jain_index", 3)):
        rows.append([f"**fairness** {row_label}"] + [fmt(r["summary"]["fairness"].get(key), digits)
                                                      for r in runs.values()])
    out += ["", "## Side by side", "", "Latencies in ms over completed requests; goodput under each run's SLOs.", ""]
    out += md_table(["metric"] + labels, rows)
    attr_rows = attribution_rows(runs, classes)
    if attr_rows:
        out += ["", "## SLO attribution (from the nodes)", "",
                "Per class: requests whose final chunk carried the nodes' attribution, how many missed the "
                "nodes' SLO targets and the component each miss was blamed on, and the mean time per "
                "component (ms) over those requests.", ""]
        out += md_table(["metric"] + labels, attr_rows)
    out += ["", "## Plots", ""] + [f"### {title}\n\n![{title}]({name})\n" for name, title in PLOTS]
    return "\n".join(out) + "\n"


def attribution_rows(runs: dict[str, dict], classes: list[str]) -> list[list[str]]:
    """Rows of the attribution table; none when no run carried an attribution."""
    per = [r["summary"].get("slo_attribution", {}).get("per_class", {}) for r in runs.values()]
    if not any(g.get("requests") for p in per for g in p.values()):
        return []
    rows = []
    for c in classes:
        groups = [p.get(c) for p in per]
        rows.append([f"**class {c}** attributed (missed ttft / tpot)"] + [
            "-" if g is None else f"{g['requests']} ({g['missed'].get('ttft', 0)} / {g['missed'].get('tpot', 0)})"
            for g in groups])
        rows.append([f"**class {c}** causes of misses"] + [
            "-" if g is None else (", ".join(f"{k} {v}" for k, v in g["causes"].items()) or "-") for g in groups])
        seen = [k for k in (*TTFT_PARTS, *TPOT_PARTS) if any(g and g["mean_ms"].get(k) for g in groups)]
        rows += [[f"**class {c}** mean {k} (ms)"] + ["-" if g is None else fmt(g["mean_ms"].get(k), 1) for g in groups]
                 for k in seen]
    return rows


def write_report(paths: list[str], out_dir: str | Path) -> Path:
    """Load the results files, write report.md and the plots into out_dir; returns report.md."""
    from pdtb.figures import plots, sweep_report

    raw = [read_json(p) for p in paths]
    sweeps = [sweep_report.is_sweep(d) for d in raw]
    if any(sweeps):
        if not all(sweeps):
            raise ValueError("sweep files and serve results files go in separate reports")
        for d, p in zip(raw, paths):
            if not (isinstance(d.get("levels"), list) and isinstance(d.get("derived"), dict)):
                raise ValueError(f"{p}: not a sweep file (no 'levels' list and 'derived' object)")
        labels = [sweep_report.label(d) for d in raw]
        labels = [lab if labels.count(lab) == 1 else f"{lab} ({Path(p).stem})" for lab, p in zip(labels, paths)]
        return sweep_report.write(dict(zip(labels, raw)), Path(out_dir))
    loaded = [check_results(d, p) for d, p in zip(raw, paths)]  # (read once above)
    runs = dict(zip(labels_for(paths, loaded), loaded))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots.latency_cdfs(runs, out / "ttft_cdf.png", "ttft")
    plots.latency_cdfs(runs, out / "itl_cdf.png", "itl")
    plots.service_over_time(runs, out / "service.png")
    plots.kv_pages_over_time(runs, out / "kv_pages.png")
    plots.p99_bars(runs, out / "p99_bars.png")
    report = out / "report.md"
    report.write_text(markdown(runs))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb report", description="Compare benchmark results side by side.")
    ap.add_argument("results", nargs="+", help="results JSON files from `pdtb bench serve --out`, or sweep "
                                               "files from `pdtb bench sweep --out` (a report of their own)")
    ap.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    a = ap.parse_args(argv)
    try:
        report = write_report(a.results, a.out)
    except (OSError, ValueError) as e:
        print(f"pdtb report: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0
