"""`NodeState` and `RequestHandle` (what the router holds per node and per request), the load rules
`pick_prefill`, `pick_most_free`, `load_order`, `RequestFailed`.

What the router holds per node and per request: NodeState (a node's last stats, what was sent
to it since, its connection), RequestHandle (one request's nodes, hand-off state and queue), the
load rules that pick among NodeStates (pick_prefill, pick_most_free, load_order: the simulator's
router; the router places by pdtb/router/placement.py's snapshot) and RequestFailed."""
from __future__ import annotations

from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdtb.nodes.handoff import HandoffState
from pdtb.nodes.protocol import NodeStats, TokenEvent
from pdtb.router.cache_route import PrefixView
from pdtb.router.config import NodeSpec
from pdtb.router.event_queue import EventQueue
from pdtb.router.migration import Migration


class RequestFailed(Exception):
    """A request ended without a result: `status` is the HTTP status it maps to."""

    def __init__(self, status: int, message: str, node_lost: bool = False, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.node_lost = node_lost  # a node it depended on is gone: recomputing it elsewhere may succeed
        self.param = param  # a 400's request field at fault ("prompt", "max_tokens")


@dataclass(eq=False)
class NodeState:
    """What the router knows about one node."""

    spec: NodeSpec
    socket: zmq.asyncio.Socket | None = field(default=None, repr=False)
    stats: NodeStats | None = None  # latest answer to a ping
    last_seen: float | None = None  # monotonic time of `stats`
    pending_pages: dict[str, int] = field(default_factory=dict)  # request id -> pages sent, not yet in stats
    # prefill or colocated node: request id -> prompt tokens sent since its last stats report
    # (reports are up to 0.5 s old: without these, every request of that window went to one node)
    pending_tokens: dict[str, int] = field(default_factory=dict)
    refused_at: float | None = None  # monotonic time a request could not be sent to it (queue full: likely dead)
    connected: bool = False  # the DEALER's connection stands (socket monitor events)
    dropped_at: float | None = None  # monotonic time its connection last dropped
    monitor: zmq.asyncio.Socket | None = field(default=None, repr=False)
    prefix_view: PrefixView = field(default_factory=PrefixView, repr=False)  # route "cache": pages it may hold
    drain_sent: bool = False  # this router told it to drain (it counts as draining before its next report)
    lost: bool = False  # judged down by the health loop, and not heard from since (that judgement comes once)
    retired: bool = False  # a replacement took its place (POST /admin/nodes "replaces"): not waited for by /health

    @property
    def node_id(self) -> str:
        return self.stats.node_id if self.stats else self.spec.address

    def healthy(self, now: float, timeout: float, hang_timeout: float | None = None) -> bool:
        """Answered within `timeout`, or (with `hang_timeout`) within that while connected."""
        if self.last_seen is None:
            return False
        silent = now - self.last_seen
        # the connection vouches for a silent node only if it has not dropped since its last
        # answer: a node restarted on the same port reconnects at once, but its stats (its KV
        # address) are the dead one's until it answers
        steady = self.connected and (self.dropped_at is None or self.dropped_at < self.last_seen)
        return silent <= timeout or (hang_timeout is not None and steady and silent <= hang_timeout)

    def free_pages_estimate(self) -> int:
        return (self.stats.pages_free if self.stats else 0) - sum(self.pending_pages.values())

    def queued_tokens_estimate(self) -> int:
        """Prompt tokens waiting at the node: its last report plus those sent since."""
        return (self.stats.queued_tokens if self.stats else 0) + sum(self.pending_tokens.values())


def load_order(n: NodeState) -> tuple:
    """A prefill or colocated node's place in the load rule's order, lower first: pick_prefill's
    key for a prefill node, pick_most_free's for a colocated one."""
    if n.spec.role == "prefill":
        return (n.queued_tokens_estimate(), n.stats.running + n.stats.waiting)
    return (-n.free_pages_estimate(),)


def pick_prefill(nodes: list[NodeState]) -> NodeState | None:
    """Fewest queued prompt tokens (reported, plus sent since); tie: fewest running + waiting."""
    return min(nodes, key=load_order, default=None)


def pick_most_free(nodes: list[NodeState]) -> NodeState | None:
    """Most free pages after subtracting pages recently sent there."""
    return max(nodes, key=lambda n: n.free_pages_estimate(), default=None)


@dataclass(eq=False)
class RequestHandle:
    """One in-flight request as the registry tracks it."""

    request_id: str
    entry: NodeState  # the node that got the GenerateRequest (prefill or colocated)
    decode: NodeState | None  # disaggregated: the chosen decode node
    queue: EventQueue = field(default_factory=EventQueue)
    entry_started: bool = False  # the entry node has sent its first event
    handoff: HandoffState | None = None  # disaggregated: where the hand-off stands (pdtb/nodes/handoff.py)
    held: list[TokenEvent] = field(default_factory=list)  # decode events that overtook the first token
    fallbacks: list[str] = field(default_factory=list)  # decode node ids that may hold it: the chosen one and its fallbacks
    prefix_overlap_tokens: int = 0  # route "cache": prompt tokens the entry node was believed to hold cached
    tenant: str = ""  # route "d2lpm": the client its entry node's credit is charged to
    tokens: int = 0  # output tokens put on the queue
    migration: Migration | None = None  # a live migration under way, or whose source's last tokens are due

    @property
    def handed_off(self) -> bool:
        """The decode node holds it: the prefill node is no longer needed."""
        return self.handoff is HandoffState.DELIVERED

    def put(self, event: TokenEvent) -> None:
        """`event` to the request's caller, its tokens counted."""
        self.tokens += len(event.token_ids)
        self.queue.put_nowait(event)

    def depends_on(self) -> list[NodeState]:
        if self.decode is None:
            return [self.entry]
        return [self.decode] if self.handed_off else [self.entry, self.decode]
