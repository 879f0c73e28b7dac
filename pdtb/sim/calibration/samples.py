"""Measured steps to fit a step cost to, from two sources, read and checked.

1. `pdtb bench steps --grid --json`: one JSON object, kind "step-samples", whose samples carry
   the StepShape fields and the step's median milliseconds (the forward pass alone).
2. A node's `--step-log` (pdtb/nodes/step_log.py): one JSON line per engine step,

       {"t": start (s), "ms": engine.step() duration, "decode": [[tenant, rows, ctx], ...],
        "prefill": [[tenant, request id, tokens, offset], ...], "moves": [[kind, id, pages, ms], ...]}

   Converted to StepShape terms:
   - a decode row's ctx is the request's num_computed_tokens after the step: the fed token's
     position + 1, exactly the tokens its attention read (StepShape.of counts start + 1 before
     the engine advances);
   - a prefill chunk's offset is its first token's position, so its query-key pairs are
     tokens * offset + tokens * (tokens + 1) / 2;
   - the step's ms includes scheduling and sampling (a grid sample's does not) and any tier moves
     run inside it; the moves' own ms are taken out (a simulator charges them as tier moves).
   Consecutive steps also give the node's own work between steps (events, control messages):
   the idle time from one step's end to the next one's start, where the node ran steps back to
   back (idle under `b2b_ms`), median over the log.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
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
    ms: float

    def __post_init__(self) -> None:
        bad = [f for f in FIELDS if getattr(self.shape, f) < 0]
        if bad or not self.ms >= 0:
            raise SampleError(f"negative {bad[0] if bad else 'ms'}")


@dataclass(frozen=True)
class StepLogRead:
    """What one step log gives: samples, the idle gaps between back-to-back steps, tier moves,
    and every step's (start, end) time (s)."""

    samples: list[StepSample]
    gaps_s: list[float]
    moves: list[tuple[int, float]]  # (pages, seconds) of each demotion or promotion
    spans: list[tuple[float, float]]


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SampleError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _ms(value, what: str = "ms") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise SampleError(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def _text(path: str | Path) -> str:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SampleError(f"{path}: {e.strerror or e}") from None
    if not text.strip():
        raise SampleError(f"{path}: empty file")
    return text


def read_samples(path: str | Path) -> tuple[list[StepSample], dict]:
    """The samples of a `bench steps --grid --json` file and its header (device, model, machine, ...)."""
    try:
        doc = json.loads(_text(path))
    except ValueError as e:
        raise SampleError(f"{path}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != "step-samples" or not isinstance(doc.get("samples"), list):
        raise SampleError(f"{path}: not a step-samples file (write one with pdtb bench steps --grid --json)")
    samples = []
    for i, s in enumerate(doc["samples"]):
        try:
            if not isinstance(s, dict):
                raise SampleError("not an object")
            samples.append(StepSample(StepShape(*(_count(s.get(f), f) for f in FIELDS)), _ms(s.get("ms"))))
        except SampleError as e:
            raise SampleError(f"{path} sample {i}: {e}") from None
    if not samples:
        raise SampleError(f"{path}: no samples")
    return samples, {k: v for k, v in doc.items() if k != "samples"}


def _log_record(rec) -> tuple[float, float, float, StepShape, list]:
    """(start s, ms, of which tier moves ms, shape, [(pages, s) of each demotion or promotion])."""
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
    return (_ms(rec.get("t"), "t"), _ms(rec.get("ms")), sum(ms for _, _, ms in logged),
            StepShape(rows, ctx, chunks, tokens, attn), [(p, ms / 1e3) for kind, p, ms in logged if kind in TIER_KINDS])


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
    steps.sort(key=lambda s: s[0])
    samples = [StepSample(shape, max(0.0, ms - moved)) for _, ms, moved, shape, _ in steps if shape.tokens]
    if not samples:
        raise SampleError(f"{path}: no steps that ran tokens")
    idle = [b[0] - a[0] - a[1] / 1e3 for a, b in zip(steps, steps[1:])]
    # t and ms are logged rounded to 1 us: a gap a hair below zero is a back-to-back step
    b2b = [max(0.0, g) for g in idle if -2e-6 <= g < b2b_ms / 1e3]
    return StepLogRead(samples, b2b, [m for s in steps for m in s[4]], [(s[0], s[0] + s[1] / 1e3) for s in steps])


def node_overhead_s(gaps_s: list[float]) -> float | None:
    """The node's own work per step: the median idle gap between back-to-back steps."""
    return statistics.median(gaps_s) if gaps_s else None


def tier_link(moves: list[tuple[int, float]], page_bytes: int) -> LinkModel | None:
    """A tier link from logged demotions and promotions: bytes over seconds, summed."""
    secs = sum(s for _, s in moves)
    nbytes = sum(p for p, _ in moves) * page_bytes
    return LinkModel(nbytes / secs) if secs > 0 and nbytes > 0 else None


def step_log_role(path: str | Path) -> str | None:
    """The node role a step log's file name gives (`steps-decode-0.jsonl`: the nodes' default
    `steps-{node}` with node ids ROLE-N), or None."""
    name = Path(path).name
    return next((r for r in ("prefill", "decode", "colocated") if f"-{r}-" in f"-{name}"), None)
