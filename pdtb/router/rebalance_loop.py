"""`RebalanceLoop`: each second, the decode nodes' reports into the rebalancer's views and its
moves started.

The decode nodes' reports become DecodeView rows for the rebalancer (pdtb/router/rebalance.py);
the moves it plans start through the Follower's `migrate` (pdtb/router/following.py)."""
from __future__ import annotations

import asyncio
import logging
import time

from pdtb.router.following import Follower
from pdtb.router.node_set import NodeSet
from pdtb.router.rebalance import DecodeView, Rebalancer, ReqView

log = logging.getLogger("pdtb.router.registry")


class RebalanceLoop:
    """Each second, the rebalancer's moves from the decode nodes' reports; one task on the
    router's loop. Reads the Follower's open requests and migration book."""

    def __init__(self, node_set: NodeSet, follower: Follower, rebalancer: Rebalancer) -> None:
        self.node_set = node_set
        self.follower = follower
        self.rebalancer = rebalancer

    async def run(self) -> None:
        """Each second: moves from the rebalancer (drains in every mode)."""
        requests = self.follower.requests
        while True:
            await asyncio.sleep(max(1.0, self.node_set.ping_interval))
            now = time.monotonic()
            for m in self.follower.book.expire(now):  # no word from its source: it is not moving any more
                h = requests.get(m.request_id)
                if h is not None and h.migration is m and not m.switched:
                    h.migration = None
            views = self.decode_views(now)
            if not views:
                continue
            for move in self.rebalancer.plan(views, now):
                try:
                    self.follower.migrate(move.request_id, move.target, move.reason)
                except ValueError as e:
                    log.info("rebalance: %s -> %s not started: %s", move.request_id, move.target, e)
                    continue
                self.rebalancer.started(move, now)

    def decode_views(self, now: float) -> list[DecodeView]:
        """Each healthy decode node that has reported, as the rebalancer sees it."""
        views = []
        for n in self.node_set.nodes:
            if n.spec.role != "decode" or not self.node_set.is_healthy(n, now) or n.stats is None:
                continue
            extra = n.stats.extra
            reqs = []
            for item in extra.get("requests", []) if isinstance(extra.get("requests"), list) else []:
                try:
                    rid, tenant, pages = item
                except (TypeError, ValueError):
                    continue
                h = self.follower.requests.get(rid)
                if h is not None and h.decode is n and h.migration is None and h.handed_off:
                    reqs.append(ReqView(str(rid), str(tenant), int(pages)))
            waiting = extra.get("tenant_waiting") if isinstance(extra.get("tenant_waiting"), dict) else {}
            views.append(DecodeView(n.node_id, n.stats.pages_total, n.free_pages_estimate(), self.node_set.draining(n),
                                    tuple(reqs), {str(k): int(v) for k, v in waiting.items()},
                                    self.follower.book.by_node(n.node_id)))
        return views
