"""The step cost fitted to measured steps:

    step ms = c0 + rows * decode_rows + ctx * decode_ctx + chunks * prefill_chunks
                 + tokens * prefill_tokens + attn * prefill_attn

Every coefficient is non-negative (scipy.optimize.nnls): a step never gets cheaper by carrying
more. The fit weighs each sample by 1 / its ms, so it minimises relative error: a 3 ms decode step
counts as much as a 300 ms prefill step, and decode steps are most of a run's steps.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from pdtb.sim.calibration.samples import SampleError, StepSample
from pdtb.sim.cost import StepShape

TERMS = ("c0", "rows", "ctx", "chunks", "tokens", "attn")


@dataclass(frozen=True)
class Coefficients:
    """Milliseconds per unit of each StepShape field, and per step (c0)."""

    c0: float = 0.0
    rows: float = 0.0  # per decode row
    ctx: float = 0.0  # per context token a decode row reads
    chunks: float = 0.0  # per prefill chunk
    tokens: float = 0.0  # per prefill token
    attn: float = 0.0  # per query-key pair of a prefill chunk

    def __post_init__(self) -> None:
        if any(not getattr(self, f) >= 0 for f in TERMS):
            raise ValueError("step-cost coefficients must be non-negative numbers")

    def ms(self, s: StepShape) -> float:
        return (self.c0 + self.rows * s.decode_rows + self.ctx * s.decode_ctx + self.chunks * s.prefill_chunks
                + self.tokens * s.prefill_tokens + self.attn * s.prefill_attn)


def features(s: StepShape) -> list[float]:
    """The fit's regressors of one step, in TERMS order."""
    return [1.0, s.decode_rows, s.decode_ctx, s.prefill_chunks, s.prefill_tokens, s.prefill_attn]


@dataclass(frozen=True)
class Fit:
    """A fitted model and how well it matches the samples it came from."""

    coef: Coefficients
    samples: int
    r2: float  # on ms, unweighted
    max_rel_err: float  # max |predicted - measured| / measured

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError("a fit needs samples")


def fit(samples: list[StepSample]) -> Fit:
    """Non-negative least squares of ms on the StepShape fields, relative error (1 / ms weights).
    Columns are scaled to unit maximum first so nnls sees comparable magnitudes (a context count
    runs to 1e5, the constant is 1); a column that is all zero gets coefficient 0."""
    import numpy as np
    from scipy.optimize import nnls

    if not samples:
        raise SampleError("no samples to fit")
    x = np.array([features(s.shape) for s in samples], dtype=float)
    y = np.array([s.ms for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-3)  # a 0 ms sample would weigh infinitely
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)
    sol, _ = nnls((x / scale) * w[:, None], y * w)
    pred = x @ (sol / scale)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / np.maximum(y, 1e-3)
    return Fit(Coefficients(*(float(c) for c in sol / scale)), len(samples), r2, float(rel.max()))


def scaled_to(grid: list[StepSample], logged: list[StepSample]) -> tuple[list[StepSample], float]:
    """The grid's samples times k, the logged steps' median ratio to what the grid alone fits for
    them, and k: a grid measured at another time than the logged runs, on a host whose speed
    drifts, keeps its shape and takes the runs' level."""
    own = fit(grid).coef
    k = statistics.median(s.ms / m for s in logged if (m := own.ms(s.shape)) > 0)
    return [StepSample(s.shape, s.ms * k) for s in grid], k
