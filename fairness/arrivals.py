"""The inherited requests a decode node's policy is offered: those deferred to the prefill side
(`held`), those placed on the device tier and not yet adopted (`incoming`), and the idle-pool
rule of placement.
"""
from __future__ import annotations

from fairness.interface import Arrival, Placement
from pdtb.engine.sched_policy import SchedState

HELD_TTL_S = 5.0  # a deferred arrival not retried within this long is forgotten
# A deferred arrival keeps its place in line (later arrivals wait behind it) only while it is
# retried here: the prefill side retries a refused hand-off within 0.1 s, at this node or, with
# fallbacks, at the next one, where it may be taken. One that landed elsewhere must not make this
# node defer every later arrival (each of which then lands elsewhere too, leaving this node idle).
HELD_ORDER_S = 1.0


class ArrivalBook:
    """`held` and `incoming`, by request id (dicts kept in place: policies read them)."""

    def __init__(self) -> None:
        self.held: dict[str, Arrival] = {}  # deferred to the prefill side
        self.incoming: dict[str, Arrival] = {}  # placed on the device tier, pages RESERVED, not yet adopted

    def adopted(self, running: list, candidates: list, state: SchedState) -> None:
        """Drop the incoming arrivals now running or parked, or failed (their pages gone)."""
        if self.incoming:
            known = {s.request_id for s in running} | {s.request_id for s in candidates}
            for rid in [r for r in self.incoming if r in known or r not in state.pages]:
                del self.incoming[rid]

    def live(self, state: SchedState) -> list[Arrival]:
        """Deferred arrivals still being retried (expired ones are dropped)."""
        for rid in [r for r, h in self.held.items() if state.now - h.last_seen > HELD_TTL_S]:
            del self.held[rid]
        return list(self.held.values())

    def fresh(self, state: SchedState) -> list[Arrival]:
        """Deferred arrivals retried here within HELD_ORDER_S: those later arrivals queue behind."""
        return [h for h in self.live(state) if state.now - h.last_seen <= HELD_ORDER_S]

    def incoming_pages(self, owner, state: SchedState) -> dict[str, int]:
        """Device pages reserved per quota owner (`owner(arrival)`) for arrivals placed there but
        not yet adopted: they are the owner's as surely as its running requests' pages."""
        out: dict[str, int] = {}
        for rid, a in self.incoming.items():
            o = owner(a)
            out[o] = out.get(o, 0) + max(state.pages.get(rid, 0), a.num_pages)
        return out

    def offered(self, arrival: Arrival) -> None:
        """A retry keeps its place in line."""
        prev = self.held.get(arrival.request_id)
        if prev is not None:
            arrival.first_seen = prev.first_seen

    def idle_takes(self, arrival: Arrival, queued: int, busy: bool, state: SchedState) -> bool:
        """Work conservation, as in admission: an idle pool (`busy` False, nothing queued or
        incoming) takes the oldest arrival that fits whatever the quotas say (otherwise held
        arrivals each above their share refuse each other's borrowing on an empty pool, forever)."""
        rid = arrival.request_id
        others = [h for h in self.fresh(state) if h.request_id != rid]  # (read first: it drops expired ones)
        if queued or busy or any(r != rid for r in self.incoming) or arrival.num_pages > state.device_free:
            return False
        return not any(h.first_seen < arrival.first_seen for h in others)

    def placed(self, arrival: Arrival, where: Placement) -> None:
        if where is Placement.DEVICE:
            self.held.pop(arrival.request_id, None)
            self.incoming[arrival.request_id] = arrival  # its reserved pages count for its quota owner
        else:
            self.held[arrival.request_id] = arrival


def park_or_defer(arrival: Arrival, state: SchedState) -> Placement:
    """HOST if the host tier has room for the arrival, else DEFER."""
    return Placement.HOST if arrival.num_pages <= state.host_free else Placement.DEFER
