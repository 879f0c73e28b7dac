"""Start and stop real clusters through the launch scripts (real processes, loopback)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in run_dir.glob("*.pid")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_until(pred, timeout: float, every: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def router_healthy(url: str) -> bool:
    """The router's /health says ok. False while it answers 503 (not every node has answered a
    ping yet) or cannot be reached (a node restarting): a predicate for wait_until."""
    try:
        return get_json(f"{url}/health", timeout=5)["status"] == "ok"
    except OSError:  # urllib's HTTPError and URLError included
        return False


def all_pages_free(url: str) -> bool:
    nodes = get_json(f"{url}/cluster")
    return all(n["pages_free"] == n["pages_total"] for n in nodes)


@contextmanager
def launched(run_dir: Path, model_dir: str, *args: str, timeout: float = 240):
    """Yield (url, run_dir) of a cluster started by scripts/launch_cluster.sh; always stop it."""
    cmd = ["bash", str(ROOT / "scripts/launch_cluster.sh"), "--run-dir", str(run_dir), "--model", model_dir,
           "--port", "0", "--timeout", "180", *args]
    pids: list[int] = []
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        pids = _pids(run_dir)
        assert r.returncode == 0, f"launch failed:\n{r.stdout}\n{r.stderr}"
        ready = [ln for ln in r.stdout.splitlines() if ln.startswith("READY ")]
        assert len(ready) == 1, r.stdout
        yield ready[0].split()[1], run_dir
    finally:
        pids = pids or _pids(run_dir)
        subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--timeout", "20"],
                       capture_output=True, text=True, timeout=60)
        for pid in pids:  # belt and braces: never leave a process behind, even if stop failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
