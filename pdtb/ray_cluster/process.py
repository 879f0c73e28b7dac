"""A pd-testbed process with a log, its READY line, SIGTERM then SIGKILL, and the parent-death
signal so it never outlives its actor.

One pd-testbed process (a node or the router) started and watched by whatever hosts it: a
Ray actor (pdtb/ray_cluster/actors.py) or a test. Plain Python, no Ray.

The process is a child of its host with the parent-death signal set to SIGKILL, so it never
outlives the actor that started it: a Ray node that dies takes its workers with it, and the
kernel then ends their pd-testbed processes, whose dropped connections the router sees as it
sees any killed node. Its output goes to a log file; `start` waits, bounded, for the line that
says it is up and returns what that line says.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h
READY = {"router": re.compile(r"router listening on (http://\S+)")}
ADMIN = re.compile(r"router admin on (http://\S+)")  # printed before the listening line, with --peer-dir
NODE_READY = re.compile(r"^NODE READY (\{.*\})$", re.M)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    os.setsid()  # its own process group: a stop reaches every process it starts


class NodeProcess:
    """`python -m pdtb ROLE ARGS...` with a log file, started once, stopped once."""

    def __init__(self, role: str, args: list[str], log_dir: str | None = None, name: str | None = None) -> None:
        self.role, self.args = role, list(args)
        self.name = name or role
        self._own_dir = log_dir is None  # a temporary directory of its own: removed by stop()
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="pdtb-ray-")) / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self, timeout: float) -> dict:
        """Start the process and wait until it says it is up: a node's NODE READY line (its
        addresses), the router's listening line ({"url": ...}, and "admin_url": its private
        admin address where it has one). RuntimeError with the log's tail
        if it exits or is silent for `timeout` seconds."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdtb", self.role, *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            info = self._ready()
            if info is not None:
                self.info = {**info, "pid": self.proc.pid, "log": str(self.log_path)}
                return self.info
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode} during start-up" if self.proc.poll() is not None \
                    else f"not up after {timeout:.0f}s"
                tail = self.tail()
                self.stop(5)
                raise RuntimeError(f"{self.name} {why}:\n{tail}")
            time.sleep(0.1)

    def _ready(self) -> dict | None:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        if self.role in READY:
            m, admin = READY[self.role].search(text), ADMIN.search(text)
            return None if m is None else {"url": m.group(1), **({"admin_url": admin.group(1)} if admin else {})}
        m = NODE_READY.search(text)
        return json.loads(m.group(1)) if m else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM (a node drains, the router finishes what it can), SIGKILL after `timeout`
        seconds; every process of its group goes. Returns its exit code."""
        if self.proc is None:
            return None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything it started and left behind
        except (ProcessLookupError, PermissionError):
            pass
        if self._own_dir:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)
        return self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def with_node_id(args: list[str], node_id: str) -> list[str]:
    """A member's node arguments with `--node-id node_id`. A replacement takes a new id: the
    router and the prefill nodes tell decode nodes apart by id, and the node it replaces stays
    listed (down) beside it."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--node-id":
            skip = True  # (its value follows)
        elif not a.startswith("--node-id="):
            out.append(a)
    return [*out, "--node-id", node_id]  # (argparse: the last one counts)
