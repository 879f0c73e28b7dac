"""The Ray actors of a cluster: one per pd-testbed process, and its supervisor.

A `ProcessActor` lives on the Ray node its placement gave it, starts its process there bound
to that node's address (`ray.util.get_node_ip_address()`), and reports the addresses the
process printed. Ray places and supervises; the KV bytes and the control messages go between
the processes as on one host (ZeroMQ, or NCCL/gloo), never through Ray.

The `Supervisor` checks every member each second. A member whose actor died (its Ray node
went away) or whose process exited is counted lost; with `restart` it starts a replacement of
the same role in the same placement group (Ray moves the group's bundle to a node that still
has the resources) and adds it to every router (`POST /admin/nodes`, at each router's private
admin address when there are several).
"""
from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util.placement_group import get_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdtb.ray_cluster.process import NodeProcess, with_node_id
from pdtb.router.admin_client import add_replacement

log = logging.getLogger(__name__)


@ray.remote(max_restarts=0)
class ProcessActor:
    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name
        self.proc: NodeProcess | None = None
        self.reported: dict = {}

    def start(self, args: list[str], timeout: float) -> dict:
        """Start the process (`--host` is this Ray node's address) and return what it reported,
        with where it runs."""
        host = ray.util.get_node_ip_address()
        self.proc = NodeProcess(self.role, [*args, "--host", host], name=self.name)
        info = self.proc.start(timeout)
        self.reported = {**info, "role": self.role, "name": self.name, "host": host,
                         "ray_node": ray.get_runtime_context().get_node_id()}
        return self.reported

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def info(self) -> dict:
        return {**self.reported, "alive": self.proc is not None and self.proc.alive()}

    def tail(self) -> str:
        return "" if self.proc is None else self.proc.tail()

    def stop(self, timeout: float) -> int | None:
        return None if self.proc is None else self.proc.stop(timeout)


def start_members(members: dict[str, dict], namespace: str, timeout: float) -> dict[str, dict]:
    """Start process actors in their bundles, all at once; what each process reported, by name."""
    pending = {}
    for name, member in members.items():
        pg = get_placement_group(member["pg"])
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=member["bundle"])
        actor = ProcessActor.options(name=name, namespace=namespace, lifetime="detached", scheduling_strategy=strategy,
                                     **member["options"]).remote(member["role"], name)
        pending[name] = actor.start.remote(member["args"], timeout)
    return dict(zip(pending, ray.get(list(pending.values()), timeout=timeout + 60)))


def start_member(name: str, member: dict, namespace: str, timeout: float) -> dict:
    """Start one process actor in its bundle and return what its process reported."""
    return start_members({name: member}, namespace, timeout)[name]


@ray.remote(max_restarts=0, num_cpus=0)
class Supervisor:
    """Watches the members of one cluster (see the module docstring)."""

    def __init__(self, cluster: str, namespace: str, router_url: str, restart: bool, start_timeout: float,
                 api_key: str | None = None, admin_urls: list[str] | None = None) -> None:
        self.cluster, self.namespace, self.router_url = cluster, namespace, router_url
        # every router's private admin address (several behind one port: one request to the
        # port reaches one of them), else the router's URL
        self.admin_urls = list(admin_urls) if admin_urls else [router_url]
        self.restart, self.start_timeout, self.api_key = restart, start_timeout, api_key
        self.members: dict[str, dict] = {}  # actor name -> {"role", "args", "pg", "bundle", "options"}
        self.lost: list[dict] = []  # {"name", "role", "at", "why", "replaced_by"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdtb-supervisor", daemon=True)
        self._thread.start()

    def watch(self, name: str, member: dict) -> None:
        self.members[name] = member

    def report(self) -> dict:
        return {"members": sorted(self.members), "lost": list(self.lost)}

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            for name, member in list(self.members.items()):
                why = self._check(name)
                if why is None or name not in self.members:
                    continue
                del self.members[name]
                entry = {"name": name, "role": member["role"], "at": time.time(), "why": why, "replaced_by": None}
                self.lost.append(entry)
                log.warning("cluster %s: %s (%s) lost: %s", self.cluster, name, member["role"], why)
                if self.restart:
                    entry["replaced_by"] = self._replace(name, member)

    def _check(self, name: str) -> str | None:
        try:
            actor = ray.get_actor(name, namespace=self.namespace)
            return None if ray.get(actor.alive.remote(), timeout=10) else "its process exited"
        except ValueError:
            return "its actor is gone"
        except ray.exceptions.RayActorError:
            return "its actor died (its Ray node went away?)"
        except ray.exceptions.GetTimeoutError:
            return None  # busy, not known dead: the router's own health check covers a hang

    def _replace(self, name: str, member: dict) -> str | None:
        base = name[len(self.cluster) + 1:].split("~", 1)[0]  # NAME:ROLE-I[~N] -> ROLE-I
        node_id = f"{base}~{int(time.time() * 1000) % 10**9}"
        new = f"{self.cluster}:{node_id}"
        member = {**member, "args": with_node_id(member["args"], node_id)}
        try:
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace))
            except (ValueError, ray.exceptions.RayActorError):
                pass
            info = start_member(new, member, self.namespace, self.start_timeout)
            # the lost node by its address (a router that never heard from it lists it so), else by id
            self._add_to_router(member["role"], info["ctrl"], member.get("ctrl") or name[len(self.cluster) + 1:])
            member["ctrl"] = info["ctrl"]
        except Exception as e:  # noqa: BLE001 - a failed restart is reported, and tried at the next loss
            log.error("cluster %s: could not replace %s: %s", self.cluster, name, e)
            return None
        self.members[new] = member
        return new

    def _add_to_router(self, role: str, address: str, replaces: str) -> None:
        for url in self.admin_urls:
            add_replacement(url, role, address, replaces, self.api_key)
