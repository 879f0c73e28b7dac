"""Tenant service and fairness figures, computed from token arrival times (pure functions).

Service (VTC's measure): a request earns `w_in` per prompt token when its first token arrives
(the prefill is done) and `w_out` per output token when that token arrives. Demand is what every
sent request would earn if it ran to completion: prompt x w_in + requested output x w_out.

  normalized service  = service received / service demanded, per tenant
  Jain's index        = (sum x)^2 / (n * sum x^2) over the normalized service of all tenants
  max service gap     = over windows (a, b] of `window` seconds covering [0, duration]:
                        max over windows of (max - min) of the service each backlogged tenant
                        earned in that window, among windows with at least two backlogged tenants.
                        A tenant is backlogged in (a, b] if it has a request with
                        send_time < b and end_time > a (sent but not finished in the window).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from bench_client.records import RequestRecord


@dataclass(frozen=True)
class ServiceWeights:
    """Service charged per token."""

    input: float = 1.0  # per prompt token
    output: float = 2.0  # per output token


def service_events(rec: RequestRecord, w: ServiceWeights) -> list[tuple[float, float]]:
    """(time, service) pairs earned by one request."""
    if rec.first_token_time is None:
        return []
    # without token_ids the stream may count fewer tokens than the server's usage reports (a
    # held-back chunk's token comes with the next one): spread the reported tokens over them
    per = w.output * max(rec.output_tokens, len(rec.token_times)) / max(1, len(rec.token_times))
    events = [(t, per) for t in rec.token_times]
    prompt = (rec.first_token_time, rec.prompt_tokens * w.input)
    return [prompt] + events


def service_curves(records: list[RequestRecord], w: ServiceWeights) -> dict[str, tuple[list[float], list[float]]]:
    """Per tenant: event times (sorted) and the accumulated service just after each."""
    by_tenant: dict[str, list[tuple[float, float]]] = {r.tenant: [] for r in records}
    for r in records:
        by_tenant[r.tenant].extend(service_events(r, w))
    out = {}
    for tenant, events in by_tenant.items():
        events.sort()
        times, acc, total = [], [], 0.0
        for t, s in events:
            total += s
            times.append(t)
            acc.append(total)
        out[tenant] = (times, acc)
    return out


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


def _backlogged(records: list[RequestRecord], a: float, b: float) -> set[str]:
    return {r.tenant for r in records
            if r.send_time < b and (math.inf if r.end_time is None else r.end_time) > a}


def max_service_gap(records: list[RequestRecord], w: ServiceWeights, window: float,
                    duration: float) -> float | None:
    """The largest per-window service gap between backlogged tenants; None if no window had two."""
    if window <= 0 or duration <= 0:
        return None
    curves = service_curves(records, w)
    best = None
    for k in range(math.ceil(duration / window)):
        a, b = k * window, min((k + 1) * window, duration)
        tenants = _backlogged(records, a, b)
        if len(tenants) < 2:
            continue
        earned = [accumulated(curves[t], b) - accumulated(curves[t], a) for t in tenants]
        gap = max(earned) - min(earned)
        best = gap if best is None else max(best, gap)
    return best


def fairness(records: list[RequestRecord], w: ServiceWeights, window: float, duration: float) -> dict:
    """The results file's `summary.fairness` object."""
    curves = service_curves(records, w)
    service = {t: (c[1][-1] if c[1] else 0.0) for t, c in curves.items()}
    wanted = demand(records, w)
    normalized = {t: (service[t] / wanted[t] if wanted[t] else None) for t in service}
    return {"service": service, "demand": wanted, "normalized_service": normalized,
            "jain_index": jain_index([v for v in normalized.values() if v is not None]),
            "max_service_gap": max_service_gap(records, w, window, duration),
            "weights": {"input": w.input, "output": w.output}, "window_s": window}
