"""Carrying out a fault: signals by pid file, `/admin/migrate`, `/admin/faults`; pauses ended.

Carrying out a campaign's faults against a cluster that launch_cluster.sh started with
--restart-failed (its run dir names every process; its supervisor restarts what exits) and a
router started with --allow-fault-injection (transfer faults, migrations)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import signal
import urllib.error
import urllib.request

from pdtb.chaos.load import Load
from pdtb.local_cluster.supervise import read_argv, restartable
from pdtb.chaos.plan import TRANSFER_FAULTS, Fault, Kind


def http_json(url: str, body: dict | None = None, timeout: float = 10.0):
    req = urllib.request.Request(url, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ours(pid: int, run_dir: pathlib.Path) -> bool:
    """Process `pid` was started for this run dir (PDTB_RUN_DIR in its environment)."""
    try:
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"PDTB_RUN_DIR={run_dir.resolve()}".encode() in env


def cluster_pid(run_dir: pathlib.Path, name: str) -> int:
    """The pid in `name`'s pid file (ROLE-I, or router-0), if that process is this cluster's;
    ProcessLookupError otherwise: a pid file read between a death and its restart may name a pid
    since given to another process, which must never be signalled."""
    pid = int((run_dir / f"{name}.pid").read_text())
    if not ours(pid, run_dir):
        raise ProcessLookupError(f"pid {pid} of {name} is not this cluster's process now")
    return pid


class Injector:
    def __init__(self, url: str, run_dir: pathlib.Path, load: Load, seed: int) -> None:
        self.url, self.run_dir, self.load = url, run_dir, load
        self.rng = random.Random(seed + 1)
        self.paused: set[int] = set()  # pids stopped by a pause, continued at its end or at the campaign's
        self.router_kills: list[float] = []  # campaign times of the router's kills
        self.log: list[dict] = []  # one entry per fault: the plan's and what came of it
        self.ended: set[str] = set()  # nodes whose process this campaign ended and that do not come back

    def pid(self, name: str) -> int:
        """The pid of a plan's target (a node name, or "router"): see cluster_pid."""
        return cluster_pid(self.run_dir, "router-0" if name == "router" else name)

    def node_id(self, name: str) -> str | None:
        """The router's id of node `name` now (a restarted node is NAME~N), if it lists it healthy."""
        ids = [n["id"] for n in http_json(f"{self.url}/cluster")
               if n["healthy"] and (n["id"] == name or n["id"].startswith(name + "~"))]
        return ids[-1] if ids else None

    async def run(self, faults: list[Fault]) -> None:
        for f in faults:
            delay = f.at_s - self.load.now()
            if delay > 0:
                try:  # the campaign's stop ends the wait at once
                    await asyncio.wait_for(self.load.stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if self.load.stop.is_set():
                return
            entry = {**f.to_json(), "done_at_s": round(self.load.now(), 3)}
            try:
                entry["result"] = await self.apply(f)
            except (OSError, ValueError, urllib.error.URLError) as e:  # the router down, a node gone: skipped
                entry["result"] = f"skipped: {type(e).__name__}: {e}"
            self.log.append(entry)
            print(f"chaos {entry['done_at_s']:8.1f}s {f.kind:15s} {f.target:11s} {entry['result']}", flush=True)

    async def apply(self, f: Fault) -> str:
        kind = Kind(f.kind)
        if kind in (Kind.KILL_PREFILL, Kind.KILL_DECODE, Kind.DRAIN):
            self.pid(f.target)  # (a target gone already is skipped without asking the router)
            if (last := await asyncio.to_thread(self.last_of_its_role, f.target)):
                return f"skipped: {last}"
            os.kill(self.pid(f.target), signal.SIGTERM if kind is Kind.DRAIN else signal.SIGKILL)
            if not self.comes_back(f.target):
                self.ended.add(f.target)
            return "SIGTERM" if kind is Kind.DRAIN else "killed"
        if kind is Kind.PAUSE:
            pid = self.pid(f.target)
            os.kill(pid, signal.SIGSTOP)
            self.paused.add(pid)
            asyncio.get_running_loop().call_later(f.param, self.resume, pid)
            return f"stopped for {f.param:.1f} s"
        if kind is Kind.ROUTER_KILL:
            os.kill(self.pid("router"), signal.SIGKILL)
            self.router_kills.append(self.load.now())
            return "killed"
        if kind is Kind.CLIENT_CUT:
            rids = self.load.cut(int(f.param), self.rng)
            return f"closed {len(rids)} stream(s)"
        if kind is Kind.MIGRATE:
            return await asyncio.to_thread(self.migrate, f.target)
        node = await asyncio.to_thread(self.node_id, f.target)
        if node is None:
            return "skipped: the node is not healthy now"
        await asyncio.to_thread(http_json, f"{self.url}/admin/faults",
                                {"node": node, "faults": TRANSFER_FAULTS[kind], "for_s": f.param})
        return f"faults on {node} for {f.param:.1f} s"

    def comes_back(self, target: str) -> bool:
        """Whether the supervisor starts `target` again once its process ends (not a torch-transport node)."""
        return restartable(target.rsplit("-", 1)[0], read_argv(self.run_dir / f"{target}.argv"))

    def last_of_its_role(self, target: str) -> str | None:
        """Why ending `target`'s process would leave its role without a node for good (it is not
        restarted: a torch-transport node), or None. Another node counts if it is healthy, not
        draining, and not one this campaign ended (the router may not have noticed yet)."""
        if self.comes_back(target):
            return None
        role = target.rsplit("-", 1)[0]
        others = [n for n in http_json(f"{self.url}/cluster") if n["role"] == role and n["healthy"]
                  and not n.get("draining") and not n.get("retired") and n["id"] != target
                  and not n["id"].startswith(target + "~") and n["id"].split("~")[0] not in self.ended]
        if others:
            return None
        return f"the last healthy {role} node, and it would not come back (a torch-transport node cannot rejoin its group)"

    def migrate(self, target: str) -> str:
        cluster = http_json(f"{self.url}/cluster")
        to = self.node_id(target)
        sources = [(n["id"], item[0]) for n in cluster if n["role"] == "decode" and n["healthy"] and n["id"] != to
                   for item in (n.get("extra") or {}).get("requests", [])]  # ([request id, tenant, pages])
        if to is None or not sources:
            return "skipped: no decoding request on another healthy decode node"
        why = ""
        for src, rid in self.rng.sample(sources, min(10, len(sources))):  # (stats are up to 0.5 s old: one may be over)
            try:
                http_json(f"{self.url}/admin/migrate", {"request_id": rid, "to": to})
                return f"{rid} from {src} to {to}"
            except urllib.error.HTTPError as e:
                if e.code != 409:
                    raise
                why = e.read()[:200].decode(errors="replace")
        return f"refused by the router: {why}"

    def resume(self, pid: int) -> None:
        if pid in self.paused:
            self.paused.discard(pid)
            if not ours(pid, self.run_dir):  # (it died while stopped, and the pid went to another)
                return
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def resume_all(self) -> None:
        for pid in list(self.paused):
            self.resume(pid)

