"""Header-time placement of an inherited request (too large, the policy's place, park or defer),
shared by the decode node and the simulator.

Where an inherited request's KV goes, decided from its transfer header alone: the decode
node's admission rule, shared by the node (`DecodeNode._admit`) and the simulator (pdtb/sim).

    never fits the device tier at prompt + max_tokens -> REFUSE too_large
    policy.place_arrival: DEVICE -> ACCEPT | HOST (and a host tier the receiver can land
    in) -> PARK | otherwise -> DEFER (no_pages: the prefill side keeps the pages and retries)
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.interface import Arrival, Placement
from kv_transport.admission import Admission
from kv_transport.fail_codes import FailCode


@dataclass(frozen=True)
class Inherited:
    """What the header tells about an inherited request."""

    request_id: str
    tenant: str
    priority: int
    slo_tier: str
    num_pages: int  # pages its KV fills
    num_tokens: int  # tokens of context it arrives with
    num_prompt_tokens: int
    num_output_tokens: int  # tokens already generated (the first, sampled on the prefill side)
    max_tokens: int  # its sampling limit


def never_fits(req: Inherited, scheduler) -> str | None:
    """Why a request can never decode here (its KV at prompt + max_tokens tokens needs more pages
    than the whole device tier), or None. Holding it would only delay the failure."""
    need = max(req.num_pages, scheduler.peak_pages(req.num_prompt_tokens, req.max_tokens))
    have = scheduler.pool.num_pages
    return f"needs {need} pages, the decode pool has {have}" if need > have else None


def place(req: Inherited, scheduler, policy, can_park: bool) -> Admission:
    """The policy's verdict on `req` against this node's pools (refresh, then place_arrival)."""
    bad = never_fits(req, scheduler)
    if bad:
        return Admission.refuse(FailCode.TOO_LARGE, bad)
    st = scheduler.state()
    left = max(0, req.max_tokens - req.num_output_tokens)
    arrival = Arrival(req.request_id, req.tenant, req.priority, req.num_pages, st.now, st.now, req.num_tokens,
                      left, slo_tier=req.slo_tier)
    policy.refresh(scheduler.running, [*scheduler.parked, *scheduler.waiting], st)  # an idle node's view is stale
    where = policy.place_arrival(arrival, len(scheduler.parked) + len(scheduler.waiting), st)
    if not isinstance(where, Placement):
        raise TypeError(f"policy {policy.name}: place_arrival answered {where!r}, not a fairness.Placement")
    if where is Placement.DEVICE:
        return Admission.accept()
    if where is Placement.HOST and scheduler.host_pool is not None and can_park:
        policy.forget(arrival.request_id)  # parked here now: a local candidate, no longer an arrival
        return Admission.park(scheduler.host_pool)  # arrives parked; promoted in policy order
    return Admission.defer(f"policy {policy.name} defers ({where.value})")
