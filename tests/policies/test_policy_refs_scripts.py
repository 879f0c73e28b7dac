"""A policy by reference (a file of one's own, with a setting of its own) through every command
and script that takes a policy: `pdtb generate` runs it, `pdtb bench lockstep` and `pdtb
cluster up` hand it to the nodes they build, and the scripts check it before anything starts,
make a file's path absolute and name its runs by a label."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cluster_util import ROOT, get_json, launched

POLICY_FILE = textwrap.dedent('''
    import sys
    from dataclasses import dataclass

    from fairness import BasePolicy, PolicySettings, setting


    @dataclass(frozen=True)
    class PatientSettings(PolicySettings):
        patience_s: float = setting(1.0, "seconds a request may wait", lo=0, lo_open=True)


    class Patient(BasePolicy):
        """First come first served; says its setting when built, so a test sees it ran."""

        Settings = PatientSettings

        def __init__(self, config=None, settings=None):
            super().__init__(config, settings)
            print(f"patient policy: patience_s={self.settings.patience_s}", file=sys.stderr)
''')
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]
# 12 pages of 4 tokens hold fewer tokens than the three requests grow to: requests are evicted
TIGHT = ["--max-tokens", "16", "--ignore-eos", "--json", "--kv-pages", "12", "--page-size", "4"]


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "patient.py"
    path.write_text(POLICY_FILE)
    return path


def run(cmd: list[str], cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def generate(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "pdtb", "generate", *args], cwd=cwd)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ---- pdtb generate ----------------------------------------------------------------------------

def test_generate_runs_a_policy_file_with_the_outputs_of_fcfs(llama_dir, policy_file, tmp_path):
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(PROMPTS) + "\n")
    common = ["--model", llama_dir, "--prompts-file", str(pf), *TIGHT]
    base = generate(*common, "--policy", "fcfs")
    mine = generate(*common, "--policy", "patient.py:Patient", "--policy-arg", "patience_s=2.5", cwd=tmp_path)
    assert base.returncode == 0 and mine.returncode == 0, (base.stderr, mine.stderr)
    assert "patient policy: patience_s=2.5" in mine.stderr  # it was built, with its setting
    rows = [json.loads(ln) for ln in mine.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS and all(len(r["token_ids"]) == 16 for r in rows)
    assert mine.stdout == base.stdout


@pytest.mark.parametrize("arg, says", [
    ("patience_s=0", "patience_s must be > 0, got 0.0"),
    ("patience_s=soon", "patience_s takes float, got 'soon'"),
    ("patience=1", "no setting 'patience' (its settings: patience_s)"),
    ("patience_s", "--policy-arg expects KEY=VALUE"),
])
def test_generate_refuses_a_bad_policy_arg_naming_it(policy_file, arg, says):
    r = generate("--prompt", "x", "--policy", f"{policy_file}:Patient", "--policy-arg", arg)
    assert r.returncode == 2 and says in one_line(r.stderr)


def test_generate_refuses_a_reference_that_does_not_load(policy_file):
    for ref, says in ((f"{policy_file}:Nobody", "has no 'Nobody'"), ("nosuch", "unknown policy 'nosuch'")):
        r = generate("--prompt", "x", "--policy", ref)
        assert r.returncode == 2 and says in one_line(r.stderr)


# ---- the scripts' checks ------------------------------------------------------------------------

def script(name: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return run(["bash", str(ROOT / "scripts" / name), *args], cwd=cwd)


def dry_run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return script("compare_fairness.sh", "--dry-run", *args, cwd=cwd)


def test_compare_fairness_takes_a_file_reference_and_labels_it(policy_file, tmp_path):
    r = dry_run("--policies", "fcfs,patient.py:Patient slow=./patient.py:Patient memfair",
                "--policy-arg", "slow:patience_s=9", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["fcfs fcfs", f"Patient {policy_file}:Patient",
                                     f"slow {policy_file}:Patient patience_s=9", "memfair memfair"]


def test_compare_fairness_takes_a_module_reference_as_it_is(policy_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # (the nodes get the same environment)
    r = dry_run("--policies", "patient:Patient", "--policy-arg", "patience_s=2")
    assert r.returncode == 0 and r.stdout == "Patient patient:Patient patience_s=2\n", r.stderr


def test_compare_fairness_built_in_names_are_their_own_labels():
    r = dry_run()
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:-1] == [f"{p} {p}" for p in ("fcfs", "memfair", "vtc", "mcsf", "priority")]


@pytest.mark.parametrize("args, says", [
    (["--policies", "fcfs bogus"], "unknown policy 'bogus'"),
    (["--policies", "patient.py:Nobody"], "has no 'Nobody'"),
    (["--policies", "patient.py:Patient Patient=fcfs"], "two policies labelled 'Patient'"),
    (["--policies", "./patient.py"], "unknown policy './patient.py'"),
    (["--policies", "patient.py:Patient", "--policy-arg", "patience_s=-1"], "patience_s must be > 0"),
    (["--policies", "fcfs patient.py:Patient", "--policy-arg", "patience_s=1"], "no setting 'patience_s'"),
    (["--policies", "patient.py:Patient", "--policy-arg", "other:patience_s=1"], "no policy labelled 'other'"),
    (["--policies", "fcfs memfair", "--node-args", "--aging 8"], "--aging is a setting"),
    (["--minnow-rate", "0"], "--minnow-rate wants requests/s above 0, got 0"),
    (["--minnow-rate", "1.5.2"], "--minnow-rate wants requests/s above 0"),
    (["--workload", "bogus"], "--workload is whale-minnow or tenants, got bogus"),
    (["--workload", "tenants", "--minnow-rate", "2"], "--workload tenants takes no --minnow-rate"),
])
def test_compare_fairness_refuses_a_bad_policy_before_any_run(policy_file, tmp_path, args, says):
    r = dry_run(*args, cwd=tmp_path)
    assert r.returncode == 2 and one_line(r.stderr).startswith("compare_fairness: ") and says in r.stderr
    r = script("compare_fairness.sh", "--out", str(tmp_path / "out"), *args, cwd=tmp_path)  # not only in a dry run
    assert r.returncode == 2 and says in r.stderr and not (tmp_path / "out").exists()


def test_compare_transports_checks_its_policies_first(tmp_path):
    r = script("compare_transports.sh", "--policies", "fcfs bogus", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and "unknown policy 'bogus'" in one_line(r.stderr) and not (tmp_path / "out").exists()


def test_launch_cluster_checks_the_policy_before_anything_starts(policy_file, tmp_path):
    for args, says in ((["--policy", "bogus"], "unknown policy 'bogus'"),
                       (["--policy", "patient.py:Patient", "--policy-arg", "patience_s=0"], "patience_s must be > 0"),
                       (["--policy", "fcfs", "--", "--aging", "2"], "--aging is a setting policy fcfs does not have")):
        r = script("launch_cluster.sh", "--mode", "colocated", "--run-dir", str(tmp_path / "run"), *args, cwd=tmp_path)
        assert r.returncode == 2 and one_line(r.stderr).startswith("launch_cluster: ") and says in r.stderr
        assert not (tmp_path / "run").exists()


def test_frontier_checks_every_point_before_the_first(policy_file, tmp_path):
    points = tmp_path / "points.txt"
    points.write_text("# label mode policy flags\nbase colocated fcfs\n"
                      "mine disagg patient.py:Patient --policy-arg patience_s=0\n")
    r = script("frontier.sh", "--quick", "--points", str(points), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and one_line(r.stderr).startswith("frontier: point mine: ")
    assert "patience_s must be > 0" in r.stderr and not (tmp_path / "out").exists()


def test_policy_helpers_label_and_list(policy_file, tmp_path):
    helper = ROOT / "scripts" / "_policy.sh"
    body = (f'set -euo pipefail; source "{helper}"; policy_label patient.py:Patient; policy_label pkg.mod:Outer.Inner; '
            'policy_label memfair; policy_table t "fcfs patient.py:Patient two=patient.py:Patient" two:patience_s=3; '
            'policy_list; policy_flags 2; echo "${POLICY_FLAGS[*]}"')
    r = run(["bash", "-c", body], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["Patient", "Inner", "memfair",
                                     f"fcfs Patient={policy_file}:Patient two={policy_file}:Patient",
                                     f"--policy {policy_file}:Patient --policy-arg patience_s=3"]


# ---- Ray and lockstep: the nodes they build get the reference and its settings --------------------

def test_cluster_up_passes_an_absolute_reference_and_its_settings(policy_file, tmp_path, monkeypatch):
    from pdtb.common import CliError
    from pdtb.ray_cluster.cli import parse_up, spec_of

    monkeypatch.chdir(tmp_path)
    spec = spec_of(parse_up(["--ray", "auto", "--policy", "patient.py:Patient", "--policy-arg", "patience_s=4"]))
    for role in ("prefill", "decode"):
        args = spec.node_args[role]
        i = args.index("--policy")
        assert args[i:i + 4] == ["--policy", f"{policy_file}:Patient", "--policy-arg", "patience_s=4"]
    with pytest.raises(CliError, match="patience_s must be > 0"):
        spec_of(parse_up(["--ray", "auto", "--policy", "patient.py:Patient", "--policy-arg", "patience_s=0"]))


def test_lockstep_builds_its_decode_node_with_the_reference(llama_dir, policy_file):
    from pdtb.microbench.lockstep import prepare

    job = prepare(["--workload", "whale-minnow", "--duration", "1", "--label-policy", "mine", "--",
                   "--model", llama_dir, "--policy", f"{policy_file}:Patient", "--policy-arg", "patience_s=3"])
    assert job.config.policy == f"{policy_file}:Patient" and job.config.policy_args == (("patience_s", "3"),)
    assert job.label == "mine"


@pytest.mark.slow
def test_lockstep_result_names_the_policy_and_its_settings(llama_dir, policy_file, tmp_path):
    out = tmp_path / "r.json"
    r = run([sys.executable, "-m", "pdtb", "bench", "lockstep", "--workload", "whale-minnow", "--whales", "1",
             "--whale-prompt", "64", "--whale-output", "8", "--minnow-rate", "4", "--duration", "0.5",
             "--context-whales", "0", "--label-policy", "mine", "--out", str(out), "--", "--model", llama_dir,
             "--policy", f"{policy_file}:Patient", "--policy-arg", "patience_s=3", "--kv-pages", "64"], timeout=180)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["policy"] == "mine" and res["pages_free"] and res["finished"] == res["requests"]
    assert res["policy_info"] == {"name": f"{policy_file}:Patient", "source": f"{policy_file}:Patient",
                                  "settings": {"patience_s": 3.0}}


@pytest.mark.slow
def test_launch_cluster_gives_nodes_a_relative_file_reference_made_absolute(llama_dir, policy_file, tmp_path):
    rel = os.path.relpath(policy_file)  # from the directory the script runs in (the test's)
    with launched(tmp_path / "run", llama_dir, "--mode", "colocated", "--kv-pages", "64", "--policy",
                  f"{rel}:Patient", "--policy-arg", "patience_s=7") as (url, run_dir):
        assert len(get_json(f"{url}/cluster")) == 1
        pid = (run_dir / "colocated-0.pid").read_text().strip()
        argv = open(f"/proc/{pid}/cmdline").read().split("\0")
        i = argv.index("--policy")
        assert argv[i:i + 4] == ["--policy", f"{policy_file}:Patient", "--policy-arg", "patience_s=7"]
        assert "patient policy: patience_s=7.0" in (run_dir / "colocated-0.log").read_text()

