"""scripts/_opts.sh, the option parser the scripts share: on a throwaway script
(values, flags, arrays, help, refusals), then each script's own refusal and help, none of which
starts any work."""
from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTS = ROOT / "scripts" / "_opts.sh"
SCRIPTS = ("chaos_results", "migration_results", "prefix_results", "ray_results", "router_results", "sim_results",
           "transport_results", "compare_transports", "frontier", "gpu_check", "results", "same_decisions",
           "scorecard", "validate_sim")

THROWAWAY = """#!/usr/bin/env bash
# A throwaway for the option parser.
#
#   t.sh [--out DIR] [--quick] [--tag T]... [--repeat | --repeat-sets LIST]
set -euo pipefail
source "@OPTS@"
OUT="none" QUICK=0 FWD=() TAGS=() REPEAT=()
main() {
  local NOTE="none"
  opts_parse "--out=OUT --quick=QUICK:1 --fwd=FWD:(--fwd,on) --tag=TAGS+
    --repeat=REPEAT:(--repeat) --repeat-sets=REPEAT(--repeat-sets) --note=NOTE" -- "$@"
  echo "NOTE=<$NOTE>"
}
main "$@"
echo "OUT=<$OUT> QUICK=<$QUICK> global NOTE=<${NOTE-unset}>"
for name in FWD TAGS REPEAT; do
  declare -n arr="$name"
  printf '%s=' "$name"; [ "${#arr[@]}" = 0 ] || printf '<%s>' "${arr[@]}"; echo
  declare +n arr
done
"""


def bash(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30, cwd=cwd)


@pytest.fixture
def throwaway(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "t.sh"
    path.write_text(THROWAWAY.replace("@OPTS@", str(OPTS)))
    return path


def test_values_flags_and_arrays_are_set_as_declared(throwaway):
    res = bash(str(throwaway), "--out", "a b $(touch pwned)", "--quick", "--fwd", "--tag", "x",
               "--tag", "y z", "--repeat", "--repeat-sets", "s1 s2", "--note", "n", cwd=throwaway.parent)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.splitlines() == [
        "NOTE=<n>",  # a local of the caller's is set, not a global beside it
        "OUT=<a b $(touch pwned)> QUICK=<1> global NOTE=<unset>",
        "FWD=<--fwd><on>",
        "TAGS=<x><y z>",
        "REPEAT=<--repeat-sets><s1 s2>",  # the later of two options on one variable wins
    ]
    assert not (throwaway.parent / "pwned").exists()  # a value is data, never run


def test_without_options_the_defaults_stand(throwaway):
    res = bash(str(throwaway), cwd=throwaway.parent)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["NOTE=<none>", "OUT=<none> QUICK=<0> global NOTE=<unset>",
                                       "FWD=", "TAGS=", "REPEAT="]


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_is_the_header_comment(throwaway, flag):
    res = bash(str(throwaway), "--quick", flag, "--bogus", cwd=throwaway.parent)
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout == ("A throwaway for the option parser.\n\n"
                          "  t.sh [--out DIR] [--quick] [--tag T]... [--repeat | --repeat-sets LIST]\n")


@pytest.mark.parametrize("args,says", [
    (["--bogus"], "unknown option --bogus"),
    (["--quick", "word"], "unknown option word"),
    (["-q"], "unknown option -q"),
    ([""], "unknown option "),
    (["--out"], "--out needs a value"),
    (["--tag", "--quick"], "--tag needs a value"),
    (["--repeat-sets"], "--repeat-sets needs a value"),
])
def test_a_bad_command_line_is_refused_in_one_line(throwaway, args, says):
    res = bash(str(throwaway), *args, cwd=throwaway.parent)
    assert (res.returncode, res.stderr, res.stdout) == (2, f"t: {says}\n", "")


def test_a_bad_spec_is_refused(tmp_path):
    path = tmp_path / "t.sh"
    path.write_text(f'source "{OPTS}"\nopts_parse "--out=1OUT" -- "$@"\necho ran\n')
    res = bash(str(path), cwd=tmp_path)
    assert (res.returncode, res.stdout) == (2, "") and "bad spec item '--out=1OUT'" in res.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_refuses_an_unknown_option_by_its_name(tmp_path, name):
    res = bash(str(ROOT / "scripts" / f"{name}.sh"), "--bogus", cwd=tmp_path)
    assert (res.returncode, res.stderr, res.stdout) == (2, f"{name}: unknown option --bogus\n", "")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_help_names_every_option_it_takes(tmp_path, name):
    path = ROOT / "scripts" / f"{name}.sh"
    spec = re.search(r'opts_parse "([^"]*)" --', path.read_text()).group(1)
    res = bash(str(path), "--help", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "" and "set -euo" not in res.stdout
    missing = [opt for opt in re.findall(r"(--[\w-]+)=", spec) if opt not in res.stdout]
    assert missing == [], f"{name}.sh --help leaves out {missing}"
