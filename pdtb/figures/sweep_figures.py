"""The figures of a load sweep (pure functions over `RequestRecord`s; `pdtb bench sweep` runs it).

A level is one offered load held for a warm-up and then a measured span. Its figures count the
requests *scheduled* inside the span [a, b) (a closed loop: sent inside it), whatever the time
they end; warm-up requests load the server but are not counted.

Per group (overall, per class, per tenant) of measured requests:
  attainment_ttft  share of the group's requests that finished ok with TTFT <= their class's target
  attainment_tpot  ... with TPOT <= target (a one-token request has no TPOT and meets it)
  attainment       ... meeting every target its class has (no target at all: finished ok)
                   A failed request misses all three. A request cut off at the level's end
                   (still running when the drain timeout ended) counts only where it was on
                   track when cut: TTFT (or, with no token yet, its wait) within target, its
                   time per token so far, the wait for its next token included ((cut - first
                   token) / tokens received), within the TPOT target, and its age within the
                   E2E target. So a long request that could not end in the drain but was
                   meeting its targets is not a miss, and one that had already missed is.
  goodput_rps      requests meeting every target / span length (b - a)
  offered_rps      requests / span length
  output_tok_s     output tokens received (ok requests, and what a cut-off or failed one had
                   streamed) / (the last measured end - a): what the server delivered; at
                   saturation the backlog stretches the denominator, so this is its capacity,
                   not the offered load. total_tok_s adds the prompt tokens of every request
                   that got a token (its prompt was processed).
  ttft/itl/tpot/e2e_ms  {p50, p99} over ok requests

Derived over the levels (`derive`), for attainment target T (0.9: DistServe's 90%):
  max_goodput_rps              the highest overall goodput of a level whose overall attainment >= T
  max_goodput_every_class_rps  ... of a level where every class's attainment >= T
  per_class[c].max_goodput_rps the highest class-c goodput of a level where class c attains T
  knee_rps                     the offered rate of the highest-load level that attains T (every
                               class, or overall with knee_on="overall") below the lowest-load
                               level that does not; knee_bracket_rps is [that, the failing one's]
  saturation_tok_s             the highest output_tok_s of any level (saturation_total_tok_s: total)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdtb.figures.records import CUT_OFF, OK, RequestRecord
from pdtb.figures.summary import SLO_KEYS, e2e_s, grouped, itls_s, pct, tpot_s, ttft_s
from pdtb.figures.service import ServiceWeights, fairness


@dataclass(frozen=True)
class SloTable:
    """SLO targets in ms: `default` for every class, `per_class` overriding key by key."""

    default: dict = field(default_factory=dict)
    per_class: dict = field(default_factory=dict)  # class -> {key: ms}

    def of(self, klass: str) -> dict:
        return {**self.default, **self.per_class.get(klass, {})}

    def to_json(self) -> dict:
        return {"default": dict(self.default), "per_class": {k: dict(v) for k, v in self.per_class.items()}}

    @classmethod
    def parse(cls, items: list[str]) -> "SloTable":
        """From `KEY=MS` (every class) and `CLASS:KEY=MS` items."""
        default: dict = {}
        per_class: dict = {}
        for item in items:
            head, sep, value = item.partition("=")
            klass, colon, key = head.rpartition(":")
            if not sep or key not in SLO_KEYS or (colon and not klass):
                raise ValueError(f"--slo {item!r}: want KEY=MS or CLASS:KEY=MS with KEY in {', '.join(SLO_KEYS)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--slo {item!r}: {value!r} is not a number of ms") from None
            if not 0 < ms < float("inf"):
                raise ValueError(f"--slo {item!r}: the target must be a positive number of ms")
            (per_class.setdefault(klass, {}) if colon else default)[key] = ms
        return cls(default, per_class)


def _ok_within(r: RequestRecord, key: str, limit_ms: float | None) -> bool:
    if r.status != OK:
        return False
    if limit_ms is None:
        return True
    got = {"ttft_ms": ttft_s, "tpot_ms": tpot_s, "e2e_ms": e2e_s}[key](r)
    if got is None:
        return key == "tpot_ms"  # only TPOT may be undefined (one output token) and pass
    return got * 1000 <= limit_ms


def _on_track(r: RequestRecord, key: str, limit_ms: float | None) -> bool:
    """A cut-off request within `key`'s target so far (see the module doc)."""
    if limit_ms is None:
        return True
    cut = r.end_time
    if key == "ttft_ms":
        return ((r.first_token_time if r.first_token_time is not None else cut) - r.send_time) * 1000 <= limit_ms
    if key == "tpot_ms":
        if r.first_token_time is None:
            return True  # no token yet: its TTFT decides
        return (cut - r.first_token_time) / max(1, len(r.token_times)) * 1000 <= limit_ms
    return (cut - r.send_time) * 1000 <= limit_ms


def meets(r: RequestRecord, slos: SloTable, key: str | None = None) -> bool:
    """`r` finished ok within its class's target for `key` (None: every target it has), or
    was on track when cut off at the level's end."""
    targets = slos.of(r.klass)
    if r.error == CUT_OFF and r.end_time is not None:
        keys = [key] if key else list(targets)
        return bool(keys) and all(_on_track(r, k, targets.get(k)) for k in keys)
    keys = [key] if key else list(targets) or ["ttft_ms"]
    return all(_ok_within(r, k, targets.get(k)) for k in keys)


def _received(r: RequestRecord) -> int:
    """Output tokens the server delivered to `r` (the server's count where it finished ok)."""
    return r.output_tokens if r.status == OK else len(r.token_times)


def _p(values: list[float]) -> dict:
    """{p50, p99} of the values (None without a sample)."""
    whole = pct(values)
    return {"p50": whole["p50"], "p99": whole["p99"]}


def group_figures(records: list[RequestRecord], a: float, b: float, slos: SloTable) -> dict:
    """The figures of one group of measured requests (see the module doc)."""
    n, span = len(records), b - a
    ok = [r for r in records if r.status == OK]
    ends = [r.end_time for r in records if r.end_time is not None]
    served = max(span, max(ends) - a) if ends else span

    def share(pred) -> float | None:
        return sum(map(pred, records)) / n if n else None

    good = sum(meets(r, slos) for r in records)

    def ms(f):
        return [v * 1000 for v in map(f, ok) if v is not None]

    return {"count": n, "failed": n - len(ok), "cut_off": sum(1 for r in records if r.error == CUT_OFF),
            "offered_rps": n / span,
            "attainment_ttft": share(lambda r: meets(r, slos, "ttft_ms")) if any("ttft_ms" in slos.of(r.klass) for r in records) else None,
            "attainment_tpot": share(lambda r: meets(r, slos, "tpot_ms")) if any("tpot_ms" in slos.of(r.klass) for r in records) else None,
            "attainment": good / n if n else None,
            "goodput_rps": good / span,
            "output_tok_s": sum(_received(r) for r in records) / served,
            "total_tok_s": sum(_received(r) + (r.prompt_tokens if _received(r) else 0) for r in records) / served,
            "ttft_ms": _p(ms(ttft_s)), "tpot_ms": _p(ms(tpot_s)), "e2e_ms": _p(ms(e2e_s)),
            "itl_ms": _p([g * 1000 for r in ok for g in itls_s(r)])}


def kv_pages(samples: list[dict], a: float, b: float) -> dict[str, dict]:
    """Per tenant: mean and max KV pages held (summed over nodes) over /cluster samples in [a, b]."""
    inside = [s for s in samples if a <= s["t"] <= b]
    tenants = sorted({t for s in inside for n in s["nodes"] for t in n.get("tenant_pages", {})})
    out = {}
    for t in tenants:
        held = [sum(n.get("tenant_pages", {}).get(t, 0) for n in s["nodes"]) for s in inside]
        out[t] = {"mean": sum(held) / len(held), "max": max(held)}
    return out


def level_figures(records: list[RequestRecord], a: float, b: float, slos: SloTable,
                  samples: list[dict] | None = None, weights: ServiceWeights | None = None,
                  window: float = 1.0) -> dict:
    """One level's figures: overall, per class, per tenant, fairness, KV pages per tenant."""
    measured = [r for r in records if a <= r.scheduled_time < b]
    ends = [r.end_time for r in measured if r.end_time is not None]
    w = weights or ServiceWeights()
    fair = fairness(measured, w, window, max(ends) if ends else b)
    return {"window_s": [a, b],
            "overall": group_figures(measured, a, b, slos),
            "per_class": {k: group_figures(v, a, b, slos) for k, v in grouped(measured, lambda r: r.klass).items()},
            "per_tenant": {k: group_figures(v, a, b, slos) for k, v in grouped(measured, lambda r: r.tenant).items()},
            "fairness": {"share_jain_mean": fair["share_jain_mean"], "share_jain_min": fair["share_jain_min"],
                         "jain_index": fair["jain_index"]},
            "kv_pages": kv_pages(samples or [], a, b)}


def passes(level: dict, target: float, scope: str = "every-class") -> bool:
    """The level attains `target`: overall, every class ("every-class"), or one class by name."""
    if scope == "overall":
        groups = [level["overall"]]
    elif scope == "every-class":
        groups = list(level["per_class"].values()) or [level["overall"]]
    else:
        groups = [level["per_class"].get(scope) or {"attainment": None}]
    return all(g["attainment"] is not None and g["attainment"] >= target for g in groups)


def knee(levels: list[dict], target: float, scope: str = "every-class") -> tuple[dict | None, dict | None]:
    """(the highest-load level that attains the target below the lowest-load level that does
    not, that failing level); either may be None."""
    order = sorted(levels, key=lambda lv: lv["load"])
    fail = next((lv for lv in order if not passes(lv, target, scope)), None)
    below = [lv for lv in order if passes(lv, target, scope) and (fail is None or lv["load"] < fail["load"])]
    return (below[-1] if below else None), fail


def derive(levels: list[dict], target: float = 0.9, knee_on: str = "every-class") -> dict:
    """The `derived` object of a sweep (see the module doc)."""
    def best(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    classes = sorted({c for lv in levels for c in lv["per_class"]})
    ok, bad = knee(levels, target, knee_on)
    return {
        "target": target, "knee_on": knee_on,
        "max_goodput_rps": best([lv["overall"]["goodput_rps"] for lv in levels if passes(lv, target, "overall")]) or 0.0,
        "max_goodput_every_class_rps": best([lv["overall"]["goodput_rps"] for lv in levels
                                             if passes(lv, target, "every-class")]) or 0.0,
        "per_class": {c: {"max_goodput_rps": best([lv["per_class"][c]["goodput_rps"] for lv in levels
                                                   if c in lv["per_class"] and passes(lv, target, c)]) or 0.0}
                      for c in classes},
        "knee_rps": ok["overall"]["offered_rps"] if ok else None,
        "knee_load": ok["load"] if ok else None,
        "knee_bracket_rps": [ok["overall"]["offered_rps"] if ok else None, bad["overall"]["offered_rps"] if bad else None],
        "saturation_tok_s": best([lv["overall"]["output_tok_s"] for lv in levels]),
        "saturation_total_tok_s": best([lv["overall"]["total_tok_s"] for lv in levels]),
    }


def next_load(levels: list[dict], target: float, scope: str, growth: float, resolution: float) -> float | None:
    """The load to try next to find the knee, or None when it is bracketed within `resolution`
    (the failing load / the passing one <= 1 + resolution): above the highest load while every
    level attains the target, below the lowest while none does, else the bracket's midpoint."""
    if not levels:
        return None
    ok, bad = knee(levels, target, scope)
    loads = [lv["load"] for lv in levels]
    if bad is None:
        return max(loads) * growth
    if ok is None:
        low = min(loads) / growth
        return low if low >= 1e-3 else None
    if bad["load"] <= ok["load"] * (1 + resolution):
        return None
    return (ok["load"] + bad["load"]) / 2


__all__ = ["SloTable", "derive", "group_figures", "kv_pages", "knee", "level_figures",
           "meets", "next_load", "passes"]
