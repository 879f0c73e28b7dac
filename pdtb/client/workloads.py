"""Synthetic workloads: each builds a seeded, reproducible `list[RequestSpec]` sorted by send time.

Length distributions are written as strings (CLI flags and the tenants file share them):
  "64" or "fixed:64"         always 64 tokens
  "uniform:LO:HI"            an integer in [LO, HI], both included
  "lognormal:MEDIAN:SIGMA"   round(MEDIAN * exp(SIGMA * N(0, 1))), at least 1

whale-minnow: `whales` long requests evenly spaced over [whale_start, duration) among a Poisson
stream of short minnows at `minnow_rate`. The defaults (3072+1024 vs 48+16 tokens) make a whale's
KV footprint (prompt + output tokens) 64 times a minnow's. Optionally `context_whales` more whales
of the long-context kind, whose footprint is nearly all prompt (default 4032+64, the same 64
times): in the Azure conversation trace (`../shared/traces`) the requests with the longest
contexts (top decile, about 4,000 tokens) generate a median of 56 tokens, 1.4% of their context,
while the shorter ones generate about a quarter of theirs. Such whales load the prefill side and
the steps a colocated node shares with decoding requests; whales with long outputs hold decode
memory for long. They come from their own seeded stream and go round-robin over the whale
tenants, in class "whale".

multi-tenant: each tenant has its own Poisson rate, length distributions, class, priority and an
optional on/off cycle. The tenants file (`--tenants-file`) is JSON:
  {"duration": 60,                     seconds of arrivals (the --duration flag wins when given)
   "rate": 8.0,                        optional total rate, split by weight among tenants without "rate"
   "tenants": [{"name": "A",           required
                "rate": 2.0,           requests/s while on (or a share of the total "rate" by "weight")
                "weight": 1.0,         share of the total rate (default 1)
                "prompt": "lognormal:256:0.5", "output": "uniform:16:64",   (defaults "64" and "32")
                "class": "chat",       default "default"
                "priority": 0,         optional
                "tier": "interactive",  optional SLO tier sent with its requests (`slo_tier`)
                "start": 0, "on": 10, "off": 20}]}   optional: active from `start`, then `on` s
                                                       on and `off` s off, repeating (default: always on)
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from pdtb.figures.records import RequestSpec
from pdtb.nodes.protocol import SLO_TIER_RE


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution (see the module docstring for the string form)."""

    kind: str  # "fixed" | "uniform" | "lognormal"
    a: float  # fixed value, uniform low, or lognormal median
    b: float = 0.0  # uniform high or lognormal sigma

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"unknown length distribution {self.kind!r}")
        if not (math.isfinite(self.a) and math.isfinite(self.b)) or self.a > 1e9 or self.b > (1e9 if self.kind == "uniform" else 10):
            raise ValueError(f"{self.kind} length parameters out of range: {self.a}, {self.b}")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise ValueError(f"bad {self.kind} length parameters {self.a}, {self.b}")

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", int(parts[0]))
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", int(parts[1]))
            if parts[0] in ("uniform", "lognormal") and len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError as e:
            raise ValueError(f"bad length distribution {text!r}: {e}") from None
        raise ValueError(f"bad length distribution {text!r} (want N, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA)")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(self.a * math.exp(self.b * rng.gauss(0.0, 1.0))))

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (int(self.a) + int(self.b)) / 2
        return self.a * math.exp(self.b ** 2 / 2)


MAX_REQUESTS = 1_000_000  # a generated workload beyond this is a typo, not a benchmark


def poisson_times(rng: random.Random, rate: float, start: float, end: float,
                  burstiness: float = 1.0) -> list[float]:
    """Arrival times with `rate` per second on [start, end): a Poisson process, or with
    `burstiness` != 1 gamma-distributed gaps of the same mean (shape = burstiness, as vLLM's
    client: below 1 burstier, above 1 more even; 1 draws exactly the Poisson stream)."""
    if not 1e-6 <= burstiness <= 1e6:
        raise ValueError(f"burstiness must be in [1e-6, 1e6], got {burstiness!r}")
    if not (math.isfinite(rate) and rate >= 0 and math.isfinite(start) and math.isfinite(end)):
        raise ValueError(f"arrival rate and times must be finite (rate >= 0), got rate {rate!r} on [{start!r}, {end!r})")
    out, t = [], start
    if rate <= 0:
        return out
    if rate * (end - start) > MAX_REQUESTS:
        raise ValueError(f"{rate:g} requests/s for {end - start:g} s is more than {MAX_REQUESTS:,} requests")
    while True:
        t += rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        if t >= end:
            return out
        out.append(t)
        if len(out) > 2 * MAX_REQUESTS:  # a burstiness that piles them up
            raise ValueError(f"more than {2 * MAX_REQUESTS:,} arrivals")


def clamp_to_context(spec: RequestSpec, max_len: int) -> tuple[RequestSpec, bool]:
    """Shrink prompt + output to at most `max_len` tokens, keeping the output when it fits.
    Returns the spec and whether it changed."""
    if spec.prompt_len + spec.output_len <= max_len:
        return spec, False
    output = min(spec.output_len, max_len - 1)
    return replace(spec, prompt_len=max(1, max_len - output), output_len=output), True


@dataclass(frozen=True)
class WhaleMinnowConfig:
    """Options of the whale-minnow workload."""

    whales: int = 2  # number of whale requests
    whale_prompt: str = "3072"  # length distribution
    whale_output: str = "1024"
    whale_start: float = 2.0  # first whale's send time, s (minnows warm up before it)
    minnow_rate: float = 4.0  # minnows per second
    minnow_prompt: str = "48"
    minnow_output: str = "16"
    duration: float = 30.0  # seconds of arrivals
    whale_tenants: tuple[str, ...] = ("whale",)  # whales go round-robin over these
    minnow_tenants: tuple[str, ...] = ("minnow",)  # minnows pick one at random
    whale_priority: int | None = None
    minnow_priority: int | None = None
    whale_interval: float | None = None  # seconds between whales (None: spread over the duration)
    burstiness: float = 1.0  # minnow arrivals: 1 Poisson, < 1 burstier (gamma gaps, see poisson_times)
    context_whales: int = 0  # long-context whales (nearly all prompt), besides `whales`
    context_whale_prompt: str = "4032"
    context_whale_output: str = "64"
    context_whale_start: float | None = None  # None: whale_start
    context_whale_interval: float | None = None  # None: spread over [start, duration)
    whale_tier: str | None = None  # SLO tier sent with every whale (None: the router's tenant default)
    minnow_tier: str | None = None


def _spaced(n: int, start: float, interval: float | None, duration: float) -> list[float]:
    """`n` send times from `start` (capped at the duration), `interval` apart or spread evenly
    over [start, duration)."""
    start = min(start, duration)
    gap = interval if interval is not None else (duration - start) / max(n, 1)
    return [start + i * gap for i in range(n)]


def whale_minnow(cfg: WhaleMinnowConfig, seed: int) -> list[RequestSpec]:
    """The whale-minnow request list. Whales and minnows use separate seeded streams, so
    changing the number of whales leaves the minnows as they were."""
    wp, wo = LengthDist.parse(cfg.whale_prompt), LengthDist.parse(cfg.whale_output)
    mp, mo = LengthDist.parse(cfg.minnow_prompt), LengthDist.parse(cfg.minnow_output)
    wrng, mrng = random.Random(f"{seed}/whale"), random.Random(f"{seed}/minnow")
    specs = []
    if not (0 <= cfg.whales <= MAX_REQUESTS and 0 <= cfg.context_whales <= MAX_REQUESTS
            and cfg.whale_tenants and cfg.minnow_tenants):
        raise ValueError(f"whales and context whales must be in [0, {MAX_REQUESTS:,}] and tenant lists non-empty")
    cstart = cfg.whale_start if cfg.context_whale_start is None else cfg.context_whale_start
    if not (math.isfinite(cfg.duration) and cfg.duration > 0
            and all(math.isfinite(x) and x >= 0 for x in (cfg.whale_start, cstart))
            and all(x is None or (math.isfinite(x) and x >= 0) for x in (cfg.whale_interval, cfg.context_whale_interval))):
        raise ValueError("duration must be > 0, whale starts and intervals finite and >= 0")
    for i, t in enumerate(_spaced(cfg.whales, cfg.whale_start, cfg.whale_interval, cfg.duration)):
        specs.append(RequestSpec(t, cfg.whale_tenants[i % len(cfg.whale_tenants)], "whale",
                                 wp.sample(wrng), wo.sample(wrng), cfg.whale_priority, cfg.whale_tier))
    if cfg.context_whales:
        cp, co = LengthDist.parse(cfg.context_whale_prompt), LengthDist.parse(cfg.context_whale_output)
        crng = random.Random(f"{seed}/context-whale")
        for i, t in enumerate(_spaced(cfg.context_whales, cstart, cfg.context_whale_interval, cfg.duration)):
            tenant = cfg.whale_tenants[(cfg.whales + i) % len(cfg.whale_tenants)]
            specs.append(RequestSpec(t, tenant, "whale", cp.sample(crng), co.sample(crng), cfg.whale_priority,
                                     cfg.whale_tier))
    for t in poisson_times(mrng, cfg.minnow_rate, 0.0, cfg.duration, cfg.burstiness):
        tenant = cfg.minnow_tenants[mrng.randrange(len(cfg.minnow_tenants))]
        specs.append(RequestSpec(t, tenant, "minnow", mp.sample(mrng), mo.sample(mrng), cfg.minnow_priority,
                                 cfg.minnow_tier))
    return sorted(specs, key=lambda s: (s.send_time, s.klass))


@dataclass(frozen=True)
class TenantSpec:
    """One tenant of the multi-tenant workload."""

    name: str
    rate: float  # requests/s while on
    prompt: LengthDist
    output: LengthDist
    weight: float = 1.0  # share of a total rate (already applied to `rate`)
    klass: str = "default"
    priority: int | None = None
    start: float = 0.0  # no arrivals before this
    on: float | None = None  # on-phase length, s; None = always on
    off: float = 0.0  # off-phase length, s
    tier: str | None = None  # SLO tier sent with its requests (None: the router's tenant default)

    def active(self, t: float) -> bool:
        if t < self.start:
            return False
        return self.on is None or (t - self.start) % (self.on + self.off) < self.on


def _number(r: dict, key: str, default, lo: float, where: str, above: bool = False):
    """A tenants-file number: finite, >= lo (> lo with `above`); `default` when absent or null."""
    v = r.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            (v <= lo if above else v < lo):
        raise ValueError(f"tenants file: {where}'{key}' must be a number {'above' if above else 'at least'} {lo:g}, "
                         f"got {v!r}")
    return float(v)


def _tenant(r: dict, rate: float, weight: float) -> TenantSpec:
    name = r.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tenants file: every tenant needs a 'name' (a non-empty string), got {name!r}")
    where = f"tenant {name!r}: "
    priority, tier = r.get("priority"), r.get("tier")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"tenants file: {where}'priority' must be a whole number, got {priority!r}")
    if tier is not None and not (isinstance(tier, str) and SLO_TIER_RE.fullmatch(tier)):
        raise ValueError(f"tenants file: {where}'tier' must be 1-32 characters of [A-Za-z0-9_.-], got {tier!r}")
    on = _number(r, "on", None, 0.0, where, above=True)
    return TenantSpec(name, rate, LengthDist.parse(str(r.get("prompt", "64"))),
                      LengthDist.parse(str(r.get("output", "32"))), weight, str(r.get("class", "default")),
                      priority, _number(r, "start", 0.0, 0.0, where), on, _number(r, "off", 0.0, 0.0, where), tier)


def parse_tenants(doc: dict) -> tuple[list[TenantSpec], float | None]:
    """Tenants (and the duration, if given) from the tenants-file JSON document. Every field is
    checked: a wrong one is a ValueError naming it, never a workload other than the file says."""
    if not isinstance(doc, dict) or not all(isinstance(r, dict) for r in doc.get("tenants") or []):
        raise ValueError("tenants file: want a JSON object {\"tenants\": [{\"name\": ..., ...}, ...]}")
    rows = doc.get("tenants") or []
    if not rows:
        raise ValueError("tenants file: 'tenants' must be a non-empty list")
    names = [r.get("name") for r in rows]
    twice = sorted({str(n) for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tenants file: tenant names must differ ({', '.join(twice)} given more than once)")
    total = _number(doc, "rate", None, 0.0, "")
    duration = _number(doc, "duration", None, 0.0, "", above=True)
    weights = [_number(r, "weight", 1.0, 0.0, f"tenant {r.get('name')!r}: ") for r in rows]
    unrated = [w for r, w in zip(rows, weights) if r.get("rate") is None]
    if unrated and total is None:
        raise ValueError("tenants file: give every tenant a 'rate', or a total 'rate' to split by weight")
    if unrated and sum(unrated) <= 0:
        raise ValueError("tenants file: the weights of the tenants without a 'rate' must not all be 0")
    out = []
    for r, weight in zip(rows, weights):
        rate = _number(r, "rate", None, 0.0, f"tenant {r.get('name')!r}: ")
        out.append(_tenant(r, rate if rate is not None else total * weight / sum(unrated), weight))
    return out, duration


def even_tenants(n: int, total_rate: float, weights: list[float] | None, prompt: str, output: str,
                 on: float | None = None, off: float = 0.0) -> list[TenantSpec]:
    """`n` tenants t0..t{n-1} sharing `total_rate` by weight, with the same lengths and cycle."""
    if on is not None and not (0 < on < float("inf") and 0 <= off < float("inf")):
        raise ValueError(f"--on must be > 0 and --off >= 0 (finite), got {on}, {off}")
    if n < 1:
        raise ValueError(f"--num-tenants must be at least 1, got {n}")
    weights = weights or [1.0] * n
    if not all(0 < w < float("inf") for w in weights):
        raise ValueError(f"tenant weights must be positive and finite, got {weights}")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} tenants")
    return [TenantSpec(f"t{i}", total_rate * w / sum(weights), LengthDist.parse(prompt), LengthDist.parse(output),
                       w, on=on, off=off) for i, w in enumerate(weights)]


def multi_tenant(tenants: list[TenantSpec], duration: float, seed: int, burstiness: float = 1.0) -> list[RequestSpec]:
    """Every tenant's Poisson (or gamma, see poisson_times) arrivals, thinned to its on-phases,
    merged by send time."""
    specs = []
    for t in tenants:
        rng = random.Random(f"{seed}/tenant/{t.name}")
        for when in poisson_times(rng, t.rate, t.start, duration, burstiness):
            p, o = t.prompt.sample(rng), t.output.sample(rng)  # drawn before thinning: stable lengths
            if t.active(when):
                specs.append(RequestSpec(when, t.name, t.klass, p, o, t.priority, t.tier))
    return sorted(specs, key=lambda s: (s.send_time, s.tenant))
