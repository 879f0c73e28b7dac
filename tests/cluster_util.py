"""Real clusters for the tests (real processes, loopback, ephemeral ports): launched and stopped
through the scripts (`launched`), or a node and a router started here so that a node's own exit
code and log can be read (`colocated_with_router`, `disagg_with_router`); and what the tests
read from a running one."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PDTB = str(Path(sys.executable).with_name("pdtb"))


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


# ---- one node and a router, started here so that the node's exit code can be read -------------
@contextmanager
def process(args: list[str], log: Path):
    """A `pdtb ...` process in its own process group, output to `log`; killed on the way out."""
    with open(log, "w") as f:
        proc = subprocess.Popen([PDTB, *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def start_node(stack: ExitStack, role: str, model: str, run_dir: Path, *args: str) -> tuple:
    """Start one node; returns (process, NODE READY addresses, log)."""
    addr, log = run_dir / f"{role}.json", run_dir / f"{role}.log"
    proc = stack.enter_context(process([role, "--model", model, "--node-id", f"{role[:2]}-0", "--addr-file",
                                        str(addr), *args], log))
    return proc, addr, log


def wait_ready(proc: subprocess.Popen, addr: Path, log: Path) -> dict:
    wait_until(lambda: addr.exists() or proc.poll() is not None, 120, what=f"{log.stem} ready")
    assert proc.poll() is None, log.read_text()[-2000:]
    return get_json_file(addr)


def start_router(stack: ExitStack, model: str, run_dir: Path, nodes: list[str], procs: list | None = None) -> str:
    """Start a router on the nodes; returns its URL (and appends its process to `procs`)."""
    rlog = run_dir / "router.log"
    router = stack.enter_context(process(["router", "--model", model, "--port", "0",
                                          *(a for n in nodes for a in ("--node", n))], rlog))
    if procs is not None:
        procs.append(router)

    def url():
        m = re.search(r"router listening on (http://\S+)", rlog.read_text())
        return m.group(1) if m else (router.poll() is not None and "exited")

    u = wait_until(url, 60, what="router listening")
    assert u != "exited", rlog.read_text()[-2000:]
    wait_until(lambda: router_healthy(u), 30, what="/health 200")
    return u


@contextmanager
def colocated_with_router(model: str, run_dir: Path, *node_args: str):
    """Yield (node process, router url, node log) for one colocated node behind a router."""
    run_dir.mkdir(parents=True)
    with ExitStack() as stack:
        node, addr, log = start_node(stack, "colocated", model, run_dir, *node_args)
        ctrl = wait_ready(node, addr, log)["ctrl"]
        yield node, start_router(stack, model, run_dir, [f"colocated={ctrl}"]), log


@contextmanager
def disagg_with_router(model: str, run_dir: Path, *decode_args: str):
    """Yield (decode process, router url, decode log) for 1 prefill + 1 decode behind a router."""
    run_dir.mkdir(parents=True)
    with ExitStack() as stack:
        started = [start_node(stack, "decode", model, run_dir, *decode_args),
                   start_node(stack, "prefill", model, run_dir, "--kv-pages", "400")]
        ctrls = [f"{p[2].stem}={wait_ready(*p)['ctrl']}" for p in started]
        yield started[0][0], start_router(stack, model, run_dir, ctrls), started[0][2]


def get_json_file(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- reading a running cluster -------------------------------------------------------------------
# ---- cluster helpers -------------------------------------------------------------------------------
def vocab_of(url: str) -> int:
    return get_json(f"{url}/v1/models")["data"][0]["vocab_size"]


def ready_info(run_dir: Path, name: str) -> dict:
    """The node's NODE READY json (its bound addresses) from its log."""
    for line in (run_dir / f"{name}.log").read_text().splitlines():
        if line.startswith("NODE READY "):
            return json.loads(line[len("NODE READY "):])
    raise AssertionError(f"no NODE READY line in {name}.log")


def kill9(run_dir: Path, name: str) -> int:
    pid = int((run_dir / f"{name}.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 10, what=f"{name} gone")
    return pid


def node(url: str, node_id: str) -> dict:
    return next(n for n in get_json(f"{url}/cluster") if n["id"] == node_id)


def healthy_nodes_free(url: str) -> bool:
    nodes = [n for n in get_json(f"{url}/cluster") if n["healthy"]]
    return bool(nodes) and all(n["pages_free"] == n["pages_total"] and n["running"] == 0 for n in nodes)
