"""Each second, the decode nodes' reports into the rebalancer's views and its moves started.

The rebalance loop: decode nodes' reports into DecodeView rows for the rebalancer
(pdtb/router/rebalance.py), and its moves started. Part of NodeRegistry (registry.py)."""
from __future__ import annotations

import asyncio
import logging
import time

from pdtb.router.rebalance import DecodeView, ReqView

log = logging.getLogger("pdtb.router.registry")


class RebalanceLoop:
    """Each second, the rebalancer's moves from the decode nodes' reports (a NodeRegistry part).

    Uses the registry's nodes, rebalancer, `_requests` and `migrate`; one task on the router's loop."""

    async def _rebalance_loop(self) -> None:
        """Each second: moves from the rebalancer (drains in every mode)."""
        while True:
            await asyncio.sleep(max(1.0, self.ping_interval))
            now = time.monotonic()
            for m in self.book.expire(now):  # no word from its source: it is not moving any more
                h = self._requests.get(m.request_id)
                if h is not None and h.migration is m and not m.switched:
                    h.migration = None
            views = self._decode_views(now)
            if not views:
                continue
            for move in self.rebalancer.plan(views, now):
                try:
                    self.migrate(move.request_id, move.target, move.reason)
                except ValueError as e:
                    log.info("rebalance: %s -> %s not started: %s", move.request_id, move.target, e)
                    continue
                self.rebalancer.started(move, now)

    def _decode_views(self, now: float) -> list[DecodeView]:
        views = []
        for n in self.nodes:
            if n.spec.role != "decode" or not self.is_healthy(n, now) or n.stats is None:
                continue
            extra = n.stats.extra
            reqs = []
            for item in extra.get("requests", []) if isinstance(extra.get("requests"), list) else []:
                try:
                    rid, tenant, pages = item
                except (TypeError, ValueError):
                    continue
                h = self._requests.get(rid)
                if h is not None and h.decode is n and h.migration is None and h.handed_off:
                    reqs.append(ReqView(str(rid), str(tenant), int(pages)))
            waiting = extra.get("tenant_waiting") if isinstance(extra.get("tenant_waiting"), dict) else {}
            views.append(DecodeView(n.node_id, n.stats.pages_total, n.free_pages_estimate(), self.draining(n),
                                    tuple(reqs), {str(k): int(v) for k, v in waiting.items()},
                                    self.book.by_node(n.node_id)))
        return views
