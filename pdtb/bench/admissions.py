"""Per-verdict admission counts of disaggregated runs, side by side across transports.

    python -m pdtb.bench.admissions DIR [DIR ...]   (scripts/compare_transports.sh calls it)

Each DIR holds the `disagg-POLICY.json` results of one transport (its name is the DIR's last
part). A decode node counts the verdicts on the hand-off headers it answers (accept, park,
refuse; `defer` counts each deferred request once, `defer_answers` every deferral, as the
prefill side retries); the run's last `/cluster` sample holds them, summed here over the decode
nodes. The first DIR is the baseline: every other column says whether its counts equal it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdtb.bench.results import load_results

VERDICTS = ("accept", "park", "defer", "refuse", "defer_answers")


def admissions_of(results: dict) -> dict[str, int]:
    """Decode nodes' verdict counts at the end of a run (the last sample that has any)."""
    for sample in reversed(results.get("samples") or []):
        nodes = [n for n in sample["nodes"] if n.get("role") == "decode" and n.get("admissions")]
        if nodes:
            return {v: sum(int(n["admissions"].get(v, 0)) for n in nodes) for v in VERDICTS}
    return {v: 0 for v in VERDICTS}


def table(dirs: list[Path]) -> tuple[list[str], bool]:
    """(lines, whether every transport's decisions equal the first's)."""
    names = [d.name for d in dirs]
    policies = sorted({p.stem.removeprefix("disagg-") for d in dirs for p in d.glob("disagg-*.json")})
    lines = [f"{'policy':9} {'verdict':14} " + " ".join(f"{n:>8}" for n in names)]
    same = True
    for pol in policies:
        counts = []
        for d in dirs:
            path = d / f"disagg-{pol}.json"
            counts.append(admissions_of(load_results(path)) if path.exists() else None)
        for v in VERDICTS:
            cells = ["-" if c is None else str(c[v]) for c in counts]
            lines.append(f"{pol:9} {v:14} " + " ".join(f"{c:>8}" for c in cells))
        base = counts[0]
        verdicts = [f"{n}: {'same' if c == base else 'differs'}" for n, c in zip(names[1:], counts[1:])]
        decided = [f"{n}: {'same' if c and base and all(c[v] == base[v] for v in VERDICTS[:4]) else 'differs'}"
                   for n, c in zip(names[1:], counts[1:])]
        same = same and all(c == base for c in counts[1:])
        lines.append(f"{pol:9} vs {names[0]}: every count: {', '.join(verdicts)}; "
                     f"verdicts per request: {', '.join(decided)}")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.bench.admissions", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="one results directory per transport; the first is the baseline")
    a = ap.parse_args(argv)
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        print(f"admissions: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    lines, _ = table(a.dirs)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
