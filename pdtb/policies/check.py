"""`pdtb policy check REF`: a policy's conformance, one line per property, exit 1 on a failure.

    interface            the class has every method of fairness/interface.py (checked at load)
    answers legal        every answer is of its type and within what it may answer: orders are
                         reorderings, victims are candidates, placements fit the free pages
    no exceptions        no method raises
    page conservation    after every step, each tier's pages add up from independent records
    every request ends   each request finishes or is aborted within --bound steps of arriving
    deterministic        the same seed gives the same answers, in the same order

The runs are the harness's (pdtb/policies/harness.py), several node shapes from one seed, each
run twice for the determinism check.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdtb.common import CliError
from pdtb.policies.guard import PolicyRaised
from pdtb.policies.harness import Broken, Harness, RunShape

PROPERTIES = ("interface", "answers legal", "no exceptions", "page conservation", "every request ends",
              "deterministic")


@dataclass
class Outcome:
    status: dict  # property -> "ok" | "FAIL" | "not run"
    detail: dict  # property -> one line
    seen: dict = None  # what the runs exercised (counts): tier moves, verdicts, prefix hits, node loss

    @property
    def passed(self) -> bool:
        return all(v == "ok" for v in self.status.values())


def shapes(seed: int, ticks: int) -> list[RunShape]:
    """Three node shapes: a host tier to park in, none (pressure means recompute), a roomy one."""
    return [RunShape(seed, 48, 16, ticks), RunShape(seed + 1, 40, 0, ticks), RunShape(seed + 2, 64, 64, ticks)]


def check(make_policy, seed: int = 0, ticks: int = 300, bound: int = 1500) -> Outcome:
    """Run the properties against `make_policy()` (a fresh policy per node and run)."""
    status = {p: "not run" for p in PROPERTIES}
    detail = {p: "" for p in PROPERTIES}
    status["interface"], detail["interface"] = "ok", "every method of fairness/interface.py"

    def fail(prop: str, why: str) -> Outcome:
        status[prop], detail[prop] = "FAIL", why
        return Outcome(status, detail)

    runs, steps, answers, longest, requests, seen = [], 0, 0, 0, 0, {}
    for shape in shapes(seed, ticks):
        pair = []
        for _ in range(2):
            h = Harness(make_policy, shape, bound)
            try:
                h.run()
            except PolicyRaised as e:
                return fail("no exceptions", f"{e} (seed {shape.seed}, step {h.steps})")
            except Broken as e:
                if h.violations:  # an illegal answer replaced by a default may be the cause
                    fail("answers legal", h.violations[0])
                return fail(e.prop, f"{e} (seed {shape.seed})")
            if h.violations:
                return fail("answers legal", f"{h.violations[0]} (seed {shape.seed}; {len(h.violations)} in all)")
            pair.append(h)
        a, b = pair
        if a.trace != b.trace:
            i = next((i for i, (x, y) in enumerate(zip(a.trace, b.trace)) if x != y), min(len(a.trace), len(b.trace)))
            first = a.trace[i] if i < len(a.trace) else "(end)"
            second = b.trace[i] if i < len(b.trace) else "(end)"
            return fail("deterministic", f"seed {shape.seed}: two runs part at answer {i}: {first} against {second}")
        steps, answers = steps + a.steps, answers + a.answers
        for k, v in a.seen.items():
            seen[k] = seen.get(k, 0) + v
        longest, requests = max(longest, a.longest), requests + len(a.born)
        runs.append(a)
    status.update({p: "ok" for p in PROPERTIES})
    detail["answers legal"] = f"{answers} answers checked"
    detail["no exceptions"] = ""
    detail["page conservation"] = f"checked after each of {steps} node steps"
    detail["every request ends"] = f"{requests} requests; the longest took {longest} steps (bound {bound})"
    detail["deterministic"] = f"{len(runs)} seeds, each run twice: the same {sum(len(r.trace) for r in runs)} answers"
    return Outcome(status, detail, seen)


def main(argv: list[str]) -> int:
    from fairness import FairnessConfig, PolicyLoadError, SettingsError, resolve
    from fairness.registry import make_settings
    from fairness.settings import parse_pairs

    ap = argparse.ArgumentParser(prog="pdtb policy check", description=__doc__.split("\n")[0])
    ap.add_argument("policy", metavar="NAME|module:Class|file.py:Class")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the policy's own (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ticks", type=int, default=300, help="steps with arrivals in each run (default 300)")
    ap.add_argument("--bound", type=int, default=1500,
                    help="steps within which every request must end after it arrives (default 1500)")
    a = ap.parse_args(argv)
    if a.ticks < 1 or a.bound < 1:
        raise CliError("--ticks and --bound must be at least 1")
    print(f"pdtb policy check {a.policy}, seed {a.seed}")
    try:
        entry = resolve(a.policy)
        settings = make_settings(entry, parse_pairs(a.policy_arg))
    except PolicyLoadError as e:
        print(f"  {'interface':<20} FAIL  {e}")
        return 1
    except SettingsError as e:
        raise CliError(str(e)) from None
    print(f"  source: {entry.source}; settings: {settings}")
    out = check(lambda: entry.cls(FairnessConfig(), settings), a.seed, a.ticks, a.bound)
    if out.seen:
        print("  exercised: " + ", ".join(f"{k} {v}" for k, v in sorted(out.seen.items())))
    for prop in PROPERTIES:
        print(f"  {prop:<20} {out.status[prop]:<5} {out.detail[prop]}".rstrip())
    print("passed" if out.passed else "FAILED")
    return 0 if out.passed else 1
