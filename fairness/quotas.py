"""Memory quotas: weighted owner entitlements and priority-class reservations.

A quota owner (fairness/owners.py: a tenant by default, or a class, a request, an SLO tier)
is entitled to its weighted share of the device tier among the owners the shares are split
between: with dynamic shares those that have work (running, parked or waiting), an idle
owner's share lent to the others and coming back through `reclaim` when it returns; with
static shares every owner seen lately (memfair decides which).
"""
from __future__ import annotations

from collections import defaultdict

from fairness.config import FairnessConfig
from fairness.owners import owner_name
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


def usage(seqs: list[Sequence], state: SchedState, owner_of) -> dict[str, int]:
    """Device pages charged per quota owner (`owner_of(seq)`): pages held, a page shared with
    other requests counted by the pool's charge rule (SchedState.charge)."""
    use: dict[str, float] = defaultdict(int)
    charge = state.charge
    for s in seqs:
        use[owner_of(s)] += charge.get(s.request_id, 0)
    return dict(use)


def owner_weight(owner: str, cfg: FairnessConfig) -> float:
    """The tenant weights table's entry for the owner's name (a tenant's weight under tenant
    quotas), 1.0 when there is none."""
    return cfg.weight(owner_name(owner))


def entitlements(owners: set[str], cfg: FairnessConfig, total_pages: int) -> dict[str, float]:
    """Weighted share of `total_pages` for each of `owners`."""
    wsum = sum(owner_weight(o, cfg) for o in owners)
    return {o: total_pages * owner_weight(o, cfg) / wsum for o in owners} if wsum else {}


def reserved_for_others(seq: Sequence, seqs: list[Sequence], cfg: FairnessConfig, state: SchedState) -> int:
    """Free pages `seq` may not take: unused reservations of classes more urgent than its own."""
    blocked = 0
    for cls, share in cfg.class_reservations.items():
        if seq.priority <= int(cls):
            continue
        used = sum(state.charge.get(s.request_id, 0) for s in seqs if s.priority <= int(cls))
        blocked += max(0, int(share * state.device_total) - used)
    return blocked


def water_fill(demand: dict[str, float], weight: dict[str, float], total: float) -> dict[str, float]:
    """Weighted max-min fair split of `total` among the keys of `demand`: each gets at most its
    demand, and what one does not want goes to the others in proportion to their weights."""
    out: dict[str, float] = {}
    left, open_ = float(total), {k for k, d in demand.items() if d > 0}
    while open_ and left > 1e-9:
        wsum = sum(weight[k] for k in open_)
        sated = {k for k in open_ if demand[k] - out.get(k, 0.0) <= left * weight[k] / wsum}
        if not sated:
            for k in open_:
                out[k] = out.get(k, 0.0) + left * weight[k] / wsum
            return out
        for k in sated:
            left -= demand[k] - out.get(k, 0.0)
            out[k] = float(demand[k])
        open_ -= sated
    return out
