"""`Calibration`: the simulator's cost model fitted on the machine at hand, one versioned record.

    step s = coef.ms(shape) / 1000 + node_overhead_s      (an empty step costs nothing)
    hand-off s = bytes / transfer.bytes_per_s + transfer.latency_s; a tier move over `tier` alike

It records what it was measured on (the machine, its accelerator and the versions of torch,
transformers and pyzmq; the model, dtype and threads) and the command that makes it again; the
simulator prints that line (`describe`) to stderr and into `meta.cost_info`. Its file, written by
`pdtb sim calibrate --out` and read by `Calibration.load` (a path, or the name of one shipped in
pdtb/sim/calibrations):

    {"kind": "step-calibration", "version": 2, "label", "machine", "command", "note", "device",
     "model", "threads", "dtype", "page_size", "page_bytes", "coef_ms": {"c0", "rows", "ctx",
     "chunks", "tokens", "attn"}, "node_overhead_s", "transfer": {"bytes_per_s", "latency_s"},
     "tier_move": {...}, "path" (the request path's latencies: path.py), "router" ({"request_s",
     "token_s", "measured_by"}: the routers' CPU work), "fit": {"samples", "r2", "max_rel_err",
     "sources"}}

A version 1 file reads the same unless it holds a quantity this simulator does not model (drawn
step spreads, hand-off or delivery draws, contention, landing work): the kept ones were measured
to change the held-out figures by more than the testbed's own repeat noise, the others not
(docs/sim.md, "What the calibration holds").
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdtb.sim.calibration.fit import TERMS, Coefficients
from pdtb.sim.calibration.samples import SampleError
from pdtb.sim.cost import LinkModel, StepShape

VERSION = 2
SHIPPED = Path(__file__).resolve().parent.parent / "calibrations"
# This machine's byte-moving figures (2 cores, no GPU). A hand-off: `pdtb bench transport
# --endpoint tcp` moves a large request's KV at 2.42 GB/s and 7,148 one-page requests/s (140 us
# each; docs/results.md). A tier move: PagePool.copy_pages_to between two CPU pools of the tiny
# model's 32 KiB pages, one thread, took 40-65 us for one page and 2.0-3.0 GB/s for 16 to 256.
CPU_TRANSFER = LinkModel(2.42e9, 140e-6)
CPU_TIER = LinkModel(2.5e9, 50e-6)
NOT_MODELLED = {"step_spread_quantiles": "--draw-step-spread", "handoff_latency_quantiles_s": "--draw-handoff",
                "node_overhead_quantiles_s": "--draw-loop-gaps", "step_contention": "--contention",
                "land_s": "--results with --step-log (landing work)"}
SOURCE_KEYS = ("command", "note", "device", "model", "threads", "dtype", "page_size")


@dataclass(frozen=True)
class Calibration:
    """A fitted step cost, a node's own work per step, two links and the request path: the
    CostModel of `pdtb sim --cost calibrated`, with where it was measured."""

    coef: Coefficients
    page_bytes: int  # one KV page of the measured model (all layers, K and V)
    transfer: LinkModel = CPU_TRANSFER  # prefill -> decode hand-off
    tier: LinkModel = CPU_TIER  # device <-> host tier copies
    node_overhead_s: float = 0.0  # the node's own work per step, between steps
    label: str = "calibrated"
    machine: dict = field(default_factory=dict, compare=False, hash=False)  # accelerator, cpu, cores, versions
    source: dict = field(default_factory=dict, compare=False, hash=False)  # SOURCE_KEYS' values
    fit: dict = field(default_factory=dict, compare=False, hash=False)  # samples, r2, max_rel_err, sources
    path: dict | None = field(default=None, compare=False, hash=False)  # path.fit_path's, with its files
    router: dict | None = field(default=None, compare=False, hash=False)
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.page_bytes < 1 or not self.node_overhead_s >= 0:
            raise ValueError("page_bytes must be positive, node_overhead_s non-negative")

    @property
    def name(self) -> str:
        return f"calibrated:{self.label}"

    def describe(self) -> str:
        """Which calibration this is: what it was measured on, the fit, the machine and versions."""
        s, m = self.source, self.machine
        model = str(s.get("model", "?")).rstrip("/").rsplit("/", 1)[-1]
        host = ", ".join(x for x in (m.get("accelerator") or m.get("cpu") or "CPU",
                                     f"{m['cores']} cores" if m.get("cores") else "") if x)
        where = f"{host}; " + ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v) if m else \
            "machine and versions not recorded in the file"
        return (f"calibration {self.label} (v{self.version}): {model} {s.get('dtype', '?')} on "
                f"{s.get('device', '?')}, {s.get('threads', '?')} thread(s); fit of {self.fit.get('samples', '?')} "
                f"steps, R^2 {self.fit.get('r2', '?')}; {where}")

    def step_s(self, shape: StepShape) -> float:
        return self.coef.ms(shape) / 1e3 + self.node_overhead_s if shape.tokens else 0.0

    def transfer_s(self, nbytes: int) -> float:
        return self.transfer.seconds(nbytes)

    def tier_move_s(self, nbytes: int) -> float:
        return self.tier.seconds(nbytes)

    def to_json(self) -> dict:
        """The calibration file's object (see the module docstring)."""
        return {"kind": "step-calibration", "version": VERSION, "label": self.label, "machine": self.machine,
                **self.source, "page_bytes": self.page_bytes, "coef_ms": asdict(self.coef),
                "node_overhead_s": self.node_overhead_s, "transfer": asdict(self.transfer),
                "tier_move": asdict(self.tier), **({"path": self.path} if self.path else {}),
                **({"router": self.router} if self.router else {}), "fit": self.fit}

    @classmethod
    def from_json(cls, doc: dict, where: str = "calibration") -> "Calibration":
        if not isinstance(doc, dict) or doc.get("kind") != "step-calibration":
            raise SampleError(f"{where}: not a step-calibration file (write one with pdtb sim calibrate)")
        if doc.get("version") not in (1, VERSION):
            raise SampleError(f"{where}: calibration version {doc.get('version')!r}; this pdtb reads 1 and {VERSION}")
        path = doc.get("path") or None
        dropped = [k for k in NOT_MODELLED if doc.get(k)] + (["path.delivery"] if (path or {}).get("delivery") else [])
        if dropped:
            flags = ", ".join(NOT_MODELLED.get(k, "--draw-delivery") for k in dropped)
            raise SampleError(f"{where}: holds {', '.join(dropped)}, which the simulator does not model (they did "
                              f"not beat the testbed's repeat noise: docs/sim.md); calibrate again without {flags}")
        try:
            return cls(Coefficients(**{k: float(doc["coef_ms"][k]) for k in TERMS}), int(doc["page_bytes"]),
                       LinkModel(**doc["transfer"]), LinkModel(**doc["tier_move"]),
                       float(doc.get("node_overhead_s", 0.0)), str(doc.get("label", Path(where).stem)),
                       dict(doc.get("machine") or {}), {k: doc[k] for k in SOURCE_KEYS if k in doc},
                       dict(doc.get("fit") or {}), path, doc.get("router") or None, int(doc["version"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SampleError(f"{where}: bad calibration ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """A calibration file by path, or by the name of one shipped in pdtb/sim/calibrations."""
        p = Path(path)
        if not p.is_file() and (SHIPPED / f"{path}.json").is_file():
            p = SHIPPED / f"{path}.json"
        try:
            doc = json.loads(p.read_text())
        except OSError as e:
            raise SampleError(f"{path}: {e.strerror or e}") from None
        except ValueError:
            raise SampleError(f"{path}: not JSON") from None
        return cls.from_json(doc, str(p))
