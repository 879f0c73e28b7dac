"""Fault injection on outgoing messages, shared by the fake and the real backends.

A transport asks `FaultInjector.decide(kind)` before each send and then applies the decision
with `mangle()` (corrupt/truncate need a private copy of the bytes: the originals may be a
caller's tensor). Drop, delay, duplicate and disconnect are carried out by the transport.
"""
from __future__ import annotations

import enum
import logging
import random

from kv_transport.config import FaultConfig
from kv_transport.wire_check import frame_view

log = logging.getLogger(__name__)


class Fault(enum.Enum):
    DROP = "drop"
    DELAY = "delay"
    DUPLICATE = "duplicate"
    CORRUPT = "corrupt"
    TRUNCATE = "truncate"
    DISCONNECT = "disconnect"


class FaultInjector:
    """Seeded decisions; one per outgoing message. A no-op when the config has no faults."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)  # decisions: the n-th message's fault depends on n alone
        self._mangle_rng = random.Random(config.seed + 1)  # where to corrupt: apart, so frame sizes never shift decisions
        self._chunks = 0
        self._disconnected = False
        self.injected: list[tuple[str, Fault]] = []  # (message kind, fault), for tests and logs

    def _budget_left(self) -> bool:
        cap = self.config.max_faults
        return cap is None or sum(f is not Fault.DISCONNECT for _, f in self.injected) < cap

    def decide(self, kind: str) -> Fault | None:
        """The fault to apply to the next message of `kind`, or None."""
        c = self.config
        if not c.enabled or kind not in c.kinds:
            return None
        # The disconnect is scheduled, not drawn: it happens once, at its chunk, whatever the
        # random faults before it used of `max_faults` (which caps the random ones only).
        if kind == "chunk" and c.disconnect_after_chunks is not None and not self._disconnected:
            if self._chunks >= c.disconnect_after_chunks:
                self._disconnected = True
                return self._record(kind, Fault.DISCONNECT)
            self._chunks += 1
        if not self._budget_left():
            return None
        for fault, p in ((Fault.DROP, c.drop_prob), (Fault.DELAY, c.delay_prob),
                         (Fault.DUPLICATE, c.duplicate_prob), (Fault.CORRUPT, c.corrupt_prob),
                         (Fault.TRUNCATE, c.truncate_prob)):
            if p > 0 and self._rng.random() < p:
                return self._record(kind, fault)
        return None

    def _record(self, kind: str, fault: Fault) -> Fault:
        self.injected.append((kind, fault))
        log.info("fault injection: %s on a %s message", fault.value, kind)
        return fault

    def mangle(self, fault: Fault, frames: list) -> list:
        """Frames with a private, damaged copy of the last frame (CORRUPT/TRUNCATE)."""
        out = list(frames)
        last = bytearray(frame_view(out[-1]))
        if fault is Fault.CORRUPT and last:
            i = self._mangle_rng.randrange(len(last))
            last[i] ^= 0xFF
        elif fault is Fault.TRUNCATE:
            last = last[: len(last) // 2]
        out[-1] = bytes(last)
        return out
