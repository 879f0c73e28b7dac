"""`pdtb sim speed`: how long a large simulated run takes, policy by policy, against one event
per engine step measured in the same run.

For each policy, two measurements, each a whole `pdtb sim` command in a process of its own:

- **the hour**: the whole trace (by default an hour of the Azure conversation trace) on a
  4P+4D Llama-3-8B H100 cluster, runs of decode steps taken at once (the default);
- **the baseline**: the trace's first `--slice` requests both ways, runs taken at once and
  `--every-step`. The two results files must hold the same requests, token times and samples
  (`identical`), and the ratio of their event loops' CPU times is the speed-up.

Times are CPU seconds of the processes themselves (wall seconds are kept beside them in the
JSON): what a run costs, whatever else the machine runs meanwhile.

The bound a simulator of this kind meets is the events that can change a decision: `events`
and `steps` are printed beside the times (steps per second of simulation is how far
above one event per step a run got).

  pdtb sim speed [--trace FILE] [--policies "fcfs memfair ..."] [--slice N] [--dir D] [--json]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from fairness.registry import built_ins
from pdtb import cputime
from pdtb.common import CliError
from pdtb.figures.sim_section import speed_table
from pdtb.sim.repro.args import OneLineParser

TRACE = "../shared/traces/azure_llm_conv_2023.csv"
SHAPE = ["--mode", "disagg", "--prefill", "4", "--decode", "4", "--cost", "roofline", "--gpu", "h100-sxm",
         "--model-config", "llama-3-8b"]


def _sim(args: list[str], out: Path) -> dict:
    """One `pdtb sim` command: its results file's meta.sim and the whole command's seconds, CPU
    (the process's own, which other work on the machine does not stretch) and wall."""
    cmd = [sys.executable, "-m", "pdtb", "sim", *args, "--quiet", "--out", str(out)]
    p, cpu, wall = cputime.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise CliError(f"pdtb sim speed: {' '.join(cmd[2:])} failed: {p.stderr.strip()[-400:]}")
    sim = json.loads(out.read_text())["meta"]["sim"]
    return {"command_s": round(cpu, 1), "command_wall_s": round(wall, 1), "simulation_s": sim["cpu_s"],
            "simulation_wall_s": sim["wall_s"], "events": sim["events"],
            "steps": sum(sim["steps"].values()), "steps_in_runs": sum(sim.get("steps_in_runs", {}).values()),
            "simulated_s": round(sim["simulated_s"], 1)}


def same_run(a: Path, b: Path) -> bool:
    """The same requests (token times, timings, outcomes) and samples in two results files."""
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    return x["requests"] == y["requests"] and x["samples"] == y["samples"]


def measure(trace: str, policy: str, slice_n: int, d: Path) -> dict:
    base = ["--workload", f"trace:{trace}", *SHAPE, "--policy", policy]
    row = {"policy": policy, "hour": _sim(base, d / f"hour-{policy}.json")}
    part = [*base, "--max-requests", str(slice_n)]
    runs = _sim(part, d / f"slice-{policy}.json")
    every = _sim([*part, "--every-step"], d / f"slice-{policy}-every-step.json")
    row["slice"] = {"requests": slice_n, "runs": runs, "every_step": every,
                    "identical": same_run(d / f"slice-{policy}.json", d / f"slice-{policy}-every-step.json"),
                    "speedup": round(every["simulation_s"] / max(runs["simulation_s"], 1e-9), 1)}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="pdtb sim speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE, help="the trace file (default: %(default)s)")
    ap.add_argument("--policies", default=" ".join(built_ins()),
                    help="the policies timed (default: every built-in, as fairness/registry.py lists them)")
    ap.add_argument("--slice", type=int, default=5000, help="requests of the baseline run (default %(default)s)")
    ap.add_argument("--dir", help="keep the results files here (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not os.path.isfile(a.trace):
        raise CliError(f"pdtb sim speed: no trace at {a.trace}")
    if a.slice < 1:
        raise CliError("pdtb sim speed: --slice must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.dir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        rows = []
        for pol in a.policies.split():
            rows.append(measure(a.trace, pol, a.slice, d))
            if not a.json:
                print(f"{pol}: hour {rows[-1]['hour']['command_s']} s, slice speed-up {rows[-1]['slice']['speedup']}x",
                      file=sys.stderr)
    doc = {"trace": a.trace, "shape": " ".join(SHAPE), "rows": rows}
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(speed_table(rows)))
    return 0 if all(r["slice"]["identical"] for r in rows) else 1
