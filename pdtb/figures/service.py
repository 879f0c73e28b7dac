"""Tenant service and fairness figures, computed from token arrival times (pure functions).

Service (VTC's measure): a request earns `w_in` per prompt token when its first token arrives
(the prefill is done) and `w_out` per output token when that token arrives. Demand is what every
sent request would earn if it ran to completion: prompt x w_in + requested output x w_out.

  normalized service  = service received / service demanded, per tenant
  Jain's index        = (sum x)^2 / (n * sum x^2) over the normalized service of all tenants;
                        1.0 whenever every request completes, whatever the order: it only sees
                        requests that failed or were cut short
  fair-share index    = per window (a, b] of `window` seconds: the service the backlogged tenants
                        earned in it, S, is split max-min fairly (water-filling) among them, each
                        capped by what it could have used (the unearned demand of its requests
                        in flight in the window); Jain's index over earned / fair share. 1.0 when
                        every tenant got its fair share of what was served, 0.5 for two tenants
                        when one took the other's share. `share_jain_mean` and `share_jain_min`
                        over the windows with at least two backlogged tenants and S > 0.
                        Demand still open at a window's end counts as unmet in that window,
                        whatever the policy: use windows several times longer than a request's
                        latency (the default 1 s against minnows' 0.1-0.5 s).
  max service gap     = over windows (a, b] of `window` seconds covering [0, duration]:
                        max over windows of (max - min) of the service each backlogged tenant
                        earned in that window, among windows with at least two backlogged tenants.
                        A tenant is backlogged in (a, b] if it has a request with
                        send_time < b and end_time > a (sent but not finished in the window).

A request the server refused as the client's own error (HTTP 4xx other than 408 and 429: a
malformed request, a prompt no pool can hold) is no demand any server could meet: every figure
here leaves it out. A refusal for load (429, 503) or a failure mid-way counts as unmet demand.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from pdtb.figures.records import RequestRecord


@dataclass(frozen=True)
class ServiceWeights:
    """Service charged per token."""

    input: float = 1.0  # per prompt token
    output: float = 2.0  # per output token


def service_events(rec: RequestRecord, w: ServiceWeights) -> list[tuple[float, float]]:
    """(time, service) pairs earned by one request."""
    if rec.first_token_time is None:
        return []
    per = _per_token(rec, w)
    events = [(t, per) for t in rec.token_times]
    prompt = (rec.first_token_time, rec.prompt_tokens * w.input)
    return [prompt] + events


def _per_token(rec: RequestRecord, w: ServiceWeights) -> float:
    """Service of each token counted in the stream. Without token_ids the stream may count fewer
    tokens than the server's usage reports (a held-back chunk's token comes with the next one):
    the reported tokens are spread over them."""
    return w.output * max(rec.output_tokens, len(rec.token_times)) / max(1, len(rec.token_times))


def _curve(events: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Event times (sorted) and the accumulated service just after each."""
    ev = sorted(events)
    return [t for t, _ in ev], list(itertools.accumulate((s for _, s in ev), initial=0.0))[1:]


def _record_curve(rec: RequestRecord, w: ServiceWeights) -> tuple[list[float], list[float]]:
    """`_curve(service_events(rec, w))`, without sorting what came in time order (a client
    appends tokens as they arrive), as `accumulated` reads it."""
    tt = rec.token_times
    if rec.first_token_time is None or (tt and (tt[0] < rec.first_token_time or tt != sorted(tt))):
        return _curve(service_events(rec, w))
    first = (rec.prompt_tokens * w.input,)
    acc = list(itertools.accumulate(itertools.chain(first, itertools.repeat(_per_token(rec, w), len(tt)))))
    return [rec.first_token_time, *tt], acc


def service_curves(records: list[RequestRecord], w: ServiceWeights) -> dict[str, tuple[list[float], list[float]]]:
    """Per tenant: event times (sorted) and the accumulated service just after each."""
    by_tenant: dict[str, list[tuple[float, float]]] = {r.tenant: [] for r in records}
    for r in records:
        by_tenant[r.tenant].extend(service_events(r, w))
    return {tenant: _curve(events) for tenant, events in by_tenant.items()}


def accumulated(curve: tuple[list[float], list[float]], t: float) -> float:
    """Service earned at times <= t."""
    times, acc = curve
    i = bisect.bisect_right(times, t)
    return acc[i - 1] if i else 0.0


def demand(records: list[RequestRecord], w: ServiceWeights) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in records:
        out[r.tenant] = out.get(r.tenant, 0.0) + r.prompt_tokens * w.input + r.requested_output_tokens * w.output
    return out


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index; None without values or when all are zero."""
    sq = sum(v * v for v in values)
    if not values or sq == 0:
        return None
    return sum(values) ** 2 / (len(values) * sq)


def _in_flight(r: RequestRecord, a: float, b: float) -> bool:
    """Sent but not finished somewhere in the window (a, b]."""
    return r.send_time < b and (math.inf if r.end_time is None else r.end_time) > a


def _windows(records: list[RequestRecord], window: float, duration: float) -> list[list[RequestRecord]]:
    """Per window k, (a, b] = (k * window, min((k + 1) * window, duration)]: the records in
    flight in it (`_in_flight`), in `records` order. Each record is placed in the windows it
    spans (found by division, then checked with `_in_flight` itself) instead of testing every
    record against every window: an hour of a trace is 3,600 windows of 20,000 requests."""
    n = math.ceil(duration / window)
    out: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in records:
        first = max(0, math.floor(r.send_time / window) - 1)
        last = n - 1 if r.end_time is None else min(n - 1, math.ceil(r.end_time / window) + 1)
        for k in range(first, last + 1):
            if _in_flight(r, k * window, min((k + 1) * window, duration)):
                out[k].append(r)
    return out


def max_service_gap(records: list[RequestRecord], w: ServiceWeights, window: float,
                    duration: float, curves: dict | None = None) -> float | None:
    """The largest per-window service gap between backlogged tenants; None if no window had two.
    `curves`: `service_curves(records, w)` when the caller has them already."""
    if window <= 0 or duration <= 0:
        return None
    curves = curves if curves is not None else service_curves(records, w)
    best = None
    for k, live in enumerate(_windows(records, window, duration)):
        a, b = k * window, min((k + 1) * window, duration)
        tenants = {r.tenant for r in live}
        if len(tenants) < 2:
            continue
        earned = [accumulated(curves[t], b) - accumulated(curves[t], a) for t in tenants]
        gap = max(earned) - min(earned)
        best = gap if best is None else max(best, gap)
    return best


def water_fill(total: float, caps: list[float]) -> list[float]:
    """Max-min fair split of `total` among claimants capped at `caps` (sum <= total if all fit)."""
    out, left, n = [0.0] * len(caps), total, len(caps)
    for i in sorted(range(len(caps)), key=lambda i: caps[i]):
        out[i] = min(caps[i], left / n)
        left -= out[i]
        n -= 1
    return out


def fair_share_jain(records: list[RequestRecord], w: ServiceWeights, window: float,
                    duration: float) -> tuple[float | None, float | None]:
    """(mean, min) over windows of Jain's index of earned / fair share (see the module doc)."""
    if window <= 0 or duration <= 0:
        return None, None
    curves = {id(r): _record_curve(r, w) for r in records}
    indices = []
    for k, live in enumerate(_windows(records, window, duration)):
        a, b = k * window, min((k + 1) * window, duration)
        earned: dict[str, float] = {}
        cap: dict[str, float] = {}
        for r in live:
            curve = curves[id(r)]
            before = accumulated(curve, a)
            demand = r.prompt_tokens * w.input + max(r.requested_output_tokens, r.output_tokens) * w.output
            earned[r.tenant] = earned.get(r.tenant, 0.0) + accumulated(curve, b) - before
            cap[r.tenant] = cap.get(r.tenant, 0.0) + max(0.0, demand - before)
        tenants = [t for t in cap if cap[t] > 0]
        total = sum(earned[t] for t in tenants)
        if len(tenants) < 2 or total <= 0:
            continue
        share = water_fill(total, [cap[t] for t in tenants])
        indices.append(jain_index([earned[t] / s if s > 0 else 1.0 for t, s in zip(tenants, share)]))
    indices = [x for x in indices if x is not None]
    return (sum(indices) / len(indices), min(indices)) if indices else (None, None)


def refused_as_invalid(r: RequestRecord) -> bool:
    """The server refused `r` as the client's error (HTTP 4xx, not 408 or 429)."""
    code = r.error[5:8] if r.error and r.error.startswith("HTTP 4") else ""
    return code.isdigit() and code not in ("408", "429")


def fairness(records: list[RequestRecord], w: ServiceWeights, window: float, duration: float) -> dict:
    """The results file's `summary.fairness` object (requests refused as invalid left out)."""
    records = [r for r in records if not refused_as_invalid(r)]
    curves = service_curves(records, w)
    service = {t: (c[1][-1] if c[1] else 0.0) for t, c in curves.items()}
    wanted = demand(records, w)
    normalized = {t: (service[t] / wanted[t] if wanted[t] else None) for t in service}
    return {"service": service, "demand": wanted, "normalized_service": normalized,
            "jain_index": jain_index([v for v in normalized.values() if v is not None]),
            "max_service_gap": max_service_gap(records, w, window, duration, curves),
            **dict(zip(("share_jain_mean", "share_jain_min"), fair_share_jain(records, w, window, duration))),
            "weights": {"input": w.input, "output": w.output}, "window_s": window}
