"""Prefill-side admission order: arrival order, but a prompt that does not fit the pool does
not block the ones behind it. The prefill pool also holds pages of requests the decode side
deferred (backpressure), so a strict FIFO would let one held whale stall every new prompt.
The decode-side policy under comparison is unaffected: this order is the same for all."""
from __future__ import annotations

from fairness.base import BasePolicy


class PrefillOrder(BasePolicy):
    name = "prefill-fifo"
    strict_order = False
