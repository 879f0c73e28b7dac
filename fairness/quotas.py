"""Memory quotas: weighted tenant entitlements, per-request caps, priority-class reservations.

A tenant's entitlement is its weighted share of the device tier among the tenants that have
work (running, parked or waiting). An idle tenant's share is lent to the others; it comes back
through `reclaim` when its owner returns.
"""
from __future__ import annotations

from collections import defaultdict

from fairness.config import FairnessConfig
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


def tenant_usage(seqs: list[Sequence], state: SchedState) -> dict[str, int]:
    """Device pages held per tenant."""
    use: dict[str, int] = defaultdict(int)
    for s in seqs:
        use[s.tenant] += state.pages.get(s.request_id, 0)
    return dict(use)


def entitlements(tenants: set[str], cfg: FairnessConfig, total_pages: int) -> dict[str, float]:
    """Weighted share of `total_pages` for each tenant with work."""
    wsum = sum(cfg.weight(t) for t in tenants)
    return {t: total_pages * cfg.weight(t) / wsum for t in tenants} if wsum else {}


def request_cap(seq: Sequence, cfg: FairnessConfig, state: SchedState) -> float:
    """Pages one request may hold. Dynamic: grows with its length (plus a page), up to the pool."""
    return request_cap_tokens(seq.num_tokens, cfg, state)


def request_cap_tokens(num_tokens: int, cfg: FairnessConfig, state: SchedState) -> float:
    """`request_cap` of a request with `num_tokens` tokens of context."""
    cap = cfg.request_cap_frac * state.device_total
    if cfg.dynamic_quota:
        cap = max(cap, -(-(num_tokens + state.page_size) // state.page_size))
    return min(cap, state.device_total)


def reserved_for_others(seq: Sequence, seqs: list[Sequence], cfg: FairnessConfig, state: SchedState) -> int:
    """Free pages `seq` may not take: unused reservations of classes more urgent than its own."""
    blocked = 0
    for cls, share in cfg.class_reservations.items():
        if seq.priority <= int(cls):
            continue
        used = sum(state.pages.get(s.request_id, 0) for s in seqs if s.priority <= int(cls))
        blocked += max(0, int(share * state.device_total) - used)
    return blocked
