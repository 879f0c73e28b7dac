"""Measured steps to fit a step-cost model to, from two sources, read and checked.

1. `pdtb bench steps --grid --json`: one JSON object, kind "step-samples", whose samples carry
   the StepShape fields and the step's median milliseconds (the forward pass alone).
2. A node's `--step-log` (pdtb/nodes/step_log.py): one JSON line per engine step,

       {"t": start (s), "ms": engine.step() duration, "decode": [[tenant, rows, ctx], ...],
        "prefill": [[tenant, request id, tokens, offset], ...], "moves": [[kind, id, pages, ms], ...]}

   Converted to StepShape terms:
   - a decode row's ctx is the request's num_computed_tokens after the step: the fed token's
     position + 1, which is exactly the tokens its attention read (StepShape.of counts
     start + 1 before the engine advances): summed as logged;
   - a prefill chunk's offset is its first token's position (taken before the advance), so its
     query-key pairs are tokens * offset + tokens * (tokens + 1) / 2;
   - the step's ms includes scheduling and sampling (a grid sample's does not) and any tier
     moves the scheduler ran inside it; the moves' own ms are taken out (a simulator charges
     them through tier_move_s).
   Consecutive steps also give the node's own work between steps (events, control messages):
   the idle time from one step's end to the next one's start, where the node ran steps back
   to back (idle under `b2b_ms`), median over the log.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pdtb.sim.cost import LinkModel, StepShape

FIELDS = ("decode_rows", "decode_ctx", "prefill_chunks", "prefill_tokens", "prefill_attn")
TIER_KINDS = ("demote", "promote")  # moves that copy pages (a preemption drops them)


class SampleError(ValueError):
    """A calibration input that cannot be read: the message is one line naming where."""


@dataclass(frozen=True)
class StepSample:
    """One measured step: what it carried and how long it took."""

    shape: StepShape
    ms: float  # milliseconds of the step

    def __post_init__(self) -> None:
        bad = [f for f in FIELDS if getattr(self.shape, f) < 0]
        if bad or not self.ms >= 0:
            raise SampleError(f"negative {bad[0] if bad else 'ms'}")


@dataclass(frozen=True)
class StepLogRead:
    """What one step log gives: samples, the idle gaps between back-to-back steps, tier moves."""

    samples: list[StepSample]
    gaps_s: list[float]  # idle seconds between consecutive back-to-back steps
    moves: list[tuple[int, float]]  # (pages, seconds) of each demotion or promotion
    busy_gaps_s: list[float] = field(default_factory=list)  # between two steps that both decoded, however long
    busy_windows: list[tuple[float, float]] = field(default_factory=list)  # those gaps' (start, end) times (s)
    spans: list[tuple[float, float]] = field(default_factory=list)  # every step's (start, end) time (s)
    starts: list[float] = field(default_factory=list)  # each sample's step's start time (s), as `samples`
    decode_ends: list[float] = field(default_factory=list)  # the end (s) of every step that decoded, in order


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SampleError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _ms(value, what: str = "ms") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise SampleError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def read_samples(path: str | Path) -> tuple[list[StepSample], dict]:
    """The samples of a `bench steps --grid --json` file and its header (device, model, ...)."""
    text = _text(path)
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SampleError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "step-samples" or not isinstance(doc.get("samples"), list):
        raise SampleError(f"{path}: not a step-samples file (write one with pdtb bench steps --grid --json)")
    samples = []
    for i, s in enumerate(doc["samples"]):
        try:
            if not isinstance(s, dict):
                raise SampleError("not an object")
            shape = StepShape(*(_count(s.get(f), f) for f in FIELDS))
            samples.append(StepSample(shape, _ms(s.get("ms"))))
        except SampleError as e:
            raise SampleError(f"{path} sample {i}: {e}") from None
    if not samples:
        raise SampleError(f"{path}: no samples")
    return samples, {k: v for k, v in doc.items() if k != "samples"}


def _text(path: str | Path) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SampleError(f"{path}: {e.strerror or e}") from None
    if not text.strip():
        raise SampleError(f"{path}: empty file")
    return text


@dataclass(frozen=True)
class _Logged:
    t: float  # start of the step (s)
    ms: float  # the step's duration as logged
    moved_ms: float  # of which tier moves, preemptions included
    shape: StepShape
    moves: list[tuple[int, float]]  # (pages, seconds) of each demotion or promotion


def _log_record(rec) -> _Logged:
    if not isinstance(rec, dict):
        raise SampleError("not an object")
    rows = ctx = chunks = tokens = attn = 0
    for d in rec.get("decode") or []:
        rows += _count(d[1], "decode rows")
        ctx += _count(d[2], "decode context")
    for p in rec.get("prefill") or []:
        n, off = _count(p[2], "prefill tokens"), _count(p[3], "prefill offset")
        chunks, tokens, attn = chunks + 1, tokens + n, attn + n * off + n * (n + 1) // 2
    logged = [(m[0], _count(m[2], "move pages"), _ms(m[3], "move ms")) for m in rec.get("moves") or []]
    return _Logged(_ms(rec.get("t"), "t"), _ms(rec.get("ms")), sum(ms for _, _, ms in logged),
                   StepShape(rows, ctx, chunks, tokens, attn),
                   [(pages, ms / 1e3) for kind, pages, ms in logged if kind in TIER_KINDS])


def read_step_log(path: str | Path, b2b_ms: float = 5.0) -> StepLogRead:
    """The steps of one `--step-log` file (see the module docstring)."""
    steps = []
    for i, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            steps.append(_log_record(json.loads(line)))
        except ValueError as e:  # SampleError, or json's own
            raise SampleError(f"{path} line {i}: {e if isinstance(e, SampleError) else 'not JSON'}") from None
        except (TypeError, IndexError, KeyError):
            raise SampleError(f"{path} line {i}: not a step-log record") from None
    steps.sort(key=lambda s: s.t)
    samples = [StepSample(s.shape, max(0.0, s.ms - s.moved_ms)) for s in steps if s.shape.tokens]
    starts = [s.t for s in steps if s.shape.tokens]
    if not samples:
        raise SampleError(f"{path}: no steps that ran tokens")
    idle = [b.t - a.t - a.ms / 1e3 for a, b in zip(steps, steps[1:])]
    # t and ms are logged rounded (1 us, 1 us): a gap a hair below zero is a back-to-back step
    b2b = [max(0.0, g) for g in idle if -2e-6 <= g < b2b_ms / 1e3]
    # two steps in a row that both decoded: rows were waiting for the next step, so the gap is the
    # loop's own work, not idle time (a prefill node's steps are apart while no prompt is there)
    pairs = [(g, a, b) for g, a, b in zip(idle, steps, steps[1:])
             if a.shape.decode_rows and b.shape.decode_rows and g >= -2e-6]
    busy = [max(0.0, g) for g, _, _ in pairs]
    return StepLogRead(samples, b2b, [m for s in steps for m in s.moves], busy,
                       [(a.t + a.ms / 1e3, b.t) for _, a, b in pairs], [(s.t, s.t + s.ms / 1e3) for s in steps],
                       starts, [s.t + s.ms / 1e3 for s in steps if s.shape.decode_rows])


def node_overhead_s(gaps_s: list[float]) -> float | None:
    """The node's own work per step: the median idle gap between back-to-back steps."""
    return statistics.median(gaps_s) if gaps_s else None


OVERHEAD_QS = tuple(i / 100 for i in range(100)) + (0.995, 0.999, 1.0)  # the levels kept of the loop's gaps


def unit(key: int) -> float:
    """A number in [0, 1) that depends on `key` alone (splitmix64's finaliser): a simulated draw
    that every way of simulating a run makes the same, whatever the order of its events."""
    z = (key + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def draw(q, u: float) -> float:
    """The value at level `u` of quantiles `q` taken at OVERHEAD_QS, linear between levels."""
    levels = OVERHEAD_QS
    i = bisect.bisect_right(levels, u) - 1
    if i >= len(levels) - 1:
        return q[-1]
    w = (u - levels[i]) / (levels[i + 1] - levels[i])
    return q[i] + (q[i + 1] - q[i]) * w


def seconds_levels(q, what: str) -> tuple[float, ...]:
    """`q` checked as seconds at OVERHEAD_QS (what `draw` draws from): that many numbers,
    non-negative, finite and non-decreasing; else one ValueError naming `what`."""
    if not isinstance(q, (list, tuple)) or len(q) != len(OVERHEAD_QS) or \
            not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in q) or \
            any(b < a for a, b in zip(q, q[1:])):
        raise ValueError(f"{what}: {len(OVERHEAD_QS)} non-decreasing non-negative seconds")
    return tuple(float(x) for x in q)


def overhead_quantiles(gaps_s: list[float], minimum: int = 100) -> list[float] | None:
    """The loop's gaps between steps with work (`busy_gaps_s`) at OVERHEAD_QS: the distribution a
    simulated node draws each step's overhead from (pdtb/sim/calibrate.py); None with fewer
    than `minimum` values. Any other seconds drawn the same way take their levels here too."""
    if len(gaps_s) < minimum:
        return None
    g = sorted(gaps_s)
    return [round(g[min(len(g) - 1, int(q * (len(g) - 1) + 0.5))], 7) for q in OVERHEAD_QS]


def tier_link(moves: list[tuple[int, float]], page_bytes: int) -> LinkModel | None:
    """A tier link from logged demotions and promotions: bytes over seconds, summed."""
    secs = sum(s for _, s in moves)
    nbytes = sum(p for p, _ in moves) * page_bytes
    return LinkModel(nbytes / secs) if secs > 0 and nbytes > 0 else None


ROLES = ("prefill", "decode", "colocated")


def step_log_role(path: str | Path) -> str | None:
    """The node role a step log's file name gives (`steps-decode-0.jsonl`: the nodes' default
    `steps-{node}` with node ids ROLE-N), or None."""
    name = Path(path).name
    return next((r for r in ROLES if f"-{r}-" in f"-{name}"), None)


def step_spread(by_role: dict[str, list[StepSample]], fitted_ms, stretch: dict | None = None,
                by_time: bool = False) -> dict[str, tuple]:
    """Per role with at least 100 logged steps: the quantiles at OVERHEAD_QS of each step's
    measured over fitted milliseconds (`fitted_ms(shape)`), the spread a simulated node of that
    role draws each step's factor from (pdtb/sim/calibrate.py `step_factor`). `stretch`: per
    role, each sample's stretch beside its neighbours (pdtb/sim/contention.py), taken out of its
    ratio, since the simulator applies it apart. `by_time`: each step weighs its fitted time
    in the quantiles, so that the steps that hold a role's time (its long prefill chunks) give
    its spread, not the many short ones."""
    out = {}
    for role, samples in by_role.items():
        div = (stretch or {}).get(role) or [1.0] * len(samples)
        pts = [(max(1e-3, s.ms / p / k), p) for s, k in zip(samples, div) if (p := fitted_ms(s.shape)) > 0]
        q = weighted_quantiles(pts) if by_time else overhead_quantiles([r for r, _ in pts])
        if q:
            out[role] = tuple(q)
    return out


def weighted_quantiles(points: list[tuple[float, float]], minimum: int = 100) -> list[float] | None:
    """(value, weight) points at OVERHEAD_QS, each level the first value whose cumulative weight
    reaches it (level 0: the least value); None with fewer than `minimum` points, as
    overhead_quantiles."""
    if len(points) < minimum:
        return None
    pts = sorted(points)
    total = sum(w for _, w in pts)
    out, acc, i = [], 0.0, 0
    for q in OVERHEAD_QS:
        while i < len(pts) - 1 and acc + pts[i][1] < q * total:
            acc += pts[i][1]
            i += 1
        out.append(round(pts[i][0], 7))
    return out
