"""`pdtb supervise --run-dir DIR`: restarts the processes of a cluster that launch_cluster.sh
started on this host, in place, as the Ray launcher's supervisor does for its actors
(`launch_cluster.sh --restart-failed` starts it).

What it reads in the run dir (launch_cluster.sh writes it):
    ROLE-I.pid        the process serving ROLE-I now (rewritten here at each restart)
    ROLE-I.argv       its command line, NUL-separated
    ROLE-I.log        its log, with the NODE READY line (the node's addresses)
    ROLE-I.stopping   stop_cluster.sh --node ROLE-I: stopped on purpose, not restarted
    url               the router's URL (the shared port of every router)
    router-I.admin    with several routers (launch_cluster.sh --routers N): router I's private admin URL

A process that exits is restarted with its own command line:
    a node    with node id ROLE-I~N (the router keeps the dead one apart, as the Ray launcher's
              replacements do), its log ROLE-I~N.log; once its NODE READY line is there it is
              added to every router (POST /admin/nodes, at each one's private admin address
              when there are several: one request to the shared port reaches only one of them);
    a router  on its port (beside the others with --reuse-port), with every live node's current
              address as its --node list; a lost router's live gauges leave the summed /metrics.
Every loss and restart is one JSON line in supervisor.jsonl. A node of a torch-transport
cluster is not restarted: it cannot rejoin the process group every node joined at start-up.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import time
from dataclasses import dataclass

from pdtb.router.admin_client import add_replacement

log = logging.getLogger("pdtb.supervise")
NAME = re.compile(r"^(router|prefill|decode|colocated)-\d+$")
START_TIMEOUT_S = 180.0  # a restarted process has this long to say it is ready
QUICK_EXIT_S = 10.0  # a process that exits this soon after its start is restarted after a backoff ...
BACKOFF_MAX_S = 30.0  # ... of 1, 2, 4 ... seconds, at most this (a node that cannot start is not spun)


@dataclass
class Member:
    """One process of the cluster, as the supervisor follows it."""

    name: str  # ROLE-I: its pid and argv files
    role: str  # router | prefill | decode | colocated
    argv: list[str]  # its command line as first started
    pid: int = 0  # the process now serving it
    ctrl: str = ""  # a node's control address ("" for the router) ...
    ctrl_pid: int = 0  # ... that of this process (a restart under way has none yet)
    restarts: int = 0
    started: float = 0.0  # monotonic time its process was started here (0: before the supervisor)
    quick_exits: int = 0  # exits in a row within QUICK_EXIT_S of the start: the next restart waits


def node_ready(log_path: pathlib.Path) -> dict | None:
    """The addresses of a node's last NODE READY line in its log, or None."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    ready = [ln for ln in lines if ln.startswith("NODE READY ")]
    return json.loads(ready[-1][len("NODE READY "):]) if ready else None


def read_argv(path: pathlib.Path) -> list[str]:
    """A command line as launch_cluster.sh writes it: each word followed by a NUL."""
    return path.read_bytes().decode().split("\0")[:-1]


def restartable(role: str, argv: list[str]) -> bool:
    """Whether a process of this role and command line can be started again: not a node of a
    torch-transport cluster (torch.distributed lets no process join a running group)."""
    return role == "router" or "--dist-rank" not in argv


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the first `flag VALUE` pair in `argv`, or None."""
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag), None)


def with_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """`argv` with every `flag VALUE` pair removed and, unless value is None, one `flag value`
    appended (argparse keeps the last of a repeated flag; appended so that no other parsing
    matters)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif a.startswith(flag + "="):
            pass
        else:
            out.append(a)
    return out if value is None else [*out, flag, value]


class Supervisor:
    def __init__(self, run_dir: pathlib.Path) -> None:
        self.run_dir = run_dir
        self.members: dict[str, Member] = {}
        self.api_key: str | None = None
        self.stop = asyncio.Event()
        for argv_file in sorted(run_dir.glob("*.argv")):
            name = argv_file.stem
            if not NAME.match(name):
                continue
            argv = read_argv(argv_file)
            m = Member(name, name.rsplit("-", 1)[0], argv, int((run_dir / f"{name}.pid").read_text()))
            if m.role != "router":
                m.ctrl, m.ctrl_pid = (node_ready(run_dir / f"{name}.log") or {}).get("ctrl", ""), m.pid
            else:
                self.api_key = flag_value(argv, "--api-key")
            self.members[name] = m

    def record(self, **entry) -> None:
        with open(self.run_dir / "supervisor.jsonl", "a") as f:
            f.write(json.dumps({"at": time.time(), **entry}) + "\n")

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.follow(m)) for m in self.members.values()]
        log.info("supervising %s", ", ".join(sorted(self.members)))
        await self.stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def follow(self, m: Member) -> None:
        """Restart `m`'s process each time it exits, until the supervisor stops or `m` is
        stopped on purpose. A restarted process is a child (subprocess.Popen: no asyncio child
        watcher, which would kill it when this loop closes), waited for by pidfd and reaped."""
        proc: subprocess.Popen | None = None
        while not self.stop.is_set():
            await wait_pid(m.pid)
            if proc is not None:
                proc.poll()  # (reaped: no zombie)
            if self.stop.is_set():
                return
            if (self.run_dir / f"{m.name}.stopping").exists():
                self.record(name=m.name, event="stopped", pid=m.pid)
                return
            self.record(name=m.name, event="lost", pid=m.pid)
            self.forget_metrics(m)
            m.quick_exits = m.quick_exits + 1 if m.started and time.monotonic() - m.started < QUICK_EXIT_S else 0
            wait = min(BACKOFF_MAX_S, 2.0 ** (m.quick_exits - 1)) if m.quick_exits else 0.0
            log.warning("%s (pid %d) exited: restarting it%s", m.name, m.pid, f" in {wait:g} s" if wait else "")
            try:  # (the supervisor's own stop ends the wait)
                await asyncio.wait_for(self.stop.wait(), wait)
                return
            except asyncio.TimeoutError:
                pass
            try:
                proc = await self.restart(m)
            except Exception as e:  # noqa: BLE001 - whatever it was, this member stays supervised
                self.record(name=m.name, event="restart failed", error=repr(e))
                log.exception("%s: restart failed", m.name)
                m.started = time.monotonic()  # (counts as a quick exit: the next try backs off)
                continue
            if proc is None:
                return

    async def restart(self, m: Member) -> subprocess.Popen | None:
        """Start `m` again; once it is ready, add a node to the router. A process that does not
        get there (not ready in time, not added) is killed: the next round starts it anew."""
        if not restartable(m.role, m.argv):
            self.record(name=m.name, event="not restarted", error="a torch-transport node cannot rejoin its process group")
            return None
        m.restarts += 1
        argv, log_path = self.command(m)
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        m.pid, m.started = proc.pid, time.monotonic()
        (self.run_dir / f"{m.name}.pid").write_text(f"{proc.pid}\n")
        try:
            addrs = await self.wait_ready(m, proc, log_path)
            if m.role != "router":
                old, (m.ctrl, m.ctrl_pid) = m.ctrl, (addrs["ctrl"], proc.pid)
                await asyncio.to_thread(self.add_to_router, m, old)  # (the router may list old by address alone)
        except Exception as e:  # noqa: BLE001 - not ready, not added, a READY line that does not parse
            self.record(name=m.name, event="restart failed", pid=proc.pid, error=str(e))
            log.error("%s: restart failed: %s", m.name, e)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # (its exit brings the next round)
            return proc
        self.record(name=m.name, event="restarted", pid=proc.pid, log=log_path.name, ctrl=m.ctrl)
        return proc

    def command(self, m: Member) -> tuple[list[str], pathlib.Path]:
        if m.role == "router":
            argv = with_flag(m.argv, "--node", None)
            port = (self.run_dir / "url").read_text().strip().rsplit(":", 1)[1]
            argv = with_flag(argv, "--port", port)
            for n in self.members.values():
                if n.role != "router" and n.ctrl and n.ctrl_pid == n.pid and pid_alive(n.pid):
                    # (a node still starting is added by its own restart once ready)
                    argv += ["--node", f"{n.role}={n.ctrl}"]
            return argv, self.run_dir / f"{m.name}~{m.restarts}.log"
        node_id = f"{m.name}~{m.restarts}"
        return with_flag(m.argv, "--node-id", node_id), self.run_dir / f"{node_id}.log"

    async def wait_ready(self, m: Member, proc: subprocess.Popen, log_path: pathlib.Path) -> dict:
        deadline = time.monotonic() + START_TIMEOUT_S
        exited = asyncio.ensure_future(wait_pid(proc.pid))
        try:
            while time.monotonic() < deadline:
                if m.role == "router":
                    text = log_path.read_text(errors="replace") if log_path.exists() else ""
                    if "router listening on " in text:
                        return {}
                elif (addrs := node_ready(log_path)) is not None:
                    return addrs
                try:  # the process's exit ends the wait at once; else look again shortly
                    await asyncio.wait_for(asyncio.shield(exited), 0.1)
                    raise RuntimeError(f"exited with status {proc.wait()} during start-up (see {log_path.name})")
                except asyncio.TimeoutError:
                    pass
            raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f} s (see {log_path.name})")
        finally:
            exited.cancel()

    def add_to_router(self, m: Member, old: str | None) -> None:
        """Add node `m`'s new process to every router, retiring `old` there."""
        for router in sorted((r for r in self.members.values() if r.role == "router"), key=lambda r: r.name):
            add_replacement(self.admin_url(router), m.role, m.ctrl, old, self.api_key)

    def admin_url(self, router: Member):
        """Where to reach `router` alone: a function of no arguments, read at each try (a
        restarted router's admin address is a new one): its admin file with several routers
        (a missing file raises OSError, retried: the router is starting), else the url file."""
        path = self.run_dir / (f"{router.name}.admin" if "--peer-dir" in router.argv else "url")
        return lambda: path.read_text().strip()

    def forget_metrics(self, m: Member) -> None:
        """A router that died without a word: its live gauges leave the summed /metrics (what
        it did exit cleanly does itself: pdtb/router/main.py)."""
        metrics_dir = flag_value(m.argv, "--metrics-dir")
        if m.role == "router" and metrics_dir:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(m.pid, metrics_dir)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


async def wait_pid(pid: int) -> None:
    """Until process `pid` (not a child of this one) exits: its pidfd becomes readable."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    done = asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()
    loop.add_reader(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb supervise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="the run dir of a cluster launch_cluster.sh started")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervise %(levelname)s: %(message)s")
    run_dir = pathlib.Path(a.run_dir).resolve()
    if not (run_dir / "url").exists():
        from pdtb.common import CliError

        raise CliError(f"{run_dir} has no url file: not a running cluster's run dir")

    async def go() -> None:
        sup = Supervisor(run_dir)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, sup.stop.set)
        await sup.run()

    asyncio.run(go())
    return 0
