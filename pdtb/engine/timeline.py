"""`Timeline`: a request's stamps, open waits and accumulated waits (typed; travels in the
hand-off).

A request's timeline: wall-clock stamps (time.time()) set by whoever handles it, open
waits, and accumulated waits. It travels with the KV hand-off (protocol.HandoffMeta) and
ends in the final event's `pdtb_timing`; fairness.attribution breaks it into SLO causes.

    router_arrival -> prefill_queued -> prefill_start -> first_token -> transfer_start
        -> transfer_end -> decode_admit -> last_token

Waits (`<name>_since` while open, `<name>_s` accumulated): held (the prefill node keeps the
pages: the decode side deferred), parked (pages in the host tier), preempted (waiting for
recompute), turn_wait (resident but not served this step), migrating (paused while its KV moves
to another decode node: from the source's last step to the target's first token). A preemption before the first token
accumulates into recompute_ttft_s instead, and a demotion before it into parked_ttft_s: they are part of the TTFT.

A request the router recomputed after losing a node (pdtb/router/completions.py) arrives again
with `earlier`: what its lost attempts took, measured by the router from the request's first
arrival. Its stamps are this attempt's; fairness.attribution adds `earlier` to its TTFT and TPOT.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

STAMPS = ("router_arrival", "prefill_queued", "prefill_start", "first_token", "transfer_start", "transfer_end",
          "decode_admit", "last_token")
WAITS = ("held", "parked", "preempted", "turn_wait", "migrating")


@dataclass
class Earlier:
    """The attempts a node loss ended, seconds after the request first arrived at the router."""

    lost_s: float  # until this attempt was sent: the lost attempts, the loss found, the new submission
    tokens: int = 0  # tokens streamed before this attempt
    first_token_s: float = -1.0  # its first token, when it came before this attempt (-1: none came)
    last_token_s: float = -1.0  # the last token before this attempt (-1: none came)

    def valid(self) -> bool:
        """Figures a router could have measured: finite, in order, tokens with their times."""
        f, l = self.first_token_s, self.last_token_s
        if not all(math.isfinite(x) for x in (self.lost_s, f, l)) or self.lost_s < 0 or self.tokens < 0:
            return False
        if self.tokens == 0:
            return f == l == -1.0
        return 0 <= f <= l <= self.lost_s


@dataclass
class Timeline:
    router_arrival: float | None = None  # the router received the request
    prefill_queued: float | None = None  # the entry node queued it
    prefill_start: float | None = None  # its first prefill chunk ran
    first_token: float | None = None  # its first token was sampled
    transfer_start: float | None = None  # its KV hand-off began (disaggregated)
    transfer_end: float | None = None  # its KV landed at the decode node
    decode_admit: float | None = None  # the decode side took it in
    last_token: float | None = None  # its latest token was sampled
    held_since: float | None = None
    parked_since: float | None = None
    preempted_since: float | None = None
    turn_wait_since: float | None = None
    migrating_since: float | None = None
    held_s: float = 0.0
    parked_s: float = 0.0
    preempted_s: float = 0.0
    turn_wait_s: float = 0.0
    migrating_s: float = 0.0
    recompute_ttft_s: float = 0.0  # preempted before the first token, waiting for recompute
    parked_ttft_s: float = 0.0  # demoted before the first token (mid-prefill), waiting in the host tier
    num_preemptions: int = 0
    earlier: Earlier | None = None  # a recomputed request's lost attempts (see the module doc)

    def stamp_once(self, name: str, t: float) -> None:
        """Set stamp `name` unless it is set already (a chunk after the first, a retry)."""
        if getattr(self, name) is None:
            setattr(self, name, t)

    def start_wait(self, wait: str, now: float) -> None:
        """Open wait `wait` at `now` unless it is open already."""
        self.stamp_once(f"{wait}_since", now)

    def end_wait(self, wait: str, now: float, into: str | None = None) -> None:
        """Close wait `wait` if open: the time since it opened is added to `<wait>_s` (or to
        the accumulator `into`)."""
        since = getattr(self, f"{wait}_since")
        if since is not None:
            into = into or f"{wait}_s"
            setattr(self, into, getattr(self, into) + now - since)
            setattr(self, f"{wait}_since", None)

    @property
    def arrival(self) -> float | None:
        """When the request arrived: at the router, or (without one) at the entry node."""
        return self.router_arrival if self.router_arrival is not None else self.prefill_queued

    def span(self, a: str, b: str) -> float | None:
        """Seconds from stamp `a` to stamp `b`, or None if either is unset."""
        ta, tb = getattr(self, a), getattr(self, b)
        return None if ta is None or tb is None else tb - ta

    def to_dict(self) -> dict[str, float]:
        """The stamps and waits that are set (unset stamps and zero accumulators left out)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or (v == 0 and (f.name.endswith("_s") or f.name == "num_preemptions")):
                continue
            out[f.name] = dataclasses.asdict(v) if f.name == "earlier" else v
        return out
