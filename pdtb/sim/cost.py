"""The seam between the simulator and its cost models: what a step carries (`StepShape`) and
what it costs, what a KV transfer and a tier move cost. Everything else in a simulated run is
the real code; only these numbers are modelled.

Two models implement `CostModel`: `roofline.RooflineCost` (a named accelerator and a model
shape read from config.json) and `calibrate.CalibratedCost` (fitted from `pdtb bench steps`
measurements on the machine at hand).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pdtb.shapes.accelerators import LinkModel  # noqa: F401 (the cost models' links)


@dataclass(frozen=True)
class StepShape:
    """What one engine step carries (the scheduler's output, reduced to what costs time)."""

    decode_rows: int = 0  # rows feeding one token each (decoding)
    decode_ctx: int = 0  # context tokens those rows read, summed (KV read by their attention)
    prefill_chunks: int = 0  # prefill (or recompute) chunks
    prefill_tokens: int = 0  # tokens those chunks feed, summed
    prefill_attn: int = 0  # query-key pairs of the chunks' attention: sum of n * (offset + (n + 1) / 2)

    @property
    def tokens(self) -> int:
        """Tokens through the model's dense layers this step."""
        return self.decode_rows + self.prefill_tokens

    @classmethod
    def of(cls, chunks) -> "StepShape":
        """The shape of a scheduled step (a list of `ScheduledChunk`, before the engine advances
        the sequences). A chunk of one token past the prompt is a decode row; any other is prefill."""
        rows = ctx = nch = ntok = attn = 0
        for c in chunks:
            start, n = c.seq.num_computed_tokens, c.num_new_tokens
            if n == 1 and start >= c.seq.num_prompt_tokens:
                rows += 1
                ctx += start + 1
            else:
                nch += 1
                ntok += n
                attn += n * start + n * (n + 1) // 2
        return cls(rows, ctx, nch, ntok, attn)


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
