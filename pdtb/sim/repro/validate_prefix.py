"""`pdtb sim validate-prefix REAL SIM [REAL SIM ...]`: prefix sharing, simulated against real.

Each pair is a real replay of a trace with shared blocks (`scripts/prefix_results.sh`) and the
same flags through `pdtb sim`. Targets: the achieved hit rate (prompt tokens the prompt nodes did
not compute, over those looked up) within 2 points, TTFT p50 within 15%.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdtb.common import CliError
from pdtb.figures.results import load_results

HIT_POINTS = 0.02  # hit rate: |sim - real| at most
TTFT_P50 = 0.15  # TTFT p50: |sim / real - 1| at most


def compare(real: dict, sim: dict) -> dict:
    r, s = real["summary"], sim["summary"]
    hr, hs = r.get("prefix_hit_rate"), s.get("prefix_hit_rate")
    tr, ts = r["overall"]["ttft_ms"]["p50"], s["overall"]["ttft_ms"]["p50"]
    ratio = ts / tr if tr and ts is not None else None
    return {"workload": real["meta"].get("workload"), "ideal": r.get("prefix_hit_rate_ideal"),
            "hit_rate": {"real": hr, "sim": hs, "points": None if hr is None or hs is None else hs - hr,
                         "ok": hr is not None and hs is not None and abs(hs - hr) <= HIT_POINTS + 1e-12},
            "ttft_p50_ms": {"real": tr, "sim": ts, "ratio": ratio,
                            "ok": ratio is not None and abs(ratio - 1) <= TTFT_P50 + 1e-9},
            "cost": sim["meta"].get("cost")}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb sim validate-prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", metavar="REAL SIM", help="pairs of results files")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the comparison as JSON here too")
    a = ap.parse_args(argv)
    if len(a.files) % 2:
        raise CliError("pdtb sim validate-prefix: give results files in pairs, REAL SIM")
    try:
        rows = [compare(load_results(Path(x)), load_results(Path(y))) for x, y in zip(a.files[::2], a.files[1::2])]
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"pdtb sim validate-prefix: {e}") from None
    doc = {"rows": rows, "targets": {"hit_rate_points": HIT_POINTS, "ttft_p50": TTFT_P50}}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    if a.json:
        print(json.dumps(doc))
    else:
        for row in rows:
            h, t = row["hit_rate"], row["ttft_p50_ms"]
            print(f"{row['workload']}: hit rate real {h['real']}, sim {h['sim']} ({'ok' if h['ok'] else 'OFF'}); "
                  f"TTFT p50 real {t['real']} ms, sim {t['sim']} ms ({'ok' if t['ok'] else 'OFF'})")
    return 0
