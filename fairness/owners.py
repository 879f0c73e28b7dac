"""Who a memory quota belongs to (`FairnessConfig.quota_by`, `--quota-by`).

memfair keys entitlements, usage, borrowing, reclaim order and the step shares by the quota
owner of a request, a string whose prefix names the granularity:

    quota_by    owner of a request (a Sequence or an Arrival)
    tenant      "t:" + tenant              (the default: tenants share the pool)
    priority    "p:" + str(priority)       (the tenants of one class share one entitlement)
    request     "r:" + request_id          (every request is entitled to an equal share)
    slo-tier    "s:" + slo_tier            (a request without a tier is its tenant's own tier:
                                            "s:" + tenant, so untiered tenants keep tenant quotas)

A request's tier is its HTTP `slo_tier` field, else the router's `--tenant-tier` default for
its tenant, else none. The weight of an owner is the tenant weights table's entry for its name
without the prefix (a tenant's weight under tenant quotas), 1.0 when there is none.
"""
from __future__ import annotations


def quota_owner(req, cfg) -> str:
    """The quota owner of `req` (a Sequence or an Arrival) under `cfg.quota_by`."""
    by = cfg.quota_by
    if by == "tenant":
        return "t:" + req.tenant
    if by == "priority":
        return f"p:{req.priority}"
    if by == "request":
        return "r:" + req.request_id
    return "s:" + (req.slo_tier or req.tenant)


def owner_name(owner: str) -> str:
    """`owner` without its granularity prefix: the tenant, class, request id or tier."""
    return owner.partition(":")[2]
