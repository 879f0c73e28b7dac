"""`pdtb policy check`: the project's policies pass; deliberately broken ones fail, each on the
property it breaks, and a class missing a method is refused at load with the method's name."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fairness import POLICIES, PolicyLoadError, resolve
from pdtb.policies.check import check, parse

BROKEN = textwrap.dedent('''
    import random
    from fairness import BasePolicy, Placement


    class Greedy(BasePolicy):
        """Puts every arrival on the device tier, free pages or not."""

        def place_arrival(self, arrival, queued, state):
            return Placement.DEVICE


    class Shun(BasePolicy):
        """Never admits tenant m1."""

        def place_arrival(self, arrival, queued, state):
            return Placement.DEFER if arrival.tenant == "m1" else super().place_arrival(arrival, queued, state)

        def may_admit(self, seq, need_pages, state):
            return seq.tenant != "m1" and super().may_admit(seq, need_pages, state)


    class Raises(BasePolicy):
        def on_step(self, chunks, state):
            if state.step > 40:
                raise KeyError("boom")


    class Dice(BasePolicy):
        """Admission order by an unseeded draw."""

        def admission_order(self, candidates, state):
            return random.sample(candidates, len(candidates))


    class Strings(BasePolicy):
        """Answers placements with strings."""

        def place_arrival(self, arrival, queued, state):
            return super().place_arrival(arrival, queued, state).value


    class HashOrder(BasePolicy):
        """Admission by the hash of the tenant's name: the same in one process, not in another."""

        def admission_order(self, candidates, state):
            return sorted(candidates, key=lambda s: (hash(s.tenant), s.arrival_time))


    class BadQuotas(BasePolicy):
        def quotas(self):
            raise RuntimeError("no quotas here")


    class OneArg(BasePolicy):
        def __init__(self, config=None):
            super().__init__(config)


    class NoForget:
        name = "noforget"
        strict_order = True

        def refresh(self, running, candidates, state): pass
        def reclaim(self, running, candidates, state): return []
        def step_order(self, running, state): return running
        def pick_victim(self, candidates, requester, state): return candidates[0]
        def admission_order(self, candidates, state): return candidates
        def may_admit(self, seq, need_pages, state): return True
        def chunk_limit(self, seq, budget, state): return budget
        def on_step(self, chunks, state): pass
        def place_arrival(self, arrival, queued, state): return Placement.DEFER
        def waiting_arrivals(self, state): return []
        def quotas(self): return None
''')


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    path = tmp_path_factory.mktemp("policies") / "broken.py"
    path.write_text(BROKEN)
    return str(path)


def run_check(ref: str, ticks: int = 150, *flags: str):
    spec, _ = parse([ref, "--ticks", str(ticks), *flags])
    return check(spec)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_built_in_policies_pass(name):
    out = run_check(name)
    assert out.passed, (out.status, out.detail)
    # the runs put the policy under memory pressure: each kind of event happened
    for what in ("accept", "defer", "park", "promote", "node loss", "prefix hit tokens"):
        assert out.seen.get(what, 0) > 0, (what, out.seen)
    if name != "mcsf":  # (mcsf admits only what its plan says fits to the end: it evicts nothing)
        assert out.seen.get("preempt", 0) + out.seen.get("demote", 0) > 0, out.seen


@pytest.mark.parametrize("cls, prop, words", [
    ("Greedy", "answers legal", "admits beyond free pages"),
    ("Shun", "every request ends", "tenant m1, deferred"),
    ("Raises", "no exceptions", "on_step raised KeyError"),
    ("Dice", "deterministic", "two runs part"),
    ("Strings", "answers legal", "must be a fairness.Placement"),
    ("BadQuotas", "no exceptions", "quotas raised RuntimeError"),
    ("OneArg", "interface", "its constructor must take (config, settings)"),
])
def test_broken_policies_fail_on_their_property(broken, cls, prop, words):
    out = run_check(f"{broken}:{cls}")
    assert out.status[prop] == "FAIL", (out.status, out.detail)
    assert words in out.detail[prop], out.detail[prop]
    assert not out.passed


def test_an_order_from_string_hashes_fails_determinism(broken):
    """In a process of a fixed PYTHONHASHSEED (0; the check's other process gets 1): under a
    random seed two tenants' hashes can fall in the order seed 1 gives them, and nothing differs."""
    p = subprocess.run([sys.executable, "-m", "pdtb", "policy", "check", f"{broken}:HashOrder", "--ticks", "150"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("deterministic"))
    assert "FAIL" in line and "differ under another PYTHONHASHSEED" in line, p.stdout


def test_shared_fairness_flags_reach_the_runs():
    """The bandwidth cap and quotas per request are paths of their own: the check runs them."""
    out = run_check("memfair", 100, "--tenant-bw-cap", "20000", "--quota-by", "request", "--starve-after", "1")
    assert out.passed, (out.status, out.detail)


def test_a_class_missing_a_method_is_refused_with_its_name(broken):
    with pytest.raises(PolicyLoadError, match="lacks the required method forget"):
        resolve(f"{broken}:NoForget")


def test_cli_prints_a_line_per_property_and_exits_nonzero_on_failure(broken):
    ok = subprocess.run([sys.executable, "-m", "pdtb", "policy", "check", "vtc", "--ticks", "60",
                         "--policy-arg", "output_weight=3"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for prop in ("interface", "answers legal", "no exceptions", "page conservation", "every request ends",
                 "deterministic"):
        assert f"  {prop}" in ok.stdout and "FAIL" not in ok.stdout
    assert "'output_weight': 3.0" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "pdtb", "policy", "check", f"{broken}:Raises", "--ticks", "60"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "no exceptions        FAIL" in bad.stdout, bad.stdout + bad.stderr
    missing = subprocess.run([sys.executable, "-m", "pdtb", "policy", "check", f"{broken}:NoForget"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "lacks the required method forget" in missing.stdout
