"""A prefill node's hand-off of one request's KV, and what happens when a transfer ends: the
rules shared by the prefill node and the simulator (pdtb/sim).

    landed                                    -> LANDED (pages freed by the caller)
    no_pages, before the hold deadline        -> HELD: retried, at the next decode node of the
                                                 request's list if it has one; after every node
                                                 refused in turn, with exponential backoff
    any other failure, a fallback left, before
    the deadline, not bad_metadata            -> MOVED to the next decode node at once
    otherwise                                 -> FAILED
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kv_transport.fail_codes import FailCode
from pdtb.engine.sequence import Sequence
from pdtb.nodes.handoff import HandoffEvent, HandoffState, advance
from pdtb.nodes.protocol import GenerateRequest, Target

# Backoff bounds for a hand-off the decode side refused for lack of pages. The decode node does
# not say when pages free up, so the cap is how long its pool may sit idle with hand-offs held
# here (0.5 s left it idle a third of the time under backpressure; a retry is one header).
RETRY_S = (0.01, 0.1)


@dataclass
class Handoff:
    """One request's KV on its way to a decode node (states: pdtb/nodes/handoff.py)."""

    seq: Sequence
    req: GenerateRequest
    targets: list[Target]  # the decode node it is bound to first, then its fallbacks
    state: HandoffState = HandoffState.BOUND
    transfer_id: str | None = None
    deadline: float = 0.0  # monotonic: give up holding after this
    retry_at: float = 0.0  # monotonic: next attempt
    backoff: float = RETRY_S[0]
    attempts: int = 0
    refusals: int = 0  # "no_pages" refusals since the last backoff (one per target, then back off)
    skip_pages: int = 0  # leading pages the current transfer leaves out (the decode node caches them)
    no_skip: bool = False  # a decode node lacked pages it was thought to cache: send every page

    def on(self, event: HandoffEvent) -> None:
        self.state = advance(self.state, event)

    def retarget(self) -> None:
        self.req.decode_node, self.req.decode_kv_addr = self.targets[0].node_id, self.targets[0].kv_addr


class Outcome(enum.Enum):
    LANDED = "landed"  # the decode node has the KV
    HELD = "held"  # deferred for lack of pages: retried at `retry_at` (maybe at another node)
    MOVED = "moved"  # that node cannot take it: the next target, at once
    FAILED = "failed"  # nowhere left to go


def transfer_ended(h: Handoff, landed: bool, code: FailCode | None, mono: float) -> Outcome:
    """Apply the end of `h`'s transfer (landed, or failed with `code`) at monotonic time `mono`.
    Updates the hand-off's state, targets and retry time; HELD and MOVED leave `transfer_id`
    None so that the caller starts the next attempt at `retry_at`. A MOVED or rotated HELD
    hand-off is retargeted (`h.req` names its new decode node)."""
    if landed:
        h.on(HandoffEvent.LANDED)
        return Outcome.LANDED
    if code is FailCode.CACHE_MISS and mono < h.deadline:  # resend at once, every page
        h.on(HandoffEvent.DEFERRED)
        h.transfer_id, h.retry_at, h.no_skip = None, mono, True
        return Outcome.HELD
    if code is FailCode.NO_PAGES and mono < h.deadline:
        h.on(HandoffEvent.DEFERRED)
        h.transfer_id, h.retry_at = None, mono
        h.refusals += 1
        if h.refusals >= len(h.targets):  # every node refused in turn: back off
            h.refusals, h.retry_at = 0, mono + h.backoff
            h.backoff = min(h.backoff * 2, RETRY_S[1])
        if len(h.targets) > 1:
            h.targets.append(h.targets.pop(0))
            h.on(HandoffEvent.MOVE)
            h.retarget()
        return Outcome.HELD
    if len(h.targets) > 1 and mono < h.deadline and code is not FailCode.BAD_METADATA:
        h.targets.pop(0)  # that node cannot take it (draining, too small, unreachable)
        h.transfer_id, h.retry_at = None, mono
        h.on(HandoffEvent.MOVE)
        h.retarget()
        return Outcome.MOVED
    h.on(HandoffEvent.FAIL)
    return Outcome.FAILED


def unbind(reqs: dict, node_id: str) -> list[str]:
    """Decode node `node_id` is down: requests not handed off yet that were bound to it move to
    their first other fallback, and none keeps it as a fallback. Returns the ids that moved."""
    moved = []
    for rid, req in reqs.items():
        others = [t for t in req.fallbacks if t.node_id != node_id]
        if req.decode_node == node_id and others:
            (req.decode_node, req.decode_kv_addr), others = (others[0].node_id, others[0].kv_addr), others[1:]
            moved.append(rid)
        req.fallbacks = others
    return moved


def lose_target(h: Handoff, node_id: str, mono: float) -> Outcome | None:
    """Decode node `node_id` is down: `h` drops it from its targets. None when it was not the
    current one (nothing more to do); MOVED to the next target at `mono`; FAILED with none left.
    A transfer in flight to it is the caller's to cancel first."""
    if not any(t.node_id == node_id for t in h.targets):
        return None
    current = h.targets[0].node_id == node_id
    h.targets = [t for t in h.targets if t.node_id != node_id]
    if not current:
        return None
    h.transfer_id = None
    if h.targets:
        h.retry_at = mono
        h.on(HandoffEvent.MOVE)
        h.retarget()
        return Outcome.MOVED
    h.on(HandoffEvent.FAIL)
    return Outcome.FAILED
