"""The README as a user meets it: at most 150 lines, every link leads to a file, every command
of its command table answers `--help`, and its cluster block runs as written (on an ephemeral
port and a temporary run directory instead of 8000 and runs/c1)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from cluster_util import ROOT, alive

README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def table_commands() -> list[str]:
    """The commands of the README's command table, each as a user would type it."""
    out = []
    for row in section("Commands").splitlines():
        if not row.startswith("| `"):
            continue
        first = row.split("|")[1]
        out += re.findall(r"`([^`]+)`", first)
    return out


def test_the_readme_is_short_and_its_links_lead_somewhere():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not there"


def test_the_command_table_is_the_tools_there_are():
    cmds = table_commands()
    assert len(cmds) >= 20 and "bash scripts/launch_cluster.sh" in cmds and "pdtb sim" in cmds


@pytest.mark.parametrize("cmd", table_commands())
def test_every_command_in_the_table_answers_help(cmd):
    argv = shlex.split(cmd)
    if argv[0] == "pdtb":
        argv = [sys.executable, "-m", "pdtb", *argv[1:]]
    p = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"))
    assert p.returncode == 0 and p.stdout.strip(), f"{cmd} --help: {p.returncode}\n{p.stderr[-2000:]}"


@pytest.mark.slow
def test_the_cluster_block_runs_as_written(tmp_path):
    (block,) = [body for lang, body in FENCE.findall(section("A cluster in three lines")) if lang == "bash"]
    run = tmp_path / "c1"
    script = (block.replace("--port 8000", "--port 0").replace("runs/c1", str(run))
              .replace("localhost:8000", f"$(cat {run}/url)"))
    assert script.count(str(run)) == 3 and "8000" not in script
    lines = script.strip().splitlines()
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    pids = []
    try:
        up = subprocess.run(["bash", "-c", lines[0]], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        pids = [int(p.read_text()) for p in run.glob("*.pid")]  # (the stop script removes these files)
        assert up.returncode == 0 and "READY http://127.0.0.1:" in up.stdout, up.stderr[-3000:]
        ask = subprocess.run(["bash", "-c", lines[1]], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        body = json.loads(ask.stdout)
        assert 1 <= body["usage"]["completion_tokens"] <= 8 and body["choices"][0]["finish_reason"], ask.stdout
    finally:
        down = subprocess.run(["bash", "-c", lines[2]], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert len(pids) == 3 and not [p for p in pids if alive(p)]  # prefill, decode, router: all gone


def test_the_two_commands_set_up_and_plan():
    """The README's two commands: quickstart.sh sets up and checks its comparison's plan
    (--dry-run: no cluster; the comparison itself runs in docs/policies.md's tutorial test), and
    test.sh is what CI runs (.ci/run)."""
    (block,) = [body for lang, body in FENCE.findall(section("Two commands")) if lang == "bash"]
    cmds = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert cmds == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "scripts/quickstart.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0 and p.stdout.splitlines()[-2:] == ["fcfs fcfs", "memfair memfair"], p.stdout + p.stderr
