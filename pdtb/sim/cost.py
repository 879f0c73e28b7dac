"""The seam between the simulator and its cost models: what a step carries (`StepShape`) and
what it costs, what a KV transfer and a tier move cost. Everything else in a simulated run is
the real code; only these numbers are modelled.

Two models implement `CostModel`: `roofline.RooflineCost` (a named accelerator and a model
shape read from config.json) and `calibration.record.Calibration` (fitted from `pdtb bench steps`
measurements on the machine at hand).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdtb.engine.step_shape import StepShape  # noqa: F401 (what the cost models price)
from pdtb.shapes.accelerators import LinkModel  # noqa: F401 (the cost models' links)


class CostModel(Protocol):
    name: str
    page_bytes: int  # bytes of one KV page (all layers, K and V) in the modelled deployment

    def step_s(self, shape: StepShape) -> float:
        """Seconds one engine step of this shape takes (forward pass plus the node's per-step work)."""

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move `nbytes` of KV from a prefill node to a decode node (one transfer,
        latency included), with the link to itself."""

    def tier_move_s(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` between the device tier and the host tier."""


@dataclass(frozen=True)
class FixedStepCost:
    """Every step takes `step_s` whatever it carries (the synthetic setting of the scheduling
    papers: one step is one unit of time); transfers and tier moves over the given links."""

    step_seconds: float = 1.0
    page_bytes: int = 1
    link: LinkModel = LinkModel(1e12)
    host_link: LinkModel = LinkModel(1e12)
    name: str = "fixed"

    def step_s(self, shape: StepShape) -> float:
        return self.step_seconds

    def transfer_s(self, nbytes: int) -> float:
        return self.link.seconds(nbytes)

    def tier_move_s(self, nbytes: int) -> float:
        return self.host_link.seconds(nbytes)
