"""Shares across a pool of nodes: what the other nodes hold, and a tenant's share of this node.

A tenant's share of KV memory is cluster-wide: with four decode nodes, a tenant spread over
all four is entitled to its weighted share of the four pools together, not to a share of each.
The router (pdtb/router/registry.py) and the simulator (pdtb/sim/cluster.py) tell each decode or
colocated node, with every ping, what the others hold (`ClusterView`, from their last stats);
a policy reads it as `self.cluster` (None: this node alone, or no view yet).

`node_shares` turns it into this node's entitlements: each tenant's cluster-wide share, less
what it holds elsewhere, is what it may claim here; those claims are split over this node's
pool by weighted max-min fairness. A tenant served elsewhere beyond its share claims nothing
here (others come first); a tenant only here may claim up to its whole cluster-wide share.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fairness.quotas import water_fill


@dataclass(frozen=True)
class ClusterView:
    """The pool's other nodes (decode and colocated) as last seen: their device pages in all,
    and the device pages each tenant holds there."""

    other_pages: int
    elsewhere: dict = field(default_factory=dict)  # tenant -> device pages on the other nodes


def views(nodes: dict[str, tuple[int, dict]]) -> dict[str, ClusterView]:
    """Per node id, the view of the others, from {node id: (device pages, {tenant: pages})}.
    Empty for a pool of one node (no view to give)."""
    if len(nodes) < 2:
        return {}
    total_pages = sum(p for p, _ in nodes.values())
    total: dict[str, int] = {}
    for _, tenants in nodes.values():
        for t, n in tenants.items():
            total[t] = total.get(t, 0) + int(n)
    out = {}
    for nid, (pages, tenants) in nodes.items():
        elsewhere = {t: n - int(tenants.get(t, 0)) for t, n in total.items()}
        out[nid] = ClusterView(total_pages - pages, {t: n for t, n in elsewhere.items() if n > 0})
    return out


def node_shares(local: dict[str, float], weight, view: ClusterView, pages: int) -> dict[str, float]:
    """This node's entitlement per tenant among `local` (tenant -> anything; the tenants with
    work here), given the others' `view`; `weight(tenant)` its weight."""
    tenants = set(local) | set(view.elsewhere)
    wsum = sum(weight(t) for t in tenants)
    total = pages + view.other_pages
    claim = {t: max(0.0, total * weight(t) / wsum - view.elsewhere.get(t, 0)) for t in local}
    got = water_fill(claim, {t: weight(t) for t in local}, pages)
    return {t: got.get(t, 0.0) for t in local}
