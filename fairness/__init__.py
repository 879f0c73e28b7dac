"""Decode-side fairness controller: admission of inherited pages against memory quotas,
victim choice for eviction to the host tier, bandwidth caps, SLO attribution.

Policies are small objects (one file each) answering `pdtb.engine.sched_policy.SchedPolicy`,
registered here by name and chosen with `--policy`.
"""
from __future__ import annotations

from fairness.base import BasePolicy
from fairness.config import FairnessConfig
from fairness.fcfs import FcfsPolicy
from fairness.mcsf import McsfPolicy
from fairness.memfair import MemFairPolicy
from fairness.priority import PriorityPolicy
from fairness.vtc import VtcPolicy

POLICIES: dict[str, type] = {p.name: p for p in (FcfsPolicy, MemFairPolicy, VtcPolicy, McsfPolicy, PriorityPolicy)}


def make_policy(name: str, config: FairnessConfig | None = None) -> BasePolicy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


__all__ = ["POLICIES", "make_policy", "FairnessConfig", "BasePolicy"]
