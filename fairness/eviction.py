"""Victim choice under memory pressure: which running request gives up its device pages, and
the progress guarantee every policy keeps (`spare_oldest`).

Each victim function takes the candidates (running, not yet served this step), the requester
and the state, and returns one candidate. Ties are broken by arrival (newest loses).
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


def named(cfg, candidates: list[Sequence], running: list[Sequence], waiting: list[Sequence], state: SchedState,
          owner) -> Sequence:
    """The victim choice named by `cfg.victim` (--victim); footprint by `owner`'s share use."""
    from fairness.quotas import entitlements, usage

    if cfg.victim != "footprint":
        return VICTIMS[cfg.victim](candidates, state)
    owners = {owner(s) for s in running} | {owner(s) for s in waiting}
    ent = entitlements(owners, cfg, state.device_total)
    use = usage(running, state, owner)
    return footprint(candidates, state, {o: use.get(o, 0) / e for o, e in ent.items() if e > 0}, owner)


def oldest(running: list[Sequence]) -> Sequence | None:
    """The running request every policy lets go on (spare_oldest): the first to arrive."""
    return min(running, key=lambda s: (s.arrival_time, s.request_id), default=None)


def demotable(seq: Sequence, state: SchedState) -> bool:
    """Evicting `seq` now would demote it to the host tier (scheduler.evict), not preempt it."""
    n = state.pages.get(seq.request_id, 0)
    return 0 < n <= state.host_free and seq.num_computed_tokens > 0


def recompute_pages(seq: Sequence, need_pages: int, state: SchedState) -> int:
    """A recompute starts only when its whole context fits: admitted chunk by chunk, it would
    be the first victim again before its prefill ends, and the work is lost."""
    if seq.num_preemptions and not seq.num_computed_tokens:
        return max(need_pages, -(-(seq.num_tokens + 1) // state.page_size))
    return need_pages


def spare_oldest(candidates: list[Sequence], running: list[Sequence], state: SchedState) -> list[Sequence]:
    """The progress guarantee every policy keeps: the oldest running request is not dropped
    for recompute while another candidate can go instead (it may still be demoted, which
    loses no work). Without it two requests that fit only one at a time can preempt each
    other forever, each redoing its prefill and losing it again (memfair did, by
    footprint). With it the oldest always finishes, and then the next oldest."""
    if len(candidates) < 2 or not running:
        return candidates
    first = oldest(running)
    if first not in candidates or demotable(first, state):
        return candidates
    return [c for c in candidates if c is not first]
