"""Per-verdict admission counts of disaggregated runs, side by side across transports.

    python -m pdtb.figures.admissions DIR [DIR ...]   (scripts/compare_transports.sh calls it)

Each DIR holds the `disagg-POLICY.json` results of one transport (its name is the DIR's last
part). A decode node counts the verdicts on the hand-off headers it answers (accept, park,
refuse; `defer` counts each deferred request once, `defer_answers` every deferral, as the
prefill side retries); the run's last `/cluster` sample holds them, summed here over the decode
nodes. The first DIR is the baseline: every other column says whether its counts equal it.

Lockstep results (`pdtb bench lockstep`, scripts/compare_fairness.sh --lockstep) carry the
same counts and also every request's verdicts in order and a digest of the generated tokens:
those are compared too. With --check the exit status is 1 unless everything compared equals
the baseline.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdtb.figures.results import check_results, read_json

VERDICTS = ("accept", "park", "defer", "refuse", "defer_answers")


def admissions_of(results: dict) -> dict[str, int]:
    """Decode nodes' verdict counts at the end of a run (the last sample that has any)."""
    if results.get("lockstep"):
        return {v: int(results["admissions"].get(v, 0)) for v in VERDICTS}
    for sample in reversed(results.get("samples") or []):
        nodes = [n for n in sample["nodes"] if n.get("role") == "decode" and n.get("admissions")]
        if nodes:
            return {v: sum(int(n["admissions"].get(v, 0)) for n in nodes) for v in VERDICTS}
    return {v: 0 for v in VERDICTS}


def load(path: Path) -> dict:
    """A live run's results file, or a lockstep result."""
    data = read_json(path)
    return data if isinstance(data, dict) and data.get("lockstep") else check_results(data, path)


def _same(a, b) -> str:
    return "same" if a == b else "differs"


def table(dirs: list[Path]) -> tuple[list[str], bool]:
    """(lines, whether every transport's decisions equal the first's)."""
    names = [d.name for d in dirs]
    policies = sorted({p.stem.removeprefix("disagg-") for d in dirs for p in d.glob("disagg-*.json")})
    lines = [f"{'policy':9} {'verdict':14} " + " ".join(f"{n:>8}" for n in names)]
    same = True
    for pol in policies:
        paths = [d / f"disagg-{pol}.json" for d in dirs]
        runs = [load(p) if p.exists() else None for p in paths]
        counts = [admissions_of(r) if r is not None else None for r in runs]
        for v in VERDICTS:
            cells = ["-" if c is None else str(c[v]) for c in counts]
            lines.append(f"{pol:9} {v:14} " + " ".join(f"{c:>8}" for c in cells))
        base, others = runs[0], list(zip(names[1:], runs[1:], counts[1:]))
        parts = [f"every count: {', '.join(f'{n}: {_same(c, counts[0])}' for n, _, c in others)}"]
        same = same and base is not None and all(c == counts[0] for _, _, c in others)
        if base is not None and base.get("lockstep") and all(r is not None and r.get("lockstep") for _, r, _ in others):
            for key, label in (("verdicts", "every request's verdicts"), ("tokens_sha256", "tokens")):
                parts.append(f"{label}: {', '.join(f'{n}: {_same(r[key], base[key])}' for n, r, _ in others)}")
                same = same and all(r[key] == base[key] for _, r, _ in others)
        lines.append(f"{pol:9} vs {names[0]}: " + "; ".join(parts))
    return lines, same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.figures.admissions", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="one results directory per transport; the first is the baseline")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every transport's decisions equal the first's")
    a = ap.parse_args(argv)
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        print(f"admissions: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    lines, same = table(a.dirs)
    print("\n".join(lines))
    return 1 if a.check and not same else 0


if __name__ == "__main__":
    sys.exit(main())
