"""`pdtb sim validate-sets DIR`: the validation over several workload sets per calibration, the
held-out count and the orders.

`pdtb sim validate-sets DIR`: the simulator against the testbed over several workloads, per
calibration, from the `pdtb sim validate` files `scripts/validate_sim.sh` wrote in DIR
(validate-KIND.json for the first set, validate-SET-KIND.json for the others).

Per calibration: the figures on target for each set and policy; the held-out count, every run
but the fitted policy's on the first set (the calibration's own runs); and the policy orders by
the protected class's p99s, exactly and beyond ties (pdtb/sim/repro/validate.py), set by set,
with the pairs of policies apart in the real runs that the simulator orders the same.

The kind `repeat` (`scripts/validate_sim.sh --repeat`) is a second real run of each set compared
with the first as a simulated run would be: the figures on which the testbed repeats itself. It is
the ceiling of any simulator judged against one real run. In the sets that have it, each
calibration also counts its held-out figures among the repeatable ones (those the repeat has on
target).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdtb.common import CliError
from pdtb.sim.repro.validate import checks

HELD_OUT_BAR = 0.85  # of the held-out figures on target (the simulator's acceptance bar)
REPEAT = "repeat"  # the kind of a second real run against the first


def checks_of(doc: dict) -> dict[tuple, bool]:
    """(mode, policy, class, figure) -> on target, for one `pdtb sim validate` file."""
    return {(r["mode"], r["policy"], *key): ok for r in doc["runs"] for key, ok in checks(r).items()}


def file_of(d: Path, sets: list[str], s: str, kind: str) -> Path:
    return d / (f"validate-{kind}.json" if s == sets[0] else f"validate-{s}-{kind}.json")


def summarize(d: str | Path, sets: list[str], kinds: list[str], fitted: str = "fcfs") -> dict:
    d = Path(d)
    out = {"sets": sets, "fitted": fitted, "bar": HELD_OUT_BAR, "kinds": {}}
    repeat = {s: checks_of(json.loads(p.read_text())) for s in sets
              if REPEAT in kinds and (p := file_of(d, sets, s, REPEAT)).is_file()}  # (asked for: files stay behind)
    out["repeat_sets"] = list(repeat)
    def held_out(s: str, pol: str) -> bool:  # every run but the calibration's own
        return s != sets[0] or pol != fitted

    for kind in kinds:
        per_set, held, held_n, orders = {}, 0, 0, []
        rep_ok, rep_n = 0, 0  # of the held-out figures the repeat has on target: this kind's on target, all
        for s in sets:
            p = file_of(d, sets, s, kind)
            if not p.is_file():
                continue
            doc = json.loads(p.read_text())
            per_set[s] = {pol: [v["on_target"], v["checks"]] for pol, v in doc["by_policy"].items()}
            for pol, (ok, n) in per_set[s].items():
                if held_out(s, pol):
                    held, held_n = held + ok, held_n + n
            for key, ok in checks_of(doc).items():
                if repeat.get(s, {}).get(key) and held_out(s, key[1]):
                    rep_ok, rep_n = rep_ok + ok, rep_n + 1
            orders += [{"set": s, **{k: o[k] for k in ("mode", "figure", "real", "sim", "same", "apart") if k in o},
                        "consistent": o.get("consistent", o["same"]), "discordant": o.get("discordant", [])}
                       for o in doc["orderings"]]  # (files without ties: exact orders alone)
        if not per_set:
            continue
        out["kinds"][kind] = {"by_set": per_set, "held_out": [held, held_n],
                              "held_out_share": held / held_n if held_n else None,
                              "orders_same": sum(o["same"] for o in orders),
                              "orders_consistent": sum(o["consistent"] for o in orders),
                              "pairs": [sum(o["apart"] - len(o["discordant"]) for o in orders if "apart" in o),
                                        sum(o.get("apart", 0) for o in orders)], "orders": orders}
        if repeat and kind != REPEAT:
            out["kinds"][kind]["held_out_repeatable"] = [rep_ok, rep_n]
    if not out["kinds"]:
        raise CliError(f"pdtb sim validate-sets: no validate-*.json files of those sets in {d}")
    return out


def format_report(doc: dict) -> str:
    lines = []
    for kind, k in doc["kinds"].items():
        ok, n = k["held_out"]
        share = k["held_out_share"]
        bar = "" if kind == REPEAT else f"; bar {doc['bar']:.0%}: {'met' if share >= doc['bar'] else 'NOT met'}"
        lines.append(f"{'the testbed' if kind == REPEAT else 'calibration'} {kind}: held out {ok} of {n} on target"
                     + (f" ({share:.1%}{bar})" if share is not None else "")
                     + f"; orders same {k['orders_same']}, same beyond ties {k['orders_consistent']} "
                       f"of {len(k['orders'])}; pairs apart ordered the same {k['pairs'][0]} of {k['pairs'][1]}"
                     + (" (a second real run against the first: the ceiling)" if kind == REPEAT else ""))
        if "held_out_repeatable" in k:
            a, b = k["held_out_repeatable"]
            lines.append(f"  held out where the testbed repeats itself ({', '.join(doc['repeat_sets'])}): {a} of {b}"
                         + (f" ({a / b:.1%})" if b else ""))
        for s, pols in k["by_set"].items():
            lines.append(f"  {s:<10} " + ", ".join(f"{p} {a}/{b}" for p, (a, b) in pols.items()))
        for o in k["orders"]:
            if not o["consistent"]:
                lines.append(f"  order off: {o['set']} {o['mode']} {o['figure']}: real {' < '.join(o['real'])}, "
                             f"sim {' < '.join(o['sim'])}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb sim validate-sets", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="scripts/validate_sim.sh's output folder")
    ap.add_argument("--sets", default="quick", help="the sets, the first the calibration's (spaces or commas)")
    ap.add_argument("--kinds", default="grid logs logs-speed", help="the calibrations (spaces or commas), "
                    "and repeat for a second real run")
    ap.add_argument("--fitted", default="fcfs", help="the policy the calibration was fitted to")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the summary as JSON here too")
    a = ap.parse_args(argv)
    split = (lambda v: [x for x in v.replace(",", " ").split() if x])  # noqa: E731
    sets, kinds = split(a.sets), split(a.kinds)
    if not sets or not kinds:
        raise CliError("pdtb sim validate-sets: --sets and --kinds must name at least one")
    doc = summarize(a.dir, sets, kinds, a.fitted)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc) if a.json else format_report(doc))
    return 0
