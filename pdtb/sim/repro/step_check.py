"""`pdtb sim step-check REAL_DIR --calibration CAL`: what each real run's steps cost against what the
calibration prices them at, the costs a simulated run of the same policy does not see.

For every `run-MODE-POLICY/steps-ROLE-N.jsonl` step log of a `compare_fairness.sh --step-log`
folder (pdtb/sim/calibration/samples.py reads them), per node:

    steps        the steps that ran tokens
    measured/fit the run's step time over the calibration's fit of the same steps (time-weighted:
                 sum of measured ms over sum of fitted ms), and each step's ratio at p50 and p99
    gap ms       the node's own time between back-to-back steps, median (the calibration's
                 node overhead is one such median, of the fitted runs)
    moves        tier moves (demotions, promotions) and their seconds, which the simulator
                 prices on the tier link

On this machine the ratio moves between runs, whatever the policy: the same policy's runs of one
command, made twice, ran 0.76-1.25x as fast as each other (the host's speed drifts while a
comparison runs policy after policy), a cost the simulator, pricing every run at one speed, does
not see. `--sim-args` prints each run's `pdtb sim --step-scale ROLE=X` flags instead (one line a
run: MODE POLICY FLAGS), which `scripts/validate_sim.sh` takes for its speed-matched kind.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pdtb.common import CliError


def check_run(folder: Path, cal) -> list[dict]:
    from pdtb.sim.calibration.samples import read_step_log, step_log_role

    out = []
    for log_path in sorted(folder.glob("steps-*.jsonl")):
        log = read_step_log(log_path)
        fitted = [cal.coef.ms(s.shape) for s in log.samples]
        ratios = sorted(s.ms / f for s, f in zip(log.samples, fitted) if f > 0)
        out.append({"node": log_path.stem.removeprefix("steps-"), "role": step_log_role(log_path),
                    "steps": len(log.samples), "measured_s": round(sum(s.ms for s in log.samples) / 1e3, 3),
                    "fitted_s": round(sum(fitted) / 1e3, 3),
                    "ratio": round(sum(s.ms for s in log.samples) / max(sum(fitted), 1e-9), 3),
                    "ratio_p50": round(ratios[len(ratios) // 2], 3) if ratios else None,
                    "ratio_p99": round(ratios[min(len(ratios) - 1, int(0.99 * len(ratios)))], 3) if ratios else None,
                    "gap_ms": round(1e3 * statistics.median(log.gaps_s), 3) if log.gaps_s else None,
                    "moves": len(log.moves), "moves_s": round(sum(s for _, s in log.moves), 3)})
    return out


def check_dir(real_dir: str | Path, cal) -> list[dict]:
    rows = []
    for run in sorted(Path(real_dir).glob("run-*-*")):
        mode, policy = run.name.removeprefix("run-").split("-", 1)
        rows += [{"mode": mode, "policy": policy, **r} for r in check_run(run, cal)]
    if not rows:
        raise CliError(f"pdtb sim step-check: no run-MODE-POLICY/steps-*.jsonl in {real_dir} "
                       "(compare_fairness.sh --step-log writes them)")
    return rows


def format_rows(rows: list[dict], cal) -> str:
    lines = [f"steps measured against {cal.describe()}",
             f"{'mode':<10}{'policy':<10}{'node':<12}{'steps':>6}{'measured/fit':>13}{'p50':>7}{'p99':>7}"
             f"{'gap ms':>8}{'moves':>7}"]
    for r in rows:
        lines.append(f"{r['mode']:<10}{r['policy']:<10}{r['node']:<12}{r['steps']:>6}{r['ratio']:>13.2f}"
                     f"{r['ratio_p50'] or 0:>7.2f}{r['ratio_p99'] or 0:>7.2f}{r['gap_ms'] or 0:>8.2f}{r['moves']:>7}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb sim step-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("real_dir", help="a compare_fairness.sh --step-log folder")
    ap.add_argument("--calibration", required=True, help="a pdtb sim calibrate file, or a shipped name")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sim-args", action="store_true", help="each run's --step-scale flags: MODE POLICY FLAGS")
    a = ap.parse_args(argv)
    from pdtb.sim.calibration.record import Calibration
    from pdtb.sim.calibration.samples import SampleError

    try:
        cal = Calibration.load(a.calibration)
        rows = check_dir(a.real_dir, cal)
    except SampleError as e:
        raise CliError(f"pdtb sim step-check: {e}") from None
    if a.sim_args:
        runs: dict = {}
        for r in rows:
            runs.setdefault((r["mode"], r["policy"]), []).append(f"--step-scale {r['role']}={r['ratio']}")
        print("\n".join(f"{m} {p} {' '.join(flags)}" for (m, p), flags in runs.items()))
        return 0
    print(json.dumps(rows) if a.json else format_rows(rows, cal))
    return 0
