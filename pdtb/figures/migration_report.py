"""The tables of `scripts/migration_results.sh` (and `results_doc --section migration`).

`python -m pdtb.figures.migration_report DIR`: the live-migration figures of scripts/migration_results.sh.

Reads DIR/downtime-{precopy,stopcopy}.json (`pdtb bench migration`) and DIR/rebalance-{off,pressure,fair}[-sN].json
(`pdtb bench serve`, whale-minnow on 1 prefill + 2 decode nodes), whichever exist; prints one
table per experiment and writes them as markdown (--out). Every ratio is between runs of the
same invocation, on the same machine.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from pdtb.figures.results import print_markdown

MODES = ("off", "pressure", "fair")


def _load(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.exists() else None


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def downtime_table(d: Path) -> list[str]:
    runs = {k: r for k in ("precopy", "stopcopy") if (r := _load(d / f"downtime-{k}.json")) is not None}
    if not runs:
        return []
    rows = ["| transfer | moved | failed | downtime p50 ms | p99 ms | client gap p50 ms | ITL p50 ms | "
            "precopy MB (p50) | precopy ms | final MB (p50) | final ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in runs.items():
        pb, fb = r["precopy_bytes"]["p50"], r["final_bytes"]["p50"]
        rows.append(f"| {'precopy + final' if k == 'precopy' else 'stop-and-copy'} | {r['moves_done']} | "
                    f"{len(r['moves_failed'])} | {_ms(r['downtime_s']['p50'])} | {_ms(r['downtime_s']['p99'])} | "
                    f"{_ms(r['client_gap_s']['p50'])} | {_ms(r['itl_s']['p50'])} | {_f(pb and pb / 1e6, 3)} | "
                    f"{_ms(r['precopy_s']['p50'])} | {_f(fb and fb / 1e6, 3)} | {_ms(r['final_s']['p50'])} |")
    rows.append("")
    for k, r in runs.items():
        ratio = r.get("downtime_p50_over_itl_p50")
        if ratio is not None:
            rows.append(f"- {k}: downtime p50 / the same run's ITL p50 = **{ratio:.2f}x**")
    pre, stop = runs.get("precopy"), runs.get("stopcopy")
    if pre and stop and pre["downtime_s"]["p50"] and stop["downtime_s"]["p50"]:
        rows.append(f"- downtime p50, stop-and-copy / precopy: **{stop['downtime_s']['p50'] / pre['downtime_s']['p50']:.2f}x**; "
                    f"bytes sent while paused (final p50), stop-and-copy / precopy: "
                    f"{(stop['final_bytes']['p50'] or 0) / max(1, pre['final_bytes']['p50'] or 1):.1f}x")
    return rows + [""]


def _class(res: dict, tenant: str) -> dict:
    return res["summary"]["per_tenant"].get(tenant) or {}


def _migrations(p: Path) -> dict:
    """Outcome counts of the run's migrations (NAME.migrations.json: /cluster/migrations at its end)."""
    m = _load(p.with_suffix(".migrations.json"))
    return (m or {}).get("counts") or {}


def rebalance_table(d: Path) -> list[str]:
    runs: dict[str, list[tuple[str, dict, dict]]] = {}  # mode -> (seed, results, migration counts)
    for p in sorted(d.glob("rebalance-*.json")):
        m = re.fullmatch(r"rebalance-([a-z]+)(?:-s(\d+))?\.json", p.name)
        if m and m.group(1) in MODES:
            runs.setdefault(m.group(1), []).append((m.group(2) or "-", json.loads(p.read_text()), _migrations(p)))
    if not runs:
        return []
    rows = ["| --rebalance | seed | minnow TTFT p50 ms | p99 ms | minnow ITL p99 ms | minnows ok | whale ITL p99 ms | "
            "whale E2E max s | output tok/s | moves done | failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for seed, r, mig in runs.get(mode, []):
            mn, wh, ov = _class(r, "minnow"), _class(r, "whale"), r["summary"]["overall"]
            rows.append(f"| {mode} | {seed} | {_f(mn.get('ttft_ms', {}).get('p50'))} | "
                        f"{_f(mn.get('ttft_ms', {}).get('p99'))} | {_f(mn.get('itl_ms', {}).get('p99'))} | "
                        f"{mn.get('count', 0) - mn.get('failed', 0)}/{mn.get('count', 0)} | "
                        f"{_f(wh.get('itl_ms', {}).get('p99'))} | {_f((wh.get('e2e_ms', {}).get('max') or 0) / 1e3)} | "
                        f"{_f(ov.get('output_tok_s'))} | "
                        f"{mig.get('done', 0)} | {mig.get('failed', 0)} |")
    rows.append("")
    base = {seed: r for seed, r, _ in runs.get("off", [])}
    for mode in ("pressure", "fair"):
        for seed, r, _ in runs.get(mode, []):
            b = base.get(seed)
            if b is None:
                continue
            t, tb = _class(r, "minnow").get("ttft_ms", {}).get("p99"), _class(b, "minnow").get("ttft_ms", {}).get("p99")
            i, ib = _class(r, "minnow").get("itl_ms", {}).get("p99"), _class(b, "minnow").get("itl_ms", {}).get("p99")
            o, ob = r["summary"]["overall"].get("output_tok_s"), b["summary"]["overall"].get("output_tok_s")
            if t and tb and i and ib and o and ob:
                rows.append(f"- seed {seed}: {mode} against off: minnow TTFT p99 "
                            f"**{t / tb:.2f}x**, minnow ITL p99 **{i / ib:.2f}x**, output throughput {o / ob:.2f}x")
    return rows + [""]


def report(d: Path) -> list[str]:
    out = []
    dt = downtime_table(d)
    if dt:
        out += ["### Migration downtime", "", *dt]
    rb = rebalance_table(d)
    if rb:
        out += ["### Rebalancing whales and minnows (1 prefill + 2 decode nodes)", "", *rb]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.figures.migration_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    print_markdown(report(Path(a.dir)), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
