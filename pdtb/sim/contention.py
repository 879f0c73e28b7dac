"""A step's stretch while the host's other nodes are in steps (`pdtb sim calibrate --contention`).

On a host whose nodes share cores (the CPU testbed: two cores, a prefill and a decode node, the
router, the client), a step takes longer while another node is stepping beside it, and how much
depends on the role: on the reference machine a prefill chunk of 512 tokens took 1.75x as long
with the decode node stepping throughout as with it idle, while decode steps did not stretch
beside prefill steps at all (`pdtb sim calibrate --contention` prints the fit). A spread drawn
step by step regardless of that state stretches the quiet stretches of a run as much as the busy
ones.

Beside it, a stretched role's drawn spread (`--draw-step-spread`) is what the stretch leaves, kept
apart alone (`u` under BUSY_U) and beside busy neighbours, each step weighing its fitted time:
on the reference machine a 512-token chunk alone left 0.83-0.93 of the stretched time (p10-p90),
beside a stepping decode node 0.6-1.3. A part with fewer than 100 logged steps draws nothing (its
steps take the stretched time).

The model, per role: a step's measured / fitted time is `a + b * u`, `u` the seconds the other
nodes of the same run spent in steps over the `WINDOW_S` before the step began, divided by the
window (so 1.0 with one other node stepping throughout; summed over the other nodes). The
window is behind the step, not over it, because that is what a simulated node knows when it
starts one; on the reference machine's logs the two give the same fit. `b` is never negative (a
neighbour's step never makes one faster). A role whose logs never ran beside another node (a
colocated node alone) gets no entry: its steps keep their fitted time.

Fitted from step logs grouped by run: the logs in one folder are one run's nodes
(`--step-log DIR/steps-{node}.jsonl`, as scripts/compare_fairness.sh writes them).
"""
from __future__ import annotations

import collections
from pathlib import Path

from pdtb.sim.path_fit import Cover

WINDOW_S = 0.02  # how far back a step looks at its neighbours' steps
MIN_SAMPLES = 100  # fewer logged steps beside a neighbour: no fit for the role
BUSY_U = 0.5  # a step with neighbours' u at or above this draws its spread from the role's BESIDE levels
BESIDE = "@busy"  # suffix of a role's spread beside busy neighbours (step_spread_quantiles["prefill@busy"])


def neighbours_busy(others: list[Cover], t: float, window_s: float = WINDOW_S) -> float:
    """`u` of a step that starts at `t`: the others' seconds in steps over [t - window, t] per second."""
    return sum(s.within(t - window_s, t) for s in others) / window_s


def runs_of(paths: list[str]) -> dict[str, list[str]]:
    """Step logs grouped by the folder they are in: one run's nodes each."""
    out = collections.defaultdict(list)
    for p in paths:
        out[str(Path(p).resolve().parent)].append(p)
    return dict(out)


def fit_role(points: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(a, b) of ratio = a + b * u by least squares over (u, ratio, weight) points, b clamped at
    0 (then a is the mean ratio); None with fewer than MIN_SAMPLES points or none beside a
    neighbour. The weight is a step's fitted time: the stretch is of the time a role spends in
    steps, which its long steps hold (a 30 ms prefill chunk, not a 2 ms one of a short prompt)."""
    n = len(points)
    sw = sum(w for _, _, w in points)
    if n < MIN_SAMPLES or not sw > 0 or not any(u > 0 for u, _, _ in points):
        return None
    mu = sum(w * u for u, _, w in points) / sw
    mr = sum(w * r for _, r, w in points) / sw
    suu = sum(w * (u - mu) ** 2 for u, _, w in points)
    b = sum(w * (u - mu) * (r - mr) for u, r, w in points) / suu if suu > 0 else 0.0
    if b <= 0:
        return (round(mr, 6), 0.0)
    return (round(mr - b * mu, 6), round(b, 6))


def spread_key(role: str, stretched: bool, u: float) -> str:
    """The step_spread_quantiles key a step of `role` draws from (see the module doc)."""
    return role + BESIDE if stretched and u >= BUSY_U else role


def split_by_neighbours(by_role: dict, stretch: dict, us: dict) -> tuple[dict, dict]:
    """by_role's samples and stretch's factors of each stretched role split by spread_key."""
    samples, factors = {}, {}
    for role, got in by_role.items():
        if role not in stretch:
            samples[role] = got
            continue
        for s, k, u in zip(got, stretch[role], us[role]):
            key = spread_key(role, True, u)
            samples.setdefault(key, []).append(s)
            factors.setdefault(key, []).append(k)
    return samples, factors


def factor(ab: tuple[float, float], u: float) -> float:
    """The stretch a + b * u, never below a tenth of the fit (a badly fitted a stays positive)."""
    return max(0.1, ab[0] + ab[1] * u)
