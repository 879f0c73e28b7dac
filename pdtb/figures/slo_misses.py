"""The nodes' SLO attribution, as the client reports it (pure functions over RequestRecords).

A finished request's last chunk carries the node's `pdtb_timing` (fairness/attribution.py):
`slo.components`, the seconds its TTFT spent in dispatch, queue, prefill, and recompute or
parked before the first token, and its decode phase in transfer, held at prefill, parked in host, recompute,
turn wait and decode compute; with SLO targets set on the nodes (per priority class),
`slo.missed` (which SLOs it missed) and `slo.cause` (the component blamed for the miss).
Per group of ok requests:

  requests  ok requests that carried an attribution
  missed    {"ttft": n, "tpot": n}: requests that missed each of the nodes' SLOs
  causes    {component: n}: requests whose miss was blamed on it, most frequent first
  mean_ms   {component: ms}: its mean over those requests (where the time went, miss or not)

The timing is the server's word, read as untrusted input: a malformed one is skipped.
"""
from __future__ import annotations

from collections import Counter

from pdtb.figures.records import OK, RequestRecord

TTFT_PARTS = ("dispatch", "queue", "prefill", "recompute_before_first_token", "parked_before_first_token")
TPOT_PARTS = ("transfer", "held_at_prefill", "parked_in_host", "recompute", "turn_wait", "migration", "decode_compute")


def _slo_of(r: RequestRecord) -> dict | None:
    """The request's `pdtb_timing.slo` if it is well formed, else None."""
    slo = r.server_timing.get("slo") if isinstance(r.server_timing, dict) else None
    if not isinstance(slo, dict) or not isinstance(slo.get("components"), dict):
        return None
    return slo


def group_attribution(records: list[RequestRecord]) -> dict:
    """ATTRIBUTION of a group of requests (see the module doc)."""
    slos = [s for r in records if r.status == OK and (s := _slo_of(r)) is not None]
    missed, causes, sums = Counter(), Counter(), Counter()
    for s in slos:
        missed.update(k for k in (s.get("missed") or []) if isinstance(k, str))
        if isinstance(s.get("cause"), str):
            causes[s["cause"]] += 1
        for k, v in s["components"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[k] += v
    n = len(slos)
    return {"requests": n, "missed": dict(missed), "causes": dict(causes.most_common()),
            "mean_ms": {k: 1000.0 * v / n for k, v in sums.items()} if n else {}}


def attribution(records: list[RequestRecord]) -> dict:
    """The results file's `summary.slo_attribution`: overall, per tenant, per class."""
    def by(key) -> dict:
        groups: dict[str, list[RequestRecord]] = {}
        for r in records:
            groups.setdefault(key(r), []).append(r)
        return {k: group_attribution(v) for k, v in sorted(groups.items())}

    return {"overall": group_attribution(records), "per_tenant": by(lambda r: r.tenant),
            "per_class": by(lambda r: r.klass)}


def format_lines(attr: dict, top: int = 4) -> list[str]:
    """One line per class: misses, causes, and the `top` largest mean components (ms)."""
    out = []
    for name, g in (attr.get("per_class") or {}).items():
        if not g["requests"]:
            continue
        missed = ", ".join(f"{k} {v}" for k, v in sorted(g["missed"].items())) or "none"
        causes = ", ".join(f"{k} {v}" for k, v in g["causes"].items()) or "-"
        parts = sorted(g["mean_ms"].items(), key=lambda kv: -kv[1])[:top]
        means = ", ".join(f"{k} {v:.1f}" for k, v in parts)
        out.append(f"  class {name}: {g['requests']} attributed, missed {missed}; causes {causes}; "
                   f"mean ms {means}")
    return out
