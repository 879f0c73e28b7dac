"""`pdtb sim validate REAL_DIR SIM_DIR`: the simulator against the testbed, run by run.

Both folders hold results files of the same workload and cluster flags (`scripts/validate_sim.sh`
writes them: `scripts/compare_fairness.sh` on real clusters, then again with `--sim`). Runs pair
by (mode, policy). For each pair and request class: the sim/real ratio of TTFT and ITL p50/p99
and of output throughput, checked against the targets (p50s within 15%, p99s within 30%); per
mode, the order of the policies by the protected class's p99 TTFT and ITL, real against sim,
both exactly and beyond ties (real p99s within the p99 target of each other).

With `--also-real DIR` (repeatable), more real runs of the same flags: each real figure is then
the geometric mean over the runs that have it, a reference with less of one run's noise.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pdtb.figures.results import load_results
from pdtb.common import CliError

TARGETS = {"p50": 0.15, "p99": 0.30}  # |sim / real - 1| at most
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99"))


def load_dir(path: str) -> dict[tuple[str, str], dict]:
    """(mode, policy) -> results of every results file in `path`."""
    out = {}
    for f in sorted(Path(path).glob("*.json")):
        try:
            res = load_results(f)
        except (ValueError, OSError):
            continue  # calibration files and other JSON beside the runs
        meta = res["meta"]
        out[(meta.get("mode") or "?", meta.get("policy") or "?")] = res
    if not out:
        raise CliError(f"pdtb sim validate: no results files in {path}")
    return out


def mean_of(runs: list[dict]) -> dict:
    """One run's figures as the geometric mean of several real runs' (per class, over the runs
    whose figure is there and positive: a run without it, or with 0, leaves the others' mean):
    what compare_run and orderings read. `real_runs`: how many runs it is the mean of."""
    per_class: dict[str, dict] = {}
    for klass in sorted({c for r in runs for c in r["summary"]["per_class"]}):
        out: dict = {}
        for key, q in FIGURES:
            out.setdefault(key, {})[q] = _gmean([((r["summary"]["per_class"].get(klass) or {}).get(key) or {}).get(q)
                                                for r in runs])
        out["output_tok_s"] = _gmean([(r["summary"]["per_class"].get(klass) or {}).get("output_tok_s") for r in runs])
        per_class[klass] = out
    return {"meta": runs[0]["meta"], "summary": {"per_class": per_class}, "real_runs": len(runs)}


def _gmean(xs: list) -> float | None:
    xs = [float(x) for x in xs if x is not None and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def ratio(sim: float | None, real: float | None) -> float | None:
    return sim / real if sim is not None and real else None


def compare_run(real: dict, sim: dict) -> list[dict]:
    """One row per class: figures real and simulated, their ratios, and whether each is on target."""
    rows = []
    for klass, r in sorted(real["summary"]["per_class"].items()):
        s = sim["summary"]["per_class"].get(klass)
        if s is None:
            continue
        row = {"class": klass}
        for key, q in FIGURES:
            rv, sv = (r.get(key) or {}).get(q), (s.get(key) or {}).get(q)
            k = f"{key[:-3]}_{q}"
            row[k] = {"real": rv, "sim": sv, "ratio": ratio(sv, rv)}
            row[k]["ok"] = row[k]["ratio"] is not None and abs(row[k]["ratio"] - 1) <= TARGETS[q] + 1e-9
        row["output_tok_s"] = {"real": r.get("output_tok_s"), "sim": s.get("output_tok_s"),
                               "ratio": ratio(s.get("output_tok_s"), r.get("output_tok_s"))}
        rows.append(row)
    return rows


def orderings(real: dict, sim: dict, protected: str) -> list[dict]:
    """Per mode: policies ranked by the protected class's p99 TTFT and ITL, both ways. Two
    policies whose real p99s are within the p99 target of each other (TIE) are tied: the
    simulator is asked for no finer order than its accuracy, and a real order that close moves
    between runs of the same command. `consistent`: every pair apart by more than that is
    ordered the same way simulated; `apart` counts those pairs, `discordant` lists the ones that
    are not (a finer figure than whole orders: one pair of eight policies decides an order)."""
    out = []
    for mode in sorted({m for m, _ in real}):
        pols = [p for m, p in real if m == mode and (m, p) in sim]
        for key in ("ttft_ms", "itl_ms"):
            def fig(runs):
                return {p: ((runs[(mode, p)]["summary"]["per_class"].get(protected) or {}).get(key) or {}).get("p99")
                        for p in pols}

            rf, sf = fig(real), fig(sim)
            r, s = (sorted(pols, key=lambda p: (f[p] is None, f[p] or 0.0)) for f in (rf, sf))
            apart = [(a, b) for i, a in enumerate(r) for b in r[i + 1:] if _apart(rf[a], rf[b])]
            bad = [[a, b] for a, b in apart if not (sf[a] is not None and sf[b] is not None and sf[a] < sf[b])]
            # (two policies apart in the real runs and equal simulated are not ordered: neither same)
            out.append({"mode": mode, "figure": f"{protected} {key[:-3]} p99", "real": r, "sim": s,
                        "same": r == s and not bad, "consistent": not bad, "apart": len(apart), "discordant": bad})
    return out


TIE = TARGETS["p99"]  # real p99s this close (relative) are tied


def _apart(low: float | None, high: float | None) -> bool:
    """Whether two real p99s, `low` <= `high`, are further apart than a tie."""
    return low is not None and high is not None and high > low * (1 + TIE)


def validate(real_dir: str, sim_dir: str, protected: str = "minnow", also_real: list[str] = ()) -> dict:
    real, sim = load_dir(real_dir), load_dir(sim_dir)
    if also_real:
        more = [load_dir(d) for d in also_real]
        real = {k: mean_of([v, *(m[k] for m in more if k in m)]) for k, v in real.items()}
    pairs = sorted(set(real) & set(sim))
    if not pairs:
        raise CliError("pdtb sim validate: no (mode, policy) run is in both folders")
    runs = [{"mode": m, "policy": p, "cost": sim[(m, p)]["meta"].get("cost"), "real_runs": real[(m, p)].get("real_runs", 1),
             "classes": compare_run(real[(m, p)], sim[(m, p)])} for m, p in pairs]
    order = orderings({k: real[k] for k in pairs}, {k: sim[k] for k in pairs}, protected)
    by_policy: dict[str, dict] = {}
    for r in runs:
        ok = _checks(r)
        got = by_policy.setdefault(r["policy"], {"on_target": 0, "checks": 0})
        got["on_target"] += sum(ok)
        got["checks"] += len(ok)
    checks = [ok for r in runs for ok in _checks(r)]
    return {"runs": runs, "orderings": order, "targets": TARGETS, "by_policy": by_policy,
            "on_target": sum(checks), "checks": len(checks), "orderings_same": all(o["same"] for o in order),
            "orderings_consistent": all(o["consistent"] for o in order)}


def checks(run: dict) -> dict[tuple[str, str], bool]:
    """(class, figure) -> on target, for one run of a comparison."""
    return {(c["class"], k): c[k]["ok"] for c in run["classes"] for k in c if isinstance(c[k], dict) and "ok" in c[k]}


def _checks(run: dict) -> list[bool]:
    return list(checks(run).values())


def _fmt(cell: dict) -> str:
    r = cell["ratio"]
    mark = "" if "ok" not in cell else (" ok" if cell["ok"] else " !!")
    return "-" if r is None else f"{r:.2f}{mark}"


def format_report(doc: dict) -> str:
    lines = [f"sim / real (targets: p50 within {TARGETS['p50']:.0%}, p99 within {TARGETS['p99']:.0%}; !! = off target)",
             f"{'mode':<10} {'policy':<9} {'class':<8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>9} {'ITL p99':>9} "
             f"{'out tok/s':>9}"]
    for r in doc["runs"]:
        for c in r["classes"]:
            lines.append(f"{r['mode']:<10} {r['policy']:<9} {c['class']:<8} " + " ".join(
                f"{_fmt(c[k]):>9}" for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s")))
    lines.append(f"on target: {doc['on_target']} of {doc['checks']}; by policy: " + ", ".join(
        f"{p} {v['on_target']}/{v['checks']}" for p, v in doc["by_policy"].items()))
    for o in doc["orderings"]:
        verdict = "same" if o["same"] else ("same beyond ties" if o["consistent"] else "DIFFERENT: " + ", ".join(
            f"{a} < {b}" for a, b in o["discordant"]) + " in the real runs, not simulated")
        lines.append(f"order by {o['figure']} ({o['mode']}): real {' < '.join(o['real'])}, "
                     f"sim {' < '.join(o['sim'])}: {verdict}")
    lines.append(f"(orders: policies whose real p99s are within {TIE:.0%} of each other are tied)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb sim validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("real", help="folder of results files from real clusters")
    ap.add_argument("sim", help="folder of results files from pdtb sim with the same flags")
    ap.add_argument("--protected", default="minnow", help="the class whose p99 orders the policies")
    ap.add_argument("--also-real", action="append", default=[], metavar="DIR",
                    help="another folder of real runs of the same flags: the real figures are the geometric "
                         "mean over every real folder (repeatable)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the comparison as JSON here too")
    a = ap.parse_args(argv)
    doc = validate(a.real, a.sim, a.protected, a.also_real)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc) if a.json else format_report(doc))
    return 0
