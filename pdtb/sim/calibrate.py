"""`CalibratedCost`: a step-cost model fitted to steps measured on the machine at hand.

    step ms = c0 + rows * decode_rows + ctx * decode_ctx + chunks * prefill_chunks
                 + tokens * prefill_tokens + attn * prefill_attn
    step s  = step ms / 1000 + node_overhead_s

Every coefficient is non-negative (scipy.optimize.nnls): a step never gets cheaper by carrying
more. The fit weighs each sample by 1 / its ms, so it minimises relative error: a 3 ms decode
step counts as much as a 300 ms prefill step, and decode steps are most of a run's steps.
`node_overhead_s` is the node's own work between steps (events, control messages), measured
from step logs or given. KV hand-offs and tier moves cost as two `LinkModel`s.

Calibration file (`pdtb sim calibrate --out`, `CalibratedCost.load`):

    {"kind": "step-calibration", "version": 1, "command": ..., "device", "model", "threads",
     "dtype", "page_size", "machine" (the samples': accelerator, cpu, cores, versions),
     "path": {"rpc_latency_s", "client_latency_s", "transfer_latency_s", "delivery" (each token's
     way to the client: pdtb/sim/delivery.py), "modes"} (fitted to real runs), "page_bytes", "coef_ms": {"c0", "rows", "ctx", "chunks", "tokens", "attn"},
     "node_overhead_s", "land_s" (the decode loop's work per hand-off landed, fitted to real runs:
     pdtb/sim/landing_fit.py; 0 when absent), "step_spread_quantiles": {role: [...]} (a step's
     measured / fitted time by role, drawn per step; absent: none), "step_contention": {role:
     [a, b]} (a step's stretch a + b * u beside the other nodes' steps: pdtb/sim/contention.py;
     absent: none), "handoff_latency_quantiles_s"
     (a hand-off's fixed latency at OVERHEAD_QS, drawn per hand-off instead of the transfer link's
     latency: pdtb/sim/path_fit.py; absent: none), "transfer": {"bytes_per_s", "latency_s"}, "tier_move": {...},
     "fit": {"samples", "r2", "max_rel_err", "sources": [...]}}
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdtb.sim import contention as neighbours
from pdtb.sim.cost import LinkModel, StepShape
from pdtb.sim.step_samples import OVERHEAD_QS, ROLES, SampleError, StepSample, draw, seconds_levels, unit

# This machine's byte-moving figures (2 cores, no GPU). A hand-off: `pdtb bench transport
# --endpoint tcp` moves a large request's KV at 2.42 GB/s and 7,148 one-page requests/s (140 us
# each; docs/results.md). A tier move: PagePool.copy_pages_to between two CPU pools of the tiny
# model's 32 KiB pages, one thread, took 40-65 us for one page and 2.0-3.0 GB/s for 16 to 256.
CPU_TRANSFER = LinkModel(2.42e9, 140e-6)
CPU_TIER = LinkModel(2.5e9, 50e-6)
TERMS = ("c0", "rows", "ctx", "chunks", "tokens", "attn")
_OWN_KEYS = ("kind", "version", "page_bytes", "coef_ms", "node_overhead_s", "node_overhead_quantiles_s", "transfer",
             "tier_move", "label", "land_s", "step_spread_quantiles", "handoff_latency_quantiles_s",
             "step_contention")
HANDOFF_STREAM = 0x5EED_0FF5_AB1E_C0DE  # keeps the hand-offs' draws apart from the steps'


@dataclass(frozen=True)
class Coefficients:
    """Milliseconds per unit of each StepShape field, and per step (c0)."""

    c0: float = 0.0  # ms per step
    rows: float = 0.0  # ms per decode row
    ctx: float = 0.0  # ms per context token a decode row reads
    chunks: float = 0.0  # ms per prefill chunk
    tokens: float = 0.0  # ms per prefill token
    attn: float = 0.0  # ms per query-key pair of a prefill chunk

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
    Columns are scaled to unit maximum first so nnls sees comparable magnitudes (a context
    count runs to 1e5, the constant is 1); a column that is all zero gets coefficient 0."""
    import numpy as np
    from scipy.optimize import nnls

    if not samples:
        raise SampleError("no samples to fit")
    x = np.array([features(s.shape) for s in samples], dtype=float)
    y = np.array([s.ms for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-3)  # a 0 ms sample would weigh infinitely
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)
    sol, _ = nnls((x / scale) * w[:, None], y * w)
    coef = Coefficients(*(float(c) for c in sol / scale))
    pred = x @ (sol / scale)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    rel = np.abs(pred - y) / np.maximum(y, 1e-3)
    return Fit(coef, len(samples), r2, float(rel.max()))


@dataclass(frozen=True)
class CalibratedCost:
    """CostModel from fitted coefficients, a per-step node overhead and two links."""

    coef: Coefficients
    page_bytes: int  # bytes of one KV page of the measured model (all layers, K and V)
    transfer: LinkModel = CPU_TRANSFER  # prefill -> decode hand-off
    tier: LinkModel = CPU_TIER  # device <-> host tier copies
    node_overhead_s: float = 0.0  # the node's own work per step, between steps
    label: str = "calibrated"  # names the calibration in results
    meta: dict = field(default_factory=dict, compare=False, hash=False)  # the file's other fields
    # the node loop's gap before each step, drawn per step from these levels (step_samples.OVERHEAD_QS)
    # instead of node_overhead_s: fitted to the step logs' gaps between steps with work; () none
    overhead_q: tuple = ()
    land_s: float = 0.0  # the decode loop's own work for each hand-off that lands (pdtb/sim/landing_fit.py)
    # per role, the logged steps' measured / fitted time at OVERHEAD_QS: each simulated step's
    # time is multiplied by a draw from its node's role ({} none: every step takes the fit's time)
    spread_q: dict = field(default_factory=dict, compare=False, hash=False)
    # a hand-off's fixed latency at OVERHEAD_QS, drawn per hand-off instead of transfer.latency_s
    # (the real runs' first token to landing, less the decode node's steps and the bytes' time); () none
    handoff_q: tuple = ()
    # per role, (a, b): each step's time is multiplied by a + b * u, u the other nodes' share of the
    # last contention.WINDOW_S spent in steps (pdtb/sim/contention.py); {} none
    contention: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.page_bytes < 1 or not self.node_overhead_s >= 0 or not self.land_s >= 0:
            raise ValueError("page_bytes must be positive, node_overhead_s and land_s non-negative")

    @property
    def name(self) -> str:
        return f"calibrated:{self.label}"

    @property
    def path(self) -> dict | None:
        """The request path's latencies fitted to real runs (pdtb/sim/path_fit.py), if it has them."""
        return self.meta.get("path")

    def describe(self) -> str:
        """Which calibration this is: what it was measured on, the fit, and the machine."""
        m, fit = self.meta, self.meta.get("fit") or {}
        model = str(m.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]
        host = m.get("machine")
        where = (f"{host.get('accelerator') or host.get('cpu')}, {host.get('cores')} cores; "
                 + ", ".join(f"{k} {v}" for k, v in (host.get("versions") or {}).items())) if host else \
            "machine and versions not recorded in the file"
        return (f"calibration {self.label}: {model} {m.get('dtype', '?')} on {m.get('device', '?')}, "
                f"{m.get('threads', '?')} thread(s); fit of {fit.get('samples', '?')} steps, R^2 {fit.get('r2', '?')}; {where}")

    def step_s(self, shape: StepShape, factor: float = 1.0) -> float:
        """The fitted step (times `factor`: a draw of `step_factor`) plus the node's overhead
        (with `overhead_q`, `step_overhead_s` gives it step by step instead); an empty step
        costs nothing."""
        if not shape.tokens:
            return 0.0
        return self.coef.ms(shape) / 1e3 * factor + (0.0 if self.overhead_q else self.node_overhead_s)

    def step_overhead_s(self, key: int) -> float:
        """The loop's gap before the step `key` names (a node's and its step number's): a draw
        from `overhead_q` that depends on the key alone, so every way of simulating a run draws
        the same (0 without the levels)."""
        return draw(self.overhead_q, unit(key)) if self.overhead_q else 0.0

    def step_factor(self, role: str, key: int, busy: float = 0.0) -> float:
        """How much longer than the fit the step `key` names takes on a node of `role`: a draw
        from that role's `spread_q` (its logged steps' measured over fitted time), by the key
        alone, from a stream of its own (1.0 without levels for the role), times the role's
        stretch with its neighbours `busy` (contention.neighbours_busy; 1.0 without one)."""
        ab = self.contention.get(role)
        q = self.spread_q.get(neighbours.spread_key(role, ab is not None, busy))
        return (draw(q, unit(~key & 0xFFFFFFFFFFFFFFFF)) if q else 1.0) * (neighbours.factor(ab, busy) if ab else 1.0)

    def transfer_s(self, nbytes: int) -> float:
        return self.transfer.seconds(nbytes)

    def handoff_s(self, nbytes: int, key: int) -> tuple[float, float]:
        """(seconds the prefill node's link is busy, seconds until it lands) for the hand-off
        `key` names (its transfer id's): the link's bytes and latency, and with `handoff_q` its
        bytes and a draw of the latency by the key alone."""
        busy = self.transfer.seconds(nbytes)
        if not self.handoff_q:
            return busy, busy
        return busy, nbytes / self.transfer.bytes_per_s + draw(self.handoff_q, unit(key ^ HANDOFF_STREAM))

    def tier_move_s(self, nbytes: int) -> float:
        return self.tier.seconds(nbytes)

    def to_json(self) -> dict:
        """The calibration file's object (see the module docstring)."""
        return {"kind": "step-calibration", "version": 1, **self.meta, "page_bytes": self.page_bytes,
                "coef_ms": asdict(self.coef), "node_overhead_s": self.node_overhead_s,
                **({"node_overhead_quantiles_s": list(self.overhead_q)} if self.overhead_q else {}),
                **({"land_s": self.land_s} if self.land_s else {}),
                **({"step_spread_quantiles": {r: list(q) for r, q in self.spread_q.items()}} if self.spread_q else {}),
                **({"handoff_latency_quantiles_s": list(self.handoff_q)} if self.handoff_q else {}),
                **({"step_contention": {r: list(ab) for r, ab in self.contention.items()}} if self.contention else {}),
                "transfer": asdict(self.transfer), "tier_move": asdict(self.tier), "label": self.label}

    @classmethod
    def from_json(cls, doc: dict, where: str = "calibration") -> "CalibratedCost":
        if not isinstance(doc, dict) or doc.get("kind") != "step-calibration":
            raise SampleError(f"{where}: not a step-calibration file (write one with pdtb sim calibrate)")
        try:
            coef = Coefficients(**{k: float(doc["coef_ms"][k]) for k in TERMS})
            q, hq = (_levels(doc, k) for k in ("node_overhead_quantiles_s", "handoff_latency_quantiles_s"))
            return cls(coef, int(doc["page_bytes"]), LinkModel(**doc["transfer"]), LinkModel(**doc["tier_move"]),
                       float(doc.get("node_overhead_s", 0.0)), str(doc.get("label", Path(where).stem)),
                       {k: v for k, v in doc.items() if k not in _OWN_KEYS}, q, float(doc.get("land_s", 0.0)),
                       _spread(doc.get("step_spread_quantiles") or {}), hq,
                       _contention(doc.get("step_contention") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise SampleError(f"{where}: bad calibration ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str | Path) -> "CalibratedCost":
        """A calibration file by path, or by the name of one shipped in pdtb/sim/calibrations."""
        p = Path(path)
        if not p.is_file():
            shipped = Path(__file__).with_name("calibrations") / f"{path}.json"
            p = shipped if shipped.is_file() else p
        try:
            doc = json.loads(p.read_text())
        except OSError as e:
            raise SampleError(f"{path}: {e.strerror or e}") from None
        except ValueError:
            raise SampleError(f"{path}: not JSON") from None
        return cls.from_json(doc, str(p))


def _levels(doc: dict, key: str) -> tuple:
    """`doc[key]` checked: len(OVERHEAD_QS) non-decreasing non-negative finite seconds, or none."""
    q = doc.get(key)
    return seconds_levels(q, key) if q else ()


def _per_role(doc, key: str, ok, want: str, name=lambda role: role) -> dict:
    """`doc[key]` checked: an object of role -> numbers, each role's `name` one of step_samples.ROLES
    and its numbers `ok`; else one ValueError naming the key, the role and what it `want`s."""
    if not isinstance(doc, dict):
        raise ValueError(f"{key}: an object of roles")
    out = {}
    for role, v in doc.items():
        v = tuple(float(x) for x in v)
        if name(role) not in ROLES or not ok(v):
            raise ValueError(f"{key}[{role!r}]: {want}")
        out[role] = v
    return out


def _contention(doc: dict) -> dict:
    """`step_contention` checked: per role prefill, decode or colocated, [a, b], a > 0, b >= 0."""
    return _per_role(doc, "step_contention",
                     lambda ab: len(ab) == 2 and ab[0] > 0 and ab[1] >= 0 and all(math.isfinite(x) for x in ab),
                     "[a, b] with a > 0 and b >= 0, of a role prefill, decode or colocated")


def _spread(doc: dict) -> dict:
    """`step_spread_quantiles` checked: per role, len(OVERHEAD_QS) non-decreasing positive finite ratios."""
    return _per_role(doc, "step_spread_quantiles",
                     lambda q: len(q) == len(OVERHEAD_QS) and q[0] > 0 and all(math.isfinite(x) for x in q)
                     and not any(b < a for a, b in zip(q, q[1:])),
                     f"{len(OVERHEAD_QS)} non-decreasing positive ratios of a role prefill, decode or colocated "
                     "(or ROLE@busy)", name=lambda role: role.removesuffix(neighbours.BESIDE))
