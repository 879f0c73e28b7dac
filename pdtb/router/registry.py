"""`NodeRegistry`: the router's nodes and open requests, one facade over the parts that own them.

    NodeSet        node_set.py        connections, pings and health, frames read, node state, sends
    place()        placement.py       where a request goes: a pure function of a snapshot of the nodes
    Dispatcher     dispatch.py        the open requests: placed, sent, their events, abort, release
    Follower       following.py       hand-offs, adoptions, live migrations, lost nodes
    RebalanceLoop  rebalance_loop.py  each second, the rebalancer's moves (pdtb/router/rebalance.py)

    NodeSet ──TokenBatch, node lost──▶ Follower ──events──▶ the request's EventQueue
    Dispatcher ──NodeSet.snapshot()──▶ place() ──Placement──▶ Dispatcher ──GenerateRequest──▶ NodeSet.send

Each part holds the parts it uses, given to its constructor: Dispatcher and Follower the
NodeSet, Follower the Dispatcher's table of open requests and the MigrationBook, RebalanceLoop
the NodeSet, the Follower and the Rebalancer.

Fallbacks: with the chosen decode node the router names up to FALLBACKS (placement.py) other
decode nodes that fit the request; the prefill node moves the hand-off to one of them when the
chosen one cannot take it and says so with a HandoffNotice, and says `delivered` once the KV has
landed.
A decode node that sends events for a request not yet handed off holds it (it adopted the KV,
maybe from a transfer its sender had given up on): it becomes the request's decode node, and
the prefill node is told to drop its hand-off. Once the request is handed off, any other decode
node that sends events for it is told to drop it. A decode node that stops answering fails the
requests handed (or delivered) to it, and those with no fallback left; the prefill nodes are
told (`NodeDown`) and move the others. An abort goes to the fallbacks too (a move may be under way).
Live migration (`migrate`, pdtb/router/migration.py): a handed-off request moves to another
decode node; its events come from the source until the token count the target's notice names,
then from the target. The rebalancer (`--rebalance`) decides moves from the decode nodes'
reports each second, and moves every request off a draining decode node.
Queues carry TokenEvent items, or a RequestFailed that `next_event` raises."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
from typing import Callable

from pdtb.nodes.protocol import GenerateRequest, TokenEvent
from pdtb.router.cache_route import ROUTES
from pdtb.router.config import NodeSpec
from pdtb.router.dispatch import Dispatcher
from pdtb.router.fair_route import D2lpmRouter
from pdtb.router.following import Follower
from pdtb.router.migration import Migration, MigrationBook
from pdtb.router.node_set import NodeSet
from pdtb.router.node_state import (NodeState, RequestFailed, RequestHandle, load_order,  # noqa: F401
                                    pick_most_free, pick_prefill)
from pdtb.router.rebalance import MODES as REBALANCE_MODES, Rebalancer
from pdtb.router.rebalance_loop import RebalanceLoop

log = logging.getLogger("pdtb.router.registry")


class NodeRegistry:
    """Builds and holds the router's parts (module docstring), runs their tasks, and answers for
    them under the names the handlers call; each method below is its part's own."""

    def __init__(self, specs: tuple[NodeSpec, ...] | list[NodeSpec], *, router_id: str | None = None,
                 ping_interval: float = 0.5, health_timeout: float = 3.0, hang_timeout: float | None = None,
                 default_page_size: int = 16, route: str = "load", rebalance: str = "off",
                 on_fatal: Callable[[BaseException], None] | None = None, curve_dir: str | None = None,
                 num_routers: int = 1) -> None:
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
        if rebalance not in REBALANCE_MODES:
            raise ValueError(f"rebalance must be one of {', '.join(REBALANCE_MODES)}, got {rebalance!r}")
        self.router_id = router_id or f"router-{os.getpid()}-{secrets.token_hex(4)}"
        # the node set reports to the follower, which sends through the node set: the callbacks
        # find the follower when they run, after both are built
        self.node_set = NodeSet(specs, router_id=self.router_id, ping_interval=ping_interval,
                                health_timeout=health_timeout, hang_timeout=hang_timeout,
                                default_page_size=default_page_size, track_prefixes=route != "load",
                                curve_dir=curve_dir, on_batch=lambda node, batch: self.follower.on_batch(node, batch),
                                on_lost=lambda node, what: self.follower.node_lost(node, what))
        # route "d2lpm": per-(client, worker) credit, this process's own (pdtb/router/fair_route.py);
        # with several routers behind one port each sees 1/num_routers of a client's requests
        self.dispatch = Dispatcher(self.node_set, route=route, d2lpm=D2lpmRouter(charge_scale=float(num_routers)))
        self.book = MigrationBook()
        self.follower = Follower(self.node_set, self.dispatch.requests, self.book)
        self.rebalancer = Rebalancer(rebalance)
        self.rebalance = RebalanceLoop(self.node_set, self.follower, self.rebalancer)
        self._on_fatal = on_fatal
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Connect one DEALER per node and start the ping, reader and rebalance tasks."""
        self.node_set.open()
        for coro in (self.node_set.ping_loop(), self.node_set.read_loop(), self.rebalance.run()):
            task = asyncio.create_task(coro)
            task.add_done_callback(self._task_done)
            self._tasks.append(task)

    async def close(self) -> None:
        """Fail every open request, stop the tasks, close the sockets."""
        self.dispatch.fail_all("router shutting down")
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        self._tasks.clear()
        self.node_set.close()

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.critical("router task %s failed", task.get_coro().__name__, exc_info=task.exception())
        if self._on_fatal:
            self._on_fatal(task.exception())

    # -- the node set ---------------------------------------------------------------------------
    @property
    def nodes(self) -> list[NodeState]:
        return self.node_set.nodes

    def is_healthy(self, node: NodeState, now: float | None = None) -> bool:
        return self.node_set.is_healthy(node, now)

    @staticmethod
    def draining(node: NodeState) -> bool:
        return NodeSet.draining(node)

    def by_id(self, node_id: str, role: str | None = None) -> NodeState | None:
        return self.node_set.by_id(node_id, role)

    def decode_node(self, node_id: str) -> NodeState | None:
        return self.node_set.by_id(node_id, "decode")

    def add(self, spec: NodeSpec) -> NodeState:
        return self.node_set.add(spec)

    def retire(self, key: str) -> NodeState:
        return self.node_set.retire(key)

    async def node_back(self, timeout: float) -> None:
        await self.node_set.node_back(timeout)

    def drain(self, node_id: str, reason: str = "drained by the router") -> NodeState:
        return self.node_set.drain(node_id, reason)

    def set_faults(self, node_id: str, faults: dict[str, float], for_s: float) -> NodeState:
        return self.node_set.set_faults(node_id, faults, for_s)

    # -- the dispatcher -------------------------------------------------------------------------
    @property
    def d2lpm(self) -> D2lpmRouter:
        return self.dispatch.d2lpm

    @property
    def num_submitted(self) -> int:
        return self.dispatch.num_submitted

    @property
    def num_open_requests(self) -> int:
        return len(self.dispatch.requests)

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is one of this router's open requests (another router behind
        the same port answers for the rest)."""
        return request_id in self.dispatch.requests

    def submit(self, req: GenerateRequest) -> RequestHandle:
        return self.dispatch.submit(req)

    def largest_pool_tokens(self) -> int | None:
        return self.dispatch.largest_pool_tokens()

    async def next_event(self, handle: RequestHandle, timeout: float, merge: bool = True) -> TokenEvent:
        return await self.dispatch.next_event(handle, timeout, merge)

    def abort(self, handle: RequestHandle, reason: str, final: bool = False) -> None:
        self.dispatch.abort(handle, reason, final)

    def release(self, handle: RequestHandle) -> None:
        self.dispatch.release(handle)

    def fail_all(self, reason: str) -> int:
        return self.dispatch.fail_all(reason)

    # -- the follower ---------------------------------------------------------------------------
    def migrate(self, request_id: str, target_id: str, reason: str = "admin", inject: str = "") -> Migration:
        return self.follower.migrate(request_id, target_id, reason, inject)
