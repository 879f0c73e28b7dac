"""Victim choice under memory pressure: which running request gives up its device pages.

Each function takes the candidates (running, not yet served this step), the requester and
the state, and returns one candidate. Ties are broken by arrival (newest loses).
"""
from __future__ import annotations

from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


def lru(cands: list[Sequence], state: SchedState) -> Sequence:
    """Least recently stepped first. A whale touches all its pages every step, so the pages
    that look cold are the ones of requests that just arrived or just came back: LRU quietly
    protects whales. This is the baseline's choice."""
    return min(cands, key=lambda s: (s.last_step, -s.arrival_time))


def newest(cands: list[Sequence], state: SchedState) -> Sequence:
    """vLLM: the most recently arrived request."""
    return max(cands, key=lambda s: s.arrival_time)


def least_progress(cands: list[Sequence], state: SchedState) -> Sequence:
    """SGLang: the request with the fewest generated tokens (least work lost)."""
    return min(cands, key=lambda s: (s.num_output_tokens, -s.arrival_time))


def _tenant(seq: Sequence) -> str:
    return seq.tenant


def footprint(cands: list[Sequence], state: SchedState, over: dict[str, float], owner_of=_tenant) -> Sequence:
    """Most over-quota owner first (`over[owner_of(seq)]` = usage / entitlement; the owner is
    the tenant unless told), then the largest footprint within it: pages come back from
    whoever holds the most beyond its share. The footprint is what evicting gives back
    (SchedState.gain): a page shared with four other requests stays held if one of them goes,
    so evicting a request for it hurts that request and frees nothing."""
    gain = state.gain
    return max(cands, key=lambda s: (over.get(owner_of(s), 0.0), gain.get(s.request_id, 0), s.arrival_time))


VICTIMS = {"lru": lru, "newest": newest, "least_progress": least_progress}
