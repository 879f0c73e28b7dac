"""`pdtb policy check REF`: a policy's conformance, one line per property, exit 1 on a failure.

    interface            the class has every method of fairness/interface.py and takes
                         (config, settings)
    answers legal        every answer is of its type and within what it may answer: orders are
                         reorderings, victims are candidates, placements fit the free pages
    no exceptions        no method raises
    page conservation    after every step, each tier's pages add up from independent records
    every request ends   each request finishes or is aborted within --bound steps of arriving
    deterministic        the same seed gives the same answers in the same order: run twice in
                         this process, and once more in a process with another PYTHONHASHSEED
                         (an order taken from a set of strings differs there)

The runs are the harness's (pdtb/policies/harness.py): three node shapes from one seed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from pdtb.common import CliError
from pdtb.policies.guard import PolicyRaised
from pdtb.policies.harness import Broken, Harness, RunShape

PROPERTIES = ("interface", "answers legal", "no exceptions", "page conservation", "every request ends",
              "deterministic")


@dataclass
class Outcome:
    status: dict = field(default_factory=lambda: {p: "not run" for p in PROPERTIES})  # property -> ok | FAIL | not run
    detail: dict = field(default_factory=lambda: {p: "" for p in PROPERTIES})  # property -> one line
    seen: dict = field(default_factory=dict)  # what the runs exercised (counts): tier moves, verdicts, node loss

    @property
    def passed(self) -> bool:
        return all(v == "ok" for v in self.status.values())

    def fail(self, prop: str, why: str) -> "Outcome":
        self.status[prop], self.detail[prop] = "FAIL", why
        return self


@dataclass(frozen=True)
class CheckSpec:
    """What to check: the policy, its settings, the shared fairness config, the runs, and the
    command line that says all of it (for the run under another hash seed)."""

    ref: str
    pairs: tuple  # the policy's settings, (key, value) strings
    config: object  # the shared FairnessConfig
    seed: int
    ticks: int
    bound: int
    argv: tuple

    def shapes(self) -> list[RunShape]:
        """A host tier to park in, none (pressure means recompute), a roomy one."""
        s, t = self.seed, self.ticks
        return [RunShape(s, 48, 16, t), RunShape(s + 1, 40, 0, t), RunShape(s + 2, 64, 64, t)]


def factory(spec: CheckSpec):
    """A function building a fresh policy per node and run (PolicyLoadError, SettingsError)."""
    from fairness.registry import instantiate, make_settings, resolve

    entry = resolve(spec.ref)
    settings = make_settings(entry, spec.pairs)
    instantiate(entry, spec.config, settings)  # a constructor that takes neither is refused now
    return lambda: instantiate(entry, spec.config, settings)


def digest(trace: list) -> str:
    return hashlib.sha256(repr(trace).encode()).hexdigest()


def run_pair(make, shape: RunShape, bound: int, out: Outcome) -> Harness | None:
    """The shape run twice here; None (with `out` failed) when a property breaks."""
    pair = []
    for _ in range(2):
        h = Harness(make, shape, bound)
        try:
            h.run()
        except PolicyRaised as e:
            out.fail("no exceptions", f"{e} (seed {shape.seed}, step {h.steps})")
            return None
        except Broken as e:
            if h.violations:  # an illegal answer replaced by a default may be the cause
                out.fail("answers legal", h.violations[0])
            out.fail(e.prop, f"{e} (seed {shape.seed})")
            return None
        if h.violations:
            out.fail("answers legal", f"{h.violations[0]} (seed {shape.seed}; {len(h.violations)} in all)")
            return None
        pair.append(h)
    a, b = pair
    if a.trace != b.trace:
        i = next((i for i, (x, y) in enumerate(zip(a.trace, b.trace)) if x != y), min(len(a.trace), len(b.trace)))
        first = a.trace[i] if i < len(a.trace) else "(end)"
        second = b.trace[i] if i < len(b.trace) else "(end)"
        out.fail("deterministic", f"seed {shape.seed}: two runs part at answer {i}: {first} against {second}")
        return None
    return a


def digests_elsewhere(spec: CheckSpec) -> list[str] | str:
    """The runs' trace digests from a process with another PYTHONHASHSEED, or why not."""
    mine = os.environ.get("PYTHONHASHSEED", "")
    other = str(int(mine) + 1) if mine.isdigit() else "1"
    env = dict(os.environ, PYTHONHASHSEED=other)
    p = subprocess.run([sys.executable, "-m", "pdtb", "policy", "check", *spec.argv, "--trace-digests"],
                       capture_output=True, text=True, env=env, timeout=1800)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"PYTHONHASHSEED={other}: the run failed there: {(p.stderr or p.stdout).strip()[-300:]}"


def check(spec: CheckSpec, across_hash_seeds: bool = True) -> Outcome:
    """Run the properties against the policy `spec` names."""
    from fairness import PolicyLoadError

    out = Outcome()
    try:
        make = factory(spec)
    except PolicyLoadError as e:
        return out.fail("interface", str(e))
    out.status["interface"], out.detail["interface"] = "ok", "every method of fairness/interface.py"
    runs = []
    for shape in spec.shapes():
        h = run_pair(make, shape, spec.bound, out)
        if h is None:
            return out
        runs.append(h)
        for k, v in h.seen.items():
            out.seen[k] = out.seen.get(k, 0) + v
    how = "twice here"
    if across_hash_seeds:
        there = digests_elsewhere(spec)
        here = [digest(h.trace) for h in runs]
        if there != here:
            i = next((i for i, (x, y) in enumerate(zip(here, there)) if x != y), 0) if isinstance(there, list) else 0
            why = there if isinstance(there, str) else \
                f"seed {spec.shapes()[i].seed}: the answers differ under another PYTHONHASHSEED (an order from a set?)"
            return out.fail("deterministic", why)
        how = "twice here and once under another PYTHONHASHSEED"
    out.status.update({p: "ok" for p in PROPERTIES})
    out.detail.update({
        "answers legal": f"{sum(h.answers for h in runs)} answers checked", "no exceptions": "",
        "page conservation": f"checked after each of {sum(h.steps for h in runs)} node steps",
        "every request ends": f"{sum(len(h.born) for h in runs)} requests; the longest took "
                              f"{max(h.longest for h in runs)} steps (bound {spec.bound})",
        "deterministic": f"{len(runs)} seeds, each run {how}: the same {sum(len(h.trace) for h in runs)} answers"})
    return out


def parse(argv: list[str]) -> tuple[CheckSpec, bool]:
    from fairness import PolicyLoadError, resolve
    from fairness.settings import SettingsError, parse_pairs
    from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args

    ap = argparse.ArgumentParser(prog="pdtb policy check", description=__doc__.split("\n")[0])
    ap.add_argument("ref", metavar="NAME|module:Class|file.py:Class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ticks", type=int, default=300, help="steps with arrivals in each run (default 300)")
    ap.add_argument("--bound", type=int, default=1500,
                    help="steps within which every request must end after it arrives (default 1500)")
    ap.add_argument("--trace-digests", action="store_true", help=argparse.SUPPRESS)  # the determinism check's
    add_fairness_args(ap)  # --policy-arg and the shared fairness flags (--quota-by, --tenant-bw-cap, ...)
    a = ap.parse_args(argv)
    if a.ticks < 1 or a.bound < 1:
        raise CliError("--ticks and --bound must be at least 1")
    a.policy = a.ref
    try:
        resolve(a.ref)
        pairs = policy_args(a)  # --policy-arg and the older settings flags, checked
    except PolicyLoadError:  # reported as the interface property's failure
        try:
            pairs = tuple(parse_pairs(a.policy_arg))
        except SettingsError as e:
            raise CliError(str(e)) from None
    spec = CheckSpec(a.ref, tuple(pairs), fairness_config(a), a.seed, a.ticks, a.bound,
                     tuple(x for x in argv if x != "--trace-digests"))
    return spec, a.trace_digests


def main(argv: list[str]) -> int:
    from fairness import PolicyLoadError, SettingsError

    spec, digests_only = parse(argv)
    if digests_only:
        make = factory(spec)
        runs = [Harness(make, s, spec.bound) for s in spec.shapes()]
        for h in runs:
            h.run()
        print(json.dumps([digest(h.trace) for h in runs]))
        return 0
    print(f"pdtb policy check {spec.ref}, seed {spec.seed}")
    try:
        out = check(spec)
    except SettingsError as e:
        raise CliError(str(e)) from None
    if out.status["interface"] == "ok":
        from fairness import policy_info

        try:
            info = policy_info(spec.ref, spec.pairs)
            print(f"  source: {info.source}; settings: {info.settings}")
        except PolicyLoadError:
            pass
    if out.seen:
        print("  exercised: " + ", ".join(f"{k} {v}" for k, v in sorted(out.seen.items())))
    for prop in PROPERTIES:
        print(f"  {prop:<20} {out.status[prop]:<5} {out.detail[prop]}".rstrip())
    print("passed" if out.passed else "FAILED")
    return 0 if out.passed else 1
