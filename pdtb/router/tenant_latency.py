"""Each tenant's TTFT and ITL at the router: Prometheus histograms by tenant, and a recent window per tenant
(`GET /cluster/latency`).

A request holds its tenant's `TenantSeries` from submit to its end, so a token costs no label
look-up. The window keeps a tenant's latest WINDOW samples of each kind, and `summary` reports
those of the last HORIZON_S seconds: what `pdtb top` shows as the minnows' and whales' latency
now, not since start-up. ITL counts as the router's histogram does: a batch of k tokens `gap`
seconds after the previous one is k samples of gap/k.

Tenant names come from clients (the OpenAI `user`): the first MAX_TENANTS names seen get series
of their own, later ones count under OTHER, so /metrics and the window stay bounded."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat

MAX_TENANTS = 64  # tenant names with series of their own; the rest count under OTHER
OTHER = "_other"
WINDOW = 512  # latest samples kept per tenant and kind
HORIZON_S = 60.0  # samples older than this are left out of the summary


@dataclass(eq=False)
class TenantSeries:
    """One tenant's histogram children and recent samples, (monotonic time, seconds) each."""

    ttft_hist: object  # prometheus Histogram child
    itl_hist: object
    ttft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    itl: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def first_token(self, seconds: float, now: float) -> None:
        self.ttft_hist.observe(seconds)
        self.ttft.append((now, seconds))

    def tokens(self, num_tokens: int, gap: float, now: float) -> None:
        """`num_tokens` arrived `gap` seconds after the request's previous batch."""
        per = gap / num_tokens
        for _ in range(num_tokens):
            self.itl_hist.observe(per)
        self.itl.extend(repeat((now, per), min(num_tokens, WINDOW)))


class TenantLatency:
    """The series of every tenant seen, bounded as the module doc says."""

    def __init__(self, ttft_hist, itl_hist) -> None:
        self._ttft_hist, self._itl_hist = ttft_hist, itl_hist  # histograms with one label, `tenant`
        self._by: dict[str, TenantSeries] = {}

    def of(self, tenant: str) -> TenantSeries:
        """The series `tenant`'s samples go to (OTHER's once MAX_TENANTS names have series)."""
        s = self._by.get(tenant)
        if s is None:
            name = tenant if len(self._by) < MAX_TENANTS else OTHER
            s = self._by.get(name) or TenantSeries(self._ttft_hist.labels(tenant=name),
                                                   self._itl_hist.labels(tenant=name))
            self._by[name] = s
        return s

    def summary(self, now: float) -> dict:
        """{tenant: {"ttft": figures, "itl": figures}} over the last HORIZON_S seconds (`figures`),
        tenants with no recent sample left out."""
        out = {}
        for name, s in sorted(self._by.items()):
            ttft, itl = figures(s.ttft, now - HORIZON_S), figures(s.itl, now - HORIZON_S)
            if ttft["n"] or itl["n"]:
                out[name] = {"ttft": ttft, "itl": itl}
        return out


def figures(samples, since: float) -> dict:
    """n, mean, p50, p90 and p99 (nearest rank) of the samples stamped at `since` or later; None
    for each figure of an empty window."""
    xs = sorted(v for t, v in samples if t >= since)
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}

    def rank(q: float) -> float:
        return xs[max(0, math.ceil(len(xs) * q) - 1)]

    return {"n": len(xs), "mean": round(sum(xs) / len(xs), 6), "p50": round(rank(0.5), 6),
            "p90": round(rank(0.9), 6), "p99": round(rank(0.99), 6)}
