"""Where a cluster's processes go: one placement group per role, one bundle per node.

A bundle holds what the user asked for that role (`--node-resources 'decode={"GPU": 1}'`;
default one CPU), and the group's strategy spreads the role's nodes over Ray nodes or packs
them (`--placement spread|pack`). Groups and actors are named after the cluster and detached,
so they outlive the command that made them, and `pdtb cluster down` finds them by name.
"""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group


STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}


def group_name(cluster: str, role: str) -> str:
    return f"{cluster}:{role}"


def bundle_for(resources: dict | None) -> dict:
    """A role's bundle: the user's resources, or one CPU."""
    return dict(resources) if resources else {"CPU": 1}


def actor_options(bundle: dict) -> dict:
    """What the actor asks of its bundle: all of it (CPU and GPU counts, custom resources)."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": custom}


def make_group(cluster: str, role: str, count: int, bundle: dict, placement: str, timeout: float):
    """Create and wait for the role's group; RuntimeError naming what no Ray node offers."""
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=STRATEGIES[placement],
                         name=group_name(cluster, role), lifetime="detached")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"no room for {count} {role} node(s) of {bundle} ({placement}) after {timeout:.0f}s: "
                           f"no Ray nodes offer those resources (ray status shows what they do)") from None
    return pg
