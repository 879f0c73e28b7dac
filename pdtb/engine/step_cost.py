"""The node's own price of a step: an online least-squares fit of its steps' seconds on their
shapes, every coefficient at least 0 (`SchedState.step_s`).

A node's own price of a step, fitted online from the steps it ran:

    seconds ~ a + b * decode_rows + c * decode_ctx + d * prefill_tokens + e * prefill_attn

(StepShape's fields), least squares over recent steps, each step's weight decaying by DECAY per
step, every coefficient at least 0. Policies read it as `SchedState.step_s` to size what a step
carries in time rather than in tokens; the simulator hands its cost model's `step_s` instead, so
a policy sees the same kind of price in both.

It is the machine's own figure, whatever the scale: the fixed part of a step (a GPU's weight
reads, a CPU's Python), what a decode row's context costs, what a prompt token costs at its
offset. Steps with tier moves or preemptions are left out (their copies are not in the shape).
"""
from __future__ import annotations

import numpy as np

from pdtb.engine.step_shape import StepShape

DECAY = 0.995  # a step's weight halves after about 140 more steps: the fit follows a changing load
MIN_STEPS = 32  # steps seen before the fit is used at all
REFIT_EVERY = 16  # steps between solves (a 5x5 solve; observing is a rank-one update)
# features are scaled to like magnitudes before the solve, so that the ridge that keeps an unseen
# coefficient (no prefill yet) at zero does not bend the others
SCALE = np.array([1.0, 1.0, 1e-3, 1e-2, 1e-5])
RIDGE = 1e-9


def features(shape: StepShape) -> np.ndarray:
    return np.array([1.0, shape.decode_rows, shape.decode_ctx, shape.prefill_tokens, shape.prefill_attn]) * SCALE


class StepCostFit:
    def __init__(self) -> None:
        self.xtx = np.zeros((5, 5))
        self.xty = np.zeros(5)
        self.steps = 0
        self.coef: np.ndarray | None = None

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = features(shape)
        self.xtx *= DECAY
        self.xty *= DECAY
        self.xtx += np.outer(x, x)
        self.xty += x * seconds
        self.steps += 1
        if self.steps >= MIN_STEPS and self.steps % REFIT_EVERY == 0:
            self.coef = solve_nonnegative(self.xtx, self.xty)

    def step_s(self, shape: StepShape) -> float:
        """Seconds a step of `shape` takes here (0.0 before the fit is ready)."""
        return 0.0 if self.coef is None else float(features(shape) @ self.coef)


def solve_nonnegative(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    """The least-squares coefficients from the normal equations, each at least 0: scipy's nnls
    (as the simulator's calibration fits the same features, pdtb/sim/calibration/fit.py) on the
    Cholesky factor, since |L^T w - L^-1 xty|^2 = w'(xtx)w - 2 w'xty + const."""
    from scipy.linalg import cho_factor, solve_triangular
    from scipy.optimize import nnls

    a = xtx + np.eye(len(xty)) * (RIDGE + RIDGE * np.trace(xtx))
    low, _ = cho_factor(a, lower=True)
    low = np.tril(low)
    coef, _ = nnls(low.T, solve_triangular(low, xty, lower=True))
    return coef
