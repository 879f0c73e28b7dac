"""`pdtb sim` and its subcommands."""
from __future__ import annotations

from pdtb.common import CliError

USAGE = """pdtb sim <subcommand> | pdtb sim [run options]

  pdtb sim --workload W --mode colocated|disagg ... --out FILE    simulate one run
  pdtb sim calibrate --steps FILE [...] --out FILE               fit a step-cost model
  pdtb sim validate [...]                                        real cluster vs simulator
  pdtb sim validate-sets DIR [--sets ...]                        the validation over several workloads
  pdtb sim validate-prefix REAL SIM [...]                        prefix sharing, real vs simulated
  pdtb sim step-check REAL_DIR --calibration CAL                 real runs' steps against the fit
  pdtb sim reproduce mcsf|vtc|essay [--json]                     the papers' figures
  pdtb sim plan ...                                              prefill:decode split and budgets
  pdtb sim roofline --steps FILE [--gpu G --model-config M]      measured steps against the roofline
  pdtb sim speed [--policies ...] [--json]                        an hour of a trace, against one event per step

Each subcommand takes --help; the run's own options: pdtb sim run --help.
"""


def main(argv: list[str]) -> int:
    sub, rest = (argv[0], argv[1:]) if argv else ("", [])
    if sub in ("-h", "--help") and not rest:
        print(USAGE)
        return 0
    if sub == "run":  # the default subcommand, by name
        argv = rest
    if sub == "calibrate":
        from pdtb.sim.calibration.cli import main as run
    elif sub == "validate":
        from pdtb.sim.repro.validate import main as run
    elif sub == "validate-sets":
        from pdtb.sim.repro.validate_sets import main as run
    elif sub == "validate-prefix":
        from pdtb.sim.repro.validate_prefix import main as run
    elif sub == "step-check":
        from pdtb.sim.repro.step_check import main as run
    elif sub == "roofline":
        from pdtb.sim.repro.roofline_check import main as run
    elif sub == "speed":
        from pdtb.sim.repro.speed import main as run
    elif sub == "plan":
        from pdtb.planner.plan import main as run
    elif sub == "reproduce":
        which, rest = (rest[0], rest[1:]) if rest else ("", [])
        mods = {"mcsf": "pdtb.sim.repro.mcsf", "vtc": "pdtb.sim.repro.vtc", "essay": "pdtb.sim.repro.essay"}
        if which not in mods:
            raise CliError(f"pdtb sim reproduce: choose one of {', '.join(mods)}")
        import importlib

        run = importlib.import_module(mods[which]).main
    else:
        from pdtb.sim.run import main as run

        return run(argv)
    return run(rest)
