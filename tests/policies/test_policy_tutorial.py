"""docs/policies.md, run as written: its policy file written to a temporary folder outside the
repository, then each of its shell blocks in order (the checks and the simulator here; the real
clusters, the fairness comparison and the frontier in the slow test)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "policies.md"
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```$", re.S | re.M)


def blocks():
    """(files: name -> text, shell blocks in order) of the tutorial."""
    files, shell = {}, []
    for lang, info, body in FENCE.findall(DOC.read_text()):
        m = re.search(r"file=(\S+)", info)
        if m:
            files[m.group(1)] = body
        elif lang == "bash":
            shell.append(body)
    return files, shell


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("my-policy")
    files, _ = blocks()
    assert "lps.py" in files
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def run_block(i: int, folder: pathlib.Path, timeout: float) -> str:
    env = dict(os.environ, PDTB=str(ROOT), PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
    script = "set -euo pipefail\n" + blocks()[1][i]
    p = subprocess.run(["bash", "-c", script], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"block {i} failed:\n{script}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
    return p.stdout


def test_the_tutorial_has_its_steps():
    files, shell = blocks()
    assert list(files) == ["lps.py"] and len(shell) == 4
    assert not (ROOT / "lps.py").exists()  # the policy lives outside the repository


def test_show_and_check(folder):
    out = run_block(0, folder, 300)
    assert "half_life_s (float, default 10.0; > 0.0)" in out
    assert "source: lps.py:LeastPageSeconds; settings: {'half_life_s': 5.0}" in out
    assert out.count(" ok ") + out.count(" ok\n") == 6 and out.rstrip().endswith("passed"), out


@pytest.mark.slow  # pdtb sim at H100 scale in a process of its own
def test_in_the_simulator_at_h100_scale(folder):
    out = run_block(1, folder, 300)
    rows = {ln.split()[1]: ln.split() for ln in out.splitlines() if ln.startswith("disagg ")}
    assert set(rows) == {"fcfs", "memfair", "lps"}, out
    import json

    meta = json.loads((folder / "sim-lps.json").read_text())["meta"]
    assert meta["policy_info"] == {"name": "lps", "source": "lps.py:LeastPageSeconds",
                                   "settings": {"half_life_s": 10.0}}


@pytest.mark.slow
def test_on_real_clusters_the_comparison_and_the_frontier(folder):
    try:
        out = run_block(2, folder, 420)
        assert "greedy outputs identical" in out, out
        infos = [ln for ln in out.splitlines() if ln.startswith(("prefill ", "decode "))]
        assert len(infos) == 2 and all("'source': '" + str(folder / "lps.py") + ":LeastPageSeconds'" in ln
                                       and "'half_life_s': 5.0" in ln for ln in infos), out
    finally:
        if (folder / "run-lps").exists():
            subprocess.run(["bash", str(ROOT / "scripts" / "stop_cluster.sh"), "--run-dir", str(folder / "run-lps")],
                           capture_output=True, timeout=120)
    out = run_block(3, folder, 900)
    listed = out.split()
    assert any(p.endswith("disagg-lps.json") for p in listed) and any(p.endswith("disagg-fcfs.json") for p in listed)
    frontier = (folder / "frontier" / "frontier" / "frontier.md").read_text()
    assert "lps" in frontier and "fcfs" in frontier
