"""The processes of `pdtb bench router`: scripted nodes, the router under test, the relay.

Each is a child process on loopback with ephemeral ports, read for its ready line within a
deadline, and stopped (SIGTERM, then SIGKILL) when the bench ends, whatever way it ends.
"""
from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

START_TIMEOUT_S = 60.0


class Child:
    """A child process whose stdout is read line by line until its ready line."""

    def __init__(self, argv: list[str], name: str, log_dir: Path, stdin: bool = False) -> None:
        self.name = name
        self.stderr = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.ps = psutil.Process(self.proc.pid)
        self.lines: queue.Queue = queue.Queue()  # stdout lines, then None at its end
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def lines_until(self, ready: str, timeout: float = START_TIMEOUT_S) -> list[str]:
        """Lines printed before (and including) the first that starts with `ready`."""
        deadline, lines = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"{self.name} exited during start-up (log: {self.stderr.name})")
            lines.append(line.strip())
            if line.startswith(ready):
                return lines
        raise RuntimeError(f"{self.name} not ready within {timeout:.0f} s (log: {self.stderr.name})")

    def ready(self, line: str) -> list[str]:
        """lines_until(line), the process stopped if it never comes."""
        try:
            return self.lines_until(line)
        except BaseException:
            self.stop()
            raise

    def cpu_s(self) -> float:
        """The process's own CPU seconds so far (user + system)."""
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self.stderr.close()


class Attached:
    """Processes this bench did not start (a cluster's routers): their CPU time, summed."""

    def __init__(self, ps: list[psutil.Process]) -> None:
        self.ps = ps

    def cpu_s(self) -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.ps))


def start_nodes(log_dir: Path, tokens: list[int], colocated: int, prefill: int, decode: int,
                step_ms: float) -> tuple[Child, dict[str, list[str]]]:
    """The scripted nodes' process, and their control addresses by role."""
    argv = [sys.executable, "-m", "pdtb.microbench.router_nodes", "--colocated", str(colocated),
            "--prefill", str(prefill), "--decode", str(decode), "--step-ms", str(step_ms),
            "--tokens", ",".join(map(str, tokens)), "--log", str(log_dir / "node_log.json")]
    child = Child(argv, "nodes", log_dir, stdin=True)
    addrs: dict[str, list[str]] = {}
    for line in child.ready("READY"):
        if line.startswith("NODE "):
            _, role, addr = line.split()
            addrs.setdefault(role, []).append(addr)
    return child, addrs


def set_step(nodes: Child, step_ms: float) -> None:
    """Every scripted node steps every `step_ms` from now on."""
    nodes.proc.stdin.write(f"step {step_ms}\n")
    nodes.proc.stdin.flush()


def end_nodes(nodes: Child, log_dir: Path, timeout: float = 30.0) -> dict:
    """Close the nodes' stdin (they write their log and exit); the log."""
    nodes.proc.stdin.close()
    nodes.proc.wait(timeout)
    nodes.stderr.close()
    with open(log_dir / "node_log.json") as f:
        return json.load(f)


class Routers:
    """Router processes behind one port: their CPU seconds summed."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children

    def cpu_s(self) -> float:
        return sum(c.cpu_s() for c in self.children)

    def stop(self) -> None:
        for c in self.children:
            c.stop()


def start_routers(log_dir: Path, model_dir: str, nodes: dict[str, list[str]], extra: list[str], count: int = 1,
                  name: str = "router") -> tuple[Routers, str]:
    """`count` router processes on one ephemeral port (SO_REUSEPORT past the first)."""
    base = [sys.executable, "-m", "pdtb", "router", "--model", model_dir, "--log-level", "warning", *extra]
    for role, addrs in nodes.items():
        base += [x for a in addrs for x in ("--node", f"{role}={a}")]
    children, url, port = [], "", "0"
    many = ["--reuse-port", "--routers", str(count)] if count > 1 else []
    try:
        for i in range(count):
            argv = base + ["--port", port] + (many + ["--router-index", str(i)] if many else [])
            children.append(Child(argv, f"{name}-{i}", log_dir))
            url = children[-1].ready("router listening on ")[-1].rsplit(" ", 1)[-1]
            port = url.rsplit(":", 1)[-1]
    except BaseException:
        Routers(children).stop()
        raise
    return Routers(children), url


def start_relay(log_dir: Path, nodes: list[str]) -> tuple[Child, str]:
    argv = [sys.executable, "-m", "pdtb.microbench.sse_relay", *[x for a in nodes for x in ("--node", a)]]
    child = Child(argv, "relay", log_dir)
    url = child.ready("relay listening on ")[-1].rsplit(" ", 1)[-1]
    return child, url


def long_context_copy(model_dir: str, out: Path, max_positions: int) -> str:
    """The checkpoint's tokenizer and config with a longer context: the router reads no weights,
    and the scripted nodes take any prompt, so prompts past the checkpoint's own limit can be
    tokenized and sent."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 0)), max_positions)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def wait_healthy(url: str, timeout: float = START_TIMEOUT_S) -> None:
    """Until the router's /health is 200 (every node answered a ping)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)  # (start-up poll of another process: no event to wait on)
    raise RuntimeError(f"router at {url} not healthy within {timeout:.0f} s")
