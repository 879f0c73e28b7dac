"""The launch and stop scripts' own checks, with no node started: bad flag values are refused
before anything runs, and stop_cluster.sh signals only the processes its run dir started."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cluster_util import ROOT, alive

LAUNCH, STOP = str(ROOT / "scripts" / "launch_cluster.sh"), str(ROOT / "scripts" / "stop_cluster.sh")


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags,says", [
    (["--timeout", "abc"], "--timeout wants a whole number, got 'abc'\n"),
    (["--timeout", "1.5"], "--timeout wants a whole number"),
    (["--prefill", "0"], "--prefill must be at least 1, got 0\n"),
    (["--decode", "x"], "--decode wants a whole number"),
    (["--port", "70000"], "--port must be between 0 and 65535, got 70000\n"),
    (["--kv-pages", "0"], "--kv-pages must be at least 1"),
    (["--port", "--run-dir", "x"], "--port needs a value"),
    (["--routers", "0"], "--routers must be at least 1, got 0\n"),
])
def test_a_bad_flag_value_is_refused_before_anything_starts(tmp_path, flags, says):
    res = script(LAUNCH, "--mode", "disagg", "--run-dir", str(tmp_path / "run"), *flags)
    assert res.returncode == 2 and res.stderr.startswith(f"launch_cluster: {says}"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("**/*.pid")) and not list(tmp_path.glob("**/*.log"))


def test_help_is_the_header_only():
    for path in (LAUNCH, STOP):
        out = script(path, "--help").stdout
        assert "set -euo" not in out and out.strip(), out


def test_stop_leaves_alone_a_process_that_is_not_the_clusters(tmp_path):
    """A pid file whose pid now names another process (a crash, a reboot, pids reused): that
    process is not signalled."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "decode-0.pid").write_text(str(other.pid))
        res = script(STOP, "--run-dir", str(tmp_path), "--timeout", "2")
        assert res.returncode == 0 and "not this cluster's" in res.stderr, res.stderr
        assert alive(other.pid) and not list(tmp_path.glob("*.pid"))
    finally:
        other.kill()
        other.wait(10)
