"""Following a request between nodes: hand-off notices, adoption by a decode node, live migration's
switch of holder, drains.

Following a request between nodes: hand-off notices (BOUND, MOVED, DELIVERED), a decode node that
adopted it, live migrations (pdtb/router/migration.py), drains. Part of NodeRegistry (registry.py)."""
from __future__ import annotations

import logging
import time

from pdtb.nodes.handoff import HandoffEvent, advance
from pdtb.nodes.protocol import (AbortRequest, Drain, HandoffNotice, Migrate, MigrationReport, SetFaults, Target,
                                 TokenEvent)
from pdtb.router.migration import Migration
from pdtb.router.node_state import NodeState, RequestFailed, RequestHandle

log = logging.getLogger("pdtb.router.registry")


class Following:
    """Where a request's tokens come from as hand-offs move and live migrations switch nodes (a
    NodeRegistry part).

    Uses the registry's nodes, `_requests`, book (MigrationBook) and rebalancer, and its `_send`,
    `_put` and `_fail_dependents`; every method runs on the router's loop from a frame just read."""

    def _on_notice(self, node: NodeState, notice: HandoffNotice) -> None:
        handle = self._requests.get(notice.request_id)
        if handle is None or handle.handoff is None:
            return  # finished, aborted, or colocated: nothing to follow
        if notice.migration_id and node.spec.role == "decode":
            self._migrated(node, handle, notice)
        elif node is handle.entry:
            d = handle.decode  # (the node it was sent to, where another answers to its id now)
            self._move(handle, d if d is not None and d.node_id == notice.decode_node else
                       self.by_id(notice.decode_node, "decode"), notice.decode_node)
            if notice.delivered and handle.decode is not None and handle.decode.node_id == notice.decode_node:
                self._deliver(handle)  # it depends on that decode node alone now
                if handle.decode.lost:  # (the judgement that would fail it came before this notice)
                    self._lost_there(handle, notice.decode_node)
        elif node.spec.role == "decode":
            self._held_by(node, handle)
        else:
            log.warning("hand-off notice for %s from unrelated node %s", notice.request_id, node.spec.address)

    def decode_node(self, node_id: str) -> NodeState | None:
        return self.by_id(node_id, "decode")

    def by_id(self, node_id: str, role: str | None = None) -> NodeState | None:
        """The node that answers to `node_id` now. An id repeats where a node was started again
        beside the one it replaces (a supervisor's replacement, a restart at another address):
        a healthy node wins over one that is down, then the one added last."""
        now = time.monotonic()
        found = [n for n in self.nodes if n.node_id == node_id and (role is None or n.spec.role == role)]
        return next((n for n in reversed(found) if self.is_healthy(n, now)), found[-1] if found else None)

    def migrate(self, request_id: str, target_id: str, reason: str = "admin", inject: str = "") -> Migration:
        """Start moving a handed-off request to decode node `target_id`. ValueError says why not."""
        handle = self._requests.get(request_id)
        if handle is None or handle.decode is None:
            raise ValueError(f"request {request_id!r} is not decoding on a decode node here")
        if not handle.handed_off or not handle.entry_started:
            raise ValueError(f"request {request_id!r} is not decoding on its decode node yet ({handle.handoff.value})")
        if handle.migration is not None:
            raise ValueError(f"request {request_id!r} is moving already ({handle.migration.migration_id})")
        target = self.decode_node(target_id)
        if target is None or target is handle.decode:
            raise ValueError(f"{target_id!r} is not another decode node")
        if not self.is_healthy(target) or self.draining(target) or not target.stats.kv_addr:
            raise ValueError(f"decode node {target_id} is not available (down or draining)")
        source = handle.decode
        m = self.book.new(request_id, source.node_id, target.node_id, reason, self.router_id)
        if not self._send(source, Migrate(request_id, m.migration_id, Target(target.node_id, target.stats.kv_addr),
                                          reason, inject, target.stats.prefix_ns)):
            self.book.end(m, "failed", f"decode node {source.node_id} is not reachable")
            raise ValueError(f"decode node {source.node_id} is not reachable")
        handle.migration = m
        return m

    def drain(self, node_id: str, reason: str = "drained by the router") -> NodeState:
        """Tell a node to drain: it takes no new work; a decode node's requests are moved away."""
        node = self.by_id(node_id)
        if node is None:
            raise ValueError(f"no node {node_id!r}")
        if not self._send(node, Drain(reason)):
            raise ValueError(f"node {node_id} is not reachable")
        node.drain_sent = True
        return node

    def set_faults(self, node_id: str, faults: dict[str, float], for_s: float) -> NodeState:
        """Tell a node to inject `faults` into its KV sends for `for_s` seconds (chaos runs)."""
        node = self.by_id(node_id)
        if node is None:
            raise ValueError(f"no node {node_id!r}")
        if not self._send(node, SetFaults(dict(faults), float(for_s))):
            raise ValueError(f"node {node_id} is not reachable")
        return node

    def _migrated(self, node: NodeState, handle: RequestHandle, notice: HandoffNotice) -> None:
        """The target adopted a migrated request: switch to it, or tell it to drop the request."""
        m = handle.migration
        if m is None or m.migration_id != notice.migration_id or m.target != node.node_id or m.switched:
            if node is not handle.decode:
                self._send(node, AbortRequest(handle.request_id, "its migration is over: another node holds it"))
            return
        if handle.tokens > notice.output_tokens:  # the source resumed and went on: it holds the request
            self._send(node, AbortRequest(handle.request_id, "the source resumed the request"))
            self.book.end(m, "failed", "the source resumed it before the target's word came")
            handle.migration = None
            return
        self._switch(handle, node, notice.output_tokens)

    def _switch(self, handle: RequestHandle, target: NodeState, switch_at: int) -> None:
        m = handle.migration
        m.switched, m.switch_at = True, switch_at
        handle.decode = target
        if not self.is_healthy(target):  # it died after taking the request: recompute it
            handle.queue.put_nowait(RequestFailed(503, f"decode node {target.node_id} stopped answering",
                                                  node_lost=True))
            return
        self._caught_up(handle)

    def _caught_up(self, handle: RequestHandle) -> None:
        """Once the source's last tokens are in, the target's held events follow."""
        m = handle.migration
        if m is None or not m.switched or handle.tokens < m.switch_at:
            return
        handle.migration = None
        for ev in m.held:
            self._put(handle, ev)
        m.held.clear()

    def _migration_event(self, node: NodeState, handle: RequestHandle, event: TokenEvent) -> bool:
        """Events of a request that is moving. True: handled here."""
        m = handle.migration
        if not m.switched:
            return False  # the source holds it (the target's events before its notice are dropped below)
        if node is handle.decode:
            if handle.tokens < m.switch_at:
                m.held.append(event)
                return True
            return False
        if node.node_id == m.source:
            if handle.tokens < m.switch_at and not event.finished:
                self._put(handle, event)
                self._caught_up(handle)
            else:  # it went on after the target took over (its confirmation was lost): it lets go
                self._send(node, AbortRequest(handle.request_id, f"the request moved to {m.target}"))
            return True
        return False

    def _on_migration_report(self, node: NodeState, r: MigrationReport) -> None:
        m = self.book.report(r)
        if r.downtime_s > 0 and self.on_downtime is not None:
            self.on_downtime(r.downtime_s)
        handle = self._requests.get(r.request_id)
        if m is None or handle is None or handle.migration is not m:
            return
        if not r.ok and not m.switched:
            handle.migration = None  # it stays at the source (resumed), or ended there
        elif r.ok and not m.switched:  # the target confirmed to the source; its notice is on its way
            target = self.decode_node(m.target)
            if target is not None:
                self._switch(handle, target, r.output_tokens)

    def _held_by(self, node: NodeState, handle: RequestHandle) -> bool:
        """Decode node `node` says (a notice or output) it holds `handle`'s request. True when
        it is the request's decode node now; False when another one holds it (told to drop it)."""
        if node is handle.decode:
            self._deliver(handle)
            return True
        if handle.handed_off:  # a second holder (a hand-off that timed out at the sender but landed)
            log.warning("request %s: decode node %s holds it, but it is handed to %s; dropping it there",
                        handle.request_id, node.node_id, handle.decode.node_id)
            self._send(node, AbortRequest(handle.request_id, "the request is held by another decode node"))
            return False
        # it adopted the KV (a move whose notice is still on its way, or a transfer the sender
        # gave up on that landed after all): it holds the request now
        log.info("request %s: decode node %s holds it (the router had %s)", handle.request_id, node.node_id,
                 handle.decode.node_id)
        self._move(handle, node, node.node_id, spoke=True)
        self._send(handle.entry, AbortRequest(handle.request_id, f"held by decode node {node.node_id}"))
        self._deliver(handle)
        return True

    def _deliver(self, handle: RequestHandle) -> None:
        if not handle.handoff.final:
            handle.handoff = advance(handle.handoff, HandoffEvent.LANDED)

    def _move(self, handle: RequestHandle, new: NodeState | None, node_id: str, spoke: bool = False) -> None:
        """`handle`'s request went to decode node `new` (named `node_id`; None: unknown) instead:
        its prefill node says so, or (`spoke`) that decode node itself."""
        if handle.decode is None or handle.handed_off or new is None or new is handle.decode:
            if new is None or (handle.handed_off and new is not handle.decode):
                log.warning("request %s: ignoring a move to decode node %r (%s)", handle.request_id, node_id,
                            "unknown node" if new is None else "already handed off")
            return
        if not spoke and new.lost:
            self._lost_there(handle, node_id)
            return
        pages = handle.decode.pending_pages.pop(handle.request_id, None)
        if pages is not None:
            new.pending_pages[handle.request_id] = pages
        handle.decode = new
        handle.handoff = advance(handle.handoff, HandoffEvent.MOVE)

    def _lost_there(self, handle: RequestHandle, node_id: str) -> None:
        """`handle`'s request went to decode node `node_id` after the router judged it down: that
        judgement is not made again, so the request fails now rather than at the request timeout."""
        log.warning("request %s: handed to decode node %s, which is down", handle.request_id, node_id)
        handle.queue.put_nowait(RequestFailed(503, f"decode node {node_id} took the request but stopped answering",
                                              node_lost=True))
