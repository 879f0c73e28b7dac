"""Summary figures of a run (pure functions over `RequestRecord`s).

Per request (status "ok" only; failed requests count in `count` and `failed`, nothing else):
  TTFT  = first_token_time - send_time
  ITL   = every gap between consecutive streamed tokens; n tokens arriving together share the
          gap before them (n gaps of gap / n, SGLang's convention; see itls_s). With
          --no-token-ids tokens are counted by chunk: a chunk whose text the router held back
          (a partial character) arrives with the next, so ITL is then per chunk, not per token
  TPOT  = (E2E - TTFT) / (output tokens - 1), only with at least 2 output tokens
  E2E   = end_time - send_time
Each is reported in ms as PCT = {mean, p50, p90, p95, p99, max}, percentiles linearly
interpolated as numpy's default; every field is None when there is no sample.
duration = first send ... last completion (the earliest send_time to the latest end_time; a
workload whose first request is due at 2 s does not count those 2 s). The fairness windows
still run over the client's clock from its start (`run_s`, RunResult.duration).
output_tok_s = output tokens of ok requests / duration; total_tok_s = prompt + output tokens of
ok requests / duration; request_rps = ok requests / duration; goodput_rps = ok requests meeting
every given SLO / duration (no SLOs: every ok request; a 1-token request has no TPOT and meets a
TPOT SLO; a request with no TTFT or E2E meets none); slo_attainment = requests meeting every SLO / all requests (None without SLOs).
"""
from __future__ import annotations

import math

from pdtb.figures.slo_misses import attribution
from pdtb.figures.records import OK, RequestRecord
from pdtb.figures.service import ServiceWeights, fairness

PCT_KEYS = ("mean", "p50", "p90", "p95", "p99", "max")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, linear interpolation (numpy 'linear')."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def pct(values: list[float]) -> dict:
    """PCT of the values (already in the unit wanted)."""
    if not values:
        return dict.fromkeys(PCT_KEYS)
    s = sorted(values)
    return {"mean": sum(s) / len(s), "p50": percentile(s, 50), "p90": percentile(s, 90),
            "p95": percentile(s, 95), "p99": percentile(s, 99), "max": s[-1]}


def ttft_s(r: RequestRecord) -> float | None:
    return None if r.first_token_time is None else r.first_token_time - r.send_time


def e2e_s(r: RequestRecord) -> float | None:
    return None if r.end_time is None else r.end_time - r.send_time


def tpot_s(r: RequestRecord) -> float | None:
    ttft, e2e = ttft_s(r), e2e_s(r)
    if ttft is None or e2e is None or r.output_tokens < 2:
        return None
    return (e2e - ttft) / (r.output_tokens - 1)


def itls_s(r: RequestRecord) -> list[float]:
    """Inter-token gaps. Tokens that arrive together (one chunk of several tokens, or chunks
    read off the socket at once) share the gap before them evenly, as SGLang's client does: n
    tokens arriving t after the previous arrival give n gaps of t / n, so the gaps still sum to
    the time between the first and the last token (vLLM's client records one gap per chunk
    instead). Tokens that came with the first one add no gap."""
    t = r.token_times
    gaps = [b - a for a, b in zip(t, t[1:])]
    if 0.0 not in gaps:  # every token arrived on its own (the common case): one gap each
        return gaps
    out: list[float] = []
    i, n = 1, len(t)
    while i < n and t[i] == t[0]:
        i += 1
    while i < n:
        j = i
        while j < n and t[j] == t[i]:
            j += 1
        out.extend([(t[i] - t[i - 1]) / (j - i)] * (j - i))
        i = j
    return out


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """An ok request within every SLO (ms). Only TPOT may be undefined (one output token) and
    pass; a missing TTFT or E2E (a record with no token) fails its SLO."""
    got = {"ttft_ms": ttft_s(r), "tpot_ms": tpot_s(r), "e2e_ms": e2e_s(r)}
    return r.status == OK and all((k == "tpot_ms" if got[k] is None else got[k] * 1000 <= limit)
                                  for k, limit in slos.items())


def span_s(records: list[RequestRecord]) -> float | None:
    """First send to last completion, over every request (None without a completed one)."""
    ends = [r.end_time for r in records if r.end_time is not None]
    return max(ends) - min(r.send_time for r in records) if ends else None


def stats(records: list[RequestRecord], duration: float, slos: dict[str, float]) -> dict:
    """STATS of a group of requests."""
    ok = [r for r in records if r.status == OK]

    def ms(f):
        return [v * 1000 for v in map(f, ok) if v is not None]

    rate = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    good = sum(meets_slos(r, slos) for r in ok)
    return {"count": len(records), "failed": len(records) - len(ok),
            "ttft_ms": pct(ms(ttft_s)), "itl_ms": pct([g * 1000 for r in ok for g in itls_s(r)]),
            "tpot_ms": pct(ms(tpot_s)), "e2e_ms": pct(ms(e2e_s)),
            "output_tok_s": rate(sum(r.output_tokens for r in ok)),
            "total_tok_s": rate(sum(r.prompt_tokens + r.output_tokens for r in ok)),
            "request_rps": rate(len(ok)),
            "goodput_rps": rate(good),
            # the share of all requests (failed ones included) that finished within every SLO
            "slo_attainment": good / len(records) if slos and records else None}


def grouped(records: list[RequestRecord], key) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    return dict(sorted(out.items()))


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None,
              service_weights: ServiceWeights | None = None, window: float = 1.0) -> dict:
    """The results file's `summary`: overall, per tenant, per class, fairness, the nodes' SLO
    attribution. `duration`: the run's clock from the client's start to its end."""
    slos = dict(slos or {})
    bad = set(slos) - set(SLO_KEYS)
    if bad:
        raise ValueError(f"unknown SLO {sorted(bad)} (want {', '.join(SLO_KEYS)})")
    w = service_weights or ServiceWeights()
    span = span_s(records)
    span = duration if span is None else span  # the rates' denominator (see the module doc)
    overall = stats(records, span, slos)

    def of(group: list[RequestRecord]) -> dict:  # a group of every request is the overall figure
        return dict(overall) if len(group) == len(records) else stats(group, span, slos)

    return {"overall": overall,
            "per_tenant": {k: of(v) for k, v in grouped(records, lambda r: r.tenant).items()},
            "per_class": {k: of(v) for k, v in grouped(records, lambda r: r.klass).items()},
            "fairness": fairness(records, w, window, duration),
            "slo_attribution": attribution(records),
            "duration_s": span, "run_s": duration, "slos": slos}
