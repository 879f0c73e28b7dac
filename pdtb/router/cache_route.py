"""Cache-aware routing (`--route cache`): send a request where its prompt's leading pages are cached.

Each node reports the page hashes it holds (NodeStats.prefix_summary, pdtb/engine/prefix_hash.py);
the router keeps a PrefixView per node and scores the candidates of one decision:

    cost(node) = queued_tokens(node) + PREFILL_WEIGHT * (prompt_tokens - overlap_pages(node) * node.page_size)
                 └ prefill work it waits behind ┘              └ prefill work it does itself ┘

queued_tokens(node) is its last report plus the prompt tokens sent to it since (as --route load
counts them). A token computed anew weighs PREFILL_WEIGHT times a token waited behind: the wait
is for work the cluster does anyway, the recompute is capacity taken from everyone (with equal
weights, a burst of one prefix spread over every node, each recomputing it, because waiting
behind the first request cost as much as recomputing its prefix). Lowest cost wins; equal costs fall to the load policy's own order (`tie`). `overlap_pages` counts
the request's leading full pages found in the node's view; a node with no prefix cache (prefix_ns
"") has overlap 0, so among such nodes this is the load choice by queued tokens.

A view is a guess: the summary is bounded and a few hundred ms old. A wrong guess costs prefill,
never correctness (the node looks the pages up itself).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Container, Sequence

from pdtb.engine.prefix_hash import page_hashes

ROUTES = ("load", "cache", "d2lpm")  # d2lpm: pdtb/router/fair_route.py
PREFILL_WEIGHT = 2  # Dynamo's KV router weighs prefill blocks against active blocks the same way
VIEW_MAX_HASHES = 1 << 16  # per node: summary plus recent inserts (8 bytes of hash, ~100 B of set entry each)
INSERT_KEEP_S = 1.0  # an optimistic insert outlives the summaries sent within this long after it


@dataclass
class PrefixView:
    """The router's guess of the page hashes one node holds: its latest summary, plus the pages
    of requests sent there recently (which its summary may not show yet)."""

    summary: frozenset = frozenset()  # page hashes of the latest NodeStats.prefix_summary
    recent: OrderedDict = field(default_factory=OrderedDict)  # hash -> monotonic time inserted, oldest first
    max_hashes: int = VIEW_MAX_HASHES

    def update(self, summary, now: float, keep_s: float = INSERT_KEEP_S) -> None:
        """A new summary replaces the old one (it is authoritative); inserts of the last `keep_s`
        seconds stay (the summary may have been sent before their requests arrived). Entries that
        are not integers are ignored."""
        ok = isinstance(summary, (list, tuple))
        hashes = [h for h in summary[:self.max_hashes] if type(h) is int] if ok else []
        self.summary = frozenset(hashes)
        while self.recent and next(iter(self.recent.values())) < now - keep_s:
            self.recent.popitem(last=False)

    def insert(self, hashes: Sequence[int], now: float) -> None:
        """The pages of a request just sent to the node: it will hold them once it has prefilled."""
        for h in hashes:
            self.recent.pop(h, None)
            self.recent[h] = now
        while len(self.recent) > self.max_hashes:
            self.recent.popitem(last=False)

    def __contains__(self, h: int) -> bool:
        return h in self.summary or h in self.recent

    def __len__(self) -> int:
        return len(self.summary) + len(self.recent)


@dataclass(frozen=True)
class CacheCandidate:
    """One node as cache-aware scoring sees it."""

    queued_tokens: int  # prompt tokens waiting at the node (its last report)
    tie: tuple  # the load policy's order among equal costs, lower first
    page_size: int  # tokens per page of its hashes (0: unknown, no overlap)
    prefix_ns: str  # namespace of its hashes ("": no prefix cache, no overlap)
    view: Container[int]  # page hashes the router believes it holds


@dataclass(frozen=True)
class CacheChoice:
    """The outcome of one cache-aware decision."""

    index: int  # position of the chosen candidate
    overlap_pages: int  # leading pages of the prompt in its view
    overlap_tokens: int  # overlap_pages * its page size
    cost: int  # tokens of prefill work: queued at the node plus not cached
    hashes: list[int]  # the prompt's full-page hashes for its page size and namespace ([] with no cache)


def overlap_pages(hashes: Sequence[int], view: Container[int]) -> int:
    """Leading hashes of `hashes` found in `view` (a chain: the first miss ends the prefix)."""
    n = 0
    for h in hashes:
        if h not in view:
            break
        n += 1
    return n


def score_all(candidates: Sequence[CacheCandidate], prompt_ids: Sequence[int]) -> list[CacheChoice]:
    """Every candidate's score (module docstring), in the candidates' order."""
    by_key: dict[tuple[int, str], list[int]] = {}  # nodes of one cluster share page size and namespace
    out = []
    for i, c in enumerate(candidates):
        hashes = []
        if c.prefix_ns and c.page_size > 0:
            key = (c.page_size, c.prefix_ns)
            if key not in by_key:
                by_key[key] = page_hashes(list(prompt_ids), c.page_size, c.prefix_ns)
            hashes = by_key[key]
        pages = overlap_pages(hashes, c.view) if hashes else 0
        cost = c.queued_tokens + PREFILL_WEIGHT * max(0, len(prompt_ids) - pages * c.page_size)
        out.append(CacheChoice(i, pages, pages * c.page_size, cost, hashes))
    return out


def choose_by_cache(candidates: Sequence[CacheCandidate], prompt_ids: Sequence[int]) -> CacheChoice | None:
    """The candidate with the lowest cost (module docstring); None when there are none."""
    scores = score_all(candidates, prompt_ids)
    return min(scores, key=lambda sc: (sc.cost, candidates[sc.index].tie, sc.index), default=None)
