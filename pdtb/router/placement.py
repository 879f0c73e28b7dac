"""Placement: the nodes one request goes to, a pure function of a snapshot of the nodes (load,
cached prefix or D²LPM credit; fallback decode nodes).

    place(snapshot, ask, route, d2lpm) -> Placement(entry, decode, fallbacks, cached, credit)

    decode     the available decode node with the most free pages where prompt + max_tokens fit
    entry      with a decode node: a prefill node where the prompt fits, by the route
                 load   fewest queued prompt tokens, then fewest running + waiting
                 cache  least prefill work, queued plus not cached (pdtb/router/cache_route.py)
                 d2lpm  longest cached prefix among the nodes the tenant has credit on (fair_route.py)
               else a colocated node where prompt + max_tokens fit, by the route (load: most free pages)
    fallbacks  up to FALLBACKS other decode nodes that could hold the request, most free first

A request that no available pool could ever hold is a 400 (RequestFailed), one with no node to
go to a 503. Nothing here reads a clock, a socket or a node: D²LPM's credit is read, and the
credit the choice costs comes back in `Placement.credit` for the caller to write.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Container, Sequence

from pdtb.router.cache_route import CacheCandidate, CacheChoice, choose_by_cache, score_all
from pdtb.router.fair_route import D2lpmRouter, RouteCandidate
from pdtb.router.node_state import RequestFailed

FALLBACKS = 3  # other decode nodes a disaggregated request may be handed to
ROLES = ("prefill", "decode", "colocated")  # the order refusals are looked for in


@dataclass(frozen=True)
class NodeView:
    """One node as placement sees it: its last report, less what was sent to it since."""

    index: int  # its place in the router's node list
    node_id: str
    role: str  # "prefill" | "decode" | "colocated"
    available: bool  # answered recently, not draining, has not refused since, not tried for this request
    pages_total: int  # KV pages of its pool
    page_size: int  # tokens per page (the router's default where the node reports none)
    free_pages: int  # free pages it reported, less the pages sent to it since
    queued_tokens: int  # prompt tokens waiting at it: reported, plus sent since
    busy: int  # requests running and waiting, as it reported
    kv_addr: str = ""  # decode node: where a hand-off's KV goes
    prefix_ns: str = ""  # namespace of its page hashes ("": no prefix cache)
    hash_page_size: int = 0  # tokens per page of its hashes as reported (0: unknown, no overlap)
    prefix_view: Container[int] = frozenset()  # page hashes the router believes it holds


@dataclass(frozen=True)
class Ask:
    """One request as placement sees it."""

    prompt_ids: Sequence[int]
    max_tokens: int
    tenant: str = ""  # route d2lpm: whose credit pays for it

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def peak_tokens(self) -> int:
        """Prompt and output together: what its KV may grow to."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass(frozen=True)
class Placement:
    """Where one request goes, as positions in the snapshot."""

    entry: int  # gets the GenerateRequest (prefill or colocated)
    decode: int | None  # disaggregated: the decode node
    fallbacks: tuple[int, ...] = ()  # other decode nodes that could take its hand-off, most free first
    cached: CacheChoice | None = None  # route cache or d2lpm: the entry's score, overlap and page hashes
    credit: dict[tuple[str, str], float] = field(default_factory=dict)  # route d2lpm: credits to write


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def load_key(v: NodeView) -> tuple:
    """The load rule's order, lower first: a prefill node's queued tokens, then running +
    waiting; any other node's free pages, most first."""
    return (v.queued_tokens, v.busy) if v.role == "prefill" else (-v.free_pages,)


def by_load(views: Sequence[NodeView]) -> NodeView | None:
    """The first node of least load_key; None when there are none."""
    return min(views, key=load_key, default=None)


def place(snapshot: Sequence[NodeView], ask: Ask, route: str = "load", d2lpm: D2lpmRouter | None = None) -> Placement:
    """Where `ask` goes among the available nodes of `snapshot` (module docstring). Raises
    RequestFailed: 400 when no available pool could hold it, 503 when no node can take it."""
    need = {"prefill": ask.prompt_tokens, "decode": ask.peak_tokens, "colocated": ask.peak_tokens}
    fits = {role: [v for v in snapshot if v.role == role and v.available
                   and pages_for(need[role], v.page_size) <= v.pages_total] for role in ROLES}
    decode = by_load(fits["decode"])
    if decode is not None and fits["prefill"]:
        entry, cached, credit = _entry(fits["prefill"], ask, route, d2lpm)
        return Placement(entry.index, decode.index, _fallbacks(fits["decode"], decode), cached, credit)
    colocated, cached, credit = _entry(fits["colocated"], ask, route, d2lpm)
    if colocated is not None:
        return Placement(colocated.index, None, (), cached, credit)
    raise _refusal(snapshot, ask, fits, need)


def _fallbacks(fit: list[NodeView], chosen: NodeView) -> tuple[int, ...]:
    others = [v for v in fit if v is not chosen and v.kv_addr]
    return tuple(v.index for v in sorted(others, key=lambda v: -v.free_pages)[:FALLBACKS])


def _entry(views: list[NodeView], ask: Ask, route: str,
           d2lpm: D2lpmRouter | None) -> tuple[NodeView | None, CacheChoice | None, dict]:
    """The prefill or colocated node among `views`, by the route, with its cache score and the
    D²LPM credits the choice writes."""
    if route == "load":
        return by_load(views), None, {}
    cands = [CacheCandidate(v.queued_tokens, (v.busy,) if v.role == "prefill" else (-v.free_pages,),
                            v.hash_page_size, v.prefix_ns, v.prefix_view) for v in views]
    if route == "cache":
        choice = choose_by_cache(cands, ask.prompt_ids)
        return (None, None, {}) if choice is None else (views[choice.index], choice, {})
    scores = score_all(cands, ask.prompt_ids)
    pick = d2lpm.pick(ask.tenant, ask.prompt_tokens, [RouteCandidate(v.node_id, sc.overlap_tokens, load_key(v))
                                                     for v, sc in zip(views, scores)])
    return (None, None, {}) if pick is None else (views[pick.index], scores[pick.index], pick.credit)


def _refusal(snapshot: Sequence[NodeView], ask: Ask, fits: dict, need: dict) -> RequestFailed:
    """Why no node takes `ask`: a 400 when an available pool is too small for it, else a 503."""
    fitting = {v.index for role in ROLES for v in fits[role]}
    too_small = [v for role in ROLES for v in snapshot
                 if v.role == role and v.available and v.index not in fitting]
    if too_small:
        v = max(too_small, key=lambda v: v.pages_total)
        prefill = v.role == "prefill"
        return RequestFailed(400, f"request needs up to {pages_for(need[v.role], v.page_size)} KV pages for "
                                  f"{'its prompt' if prefill else 'prompt + max_tokens'}; the largest {v.role} "
                                  f"node's pool has {v.pages_total}",
                             param="prompt" if prefill else "max_tokens")
    missing = [role for role in ("prefill", "decode") if not fits[role]]
    roles = {v.role for v in snapshot}
    what = "colocated" if "colocated" in roles and not {"prefill", "decode"} <= roles else " or ".join(missing)
    return RequestFailed(503, f"no healthy {what} node available")
