"""The hand-off state machine (bound, sending, held, moved, delivered, failed), applied by the
prefill node and the router.

The hand-off of a request's KV from a prefill node to a decode node: one state machine,
applied by the prefill node (which moves the KV) and the router (which follows from notices).

    BOUND ──send──▶ SENDING ──landed──▶ DELIVERED            (final: the decode node holds it)
      ▲               │ deferred (no_pages)
      │               ▼
      │             HELD ──send──▶ SENDING                   (backpressure: pages kept, retried)
      │
    MOVED ◀──move── BOUND | SENDING | HELD | MOVED            (rebound to a fallback decode node)
      └──send──▶ SENDING
    any state but DELIVERED ──fail──▶ FAILED                 (final: no decode node can take it)

The router sees only BOUND (at dispatch), MOVED (a HandoffNotice naming another node),
DELIVERED (a notice with `delivered`, or the decode node's own HoldNotice or output) and
FAILED; the prefill node goes through all of them. A transition not in the table is refused
(`IllegalTransition`): a move after delivery, a second delivery elsewhere.
"""
from __future__ import annotations

import enum


class HandoffState(enum.Enum):
    BOUND = "bound"  # a decode node is chosen; no transfer in flight
    SENDING = "sending"  # a transfer to the bound node is in flight
    HELD = "held"  # the bound node deferred it (no pages): the prefill node keeps the pages, retries
    MOVED = "moved"  # rebound to another decode node (a fallback); no transfer in flight
    DELIVERED = "delivered"  # the KV landed: the decode node holds the request (final)
    FAILED = "failed"  # no decode node could take it (final)

    @property
    def final(self) -> bool:
        return self in (HandoffState.DELIVERED, HandoffState.FAILED)


class HandoffEvent(enum.Enum):
    SEND = "send"  # a transfer starts to the bound node
    DEFERRED = "deferred"  # the bound node answered no_pages
    MOVE = "move"  # another decode node takes the turn
    LANDED = "landed"  # the KV is committed at the decode node (or it sent output)
    FAIL = "fail"


class IllegalTransition(ValueError):
    def __init__(self, state: HandoffState, event: HandoffEvent) -> None:
        super().__init__(f"hand-off in state {state.value} cannot take event {event.value}")
        self.state, self.event = state, event


S, E = HandoffState, HandoffEvent
TRANSITIONS: dict[tuple[HandoffState, HandoffEvent], HandoffState] = {
    (S.BOUND, E.SEND): S.SENDING, (S.MOVED, E.SEND): S.SENDING, (S.HELD, E.SEND): S.SENDING,
    (S.SENDING, E.DEFERRED): S.HELD,
    **{(s, E.MOVE): S.MOVED for s in (S.BOUND, S.SENDING, S.HELD, S.MOVED)},
    # The router learns of a landing without seeing the transfer, and a decode node may adopt KV
    # whose sender had given up (its ACK lost): a landing is accepted from any state but a final one.
    **{(s, E.LANDED): S.DELIVERED for s in (S.BOUND, S.SENDING, S.HELD, S.MOVED)},
    **{(s, E.FAIL): S.FAILED for s in (S.BOUND, S.SENDING, S.HELD, S.MOVED)},
}


def advance(state: HandoffState, event: HandoffEvent) -> HandoffState:
    """The state after `event`; IllegalTransition when the table has no such move."""
    new = TRANSITIONS.get((state, event))
    if new is None:
        raise IllegalTransition(state, event)
    return new
