"""`Follower`: which node a request's tokens come from as its hand-off moves, a decode node adopts
it or a live migration switches its holder, and what a lost node takes with it.

A request in disaggregated mode depends on its prefill node until its decode node sends a first
event, then on the decode node alone. Decode events that overtake the prefill node's first token
(different connections) are held until that token arrives, so the output stays in order.
Hand-off notices: BOUND, MOVED, DELIVERED (pdtb/nodes/handoff.py). Migrations:
pdtb/router/migration.py. Every method runs on the router's loop, from a frame just read or a
judgement of the health loop.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from pdtb.nodes.handoff import HandoffEvent, advance
from pdtb.nodes.protocol import (AbortRequest, HandoffNotice, Migrate, MigrationReport, NodeDown, Target, TokenBatch,
                                 TokenEvent)
from pdtb.router.migration import Migration, MigrationBook
from pdtb.router.node_set import NodeSet
from pdtb.router.node_state import NodeState, RequestFailed, RequestHandle

log = logging.getLogger("pdtb.router.registry")


class Follower:
    """Follows the open requests between nodes (module docstring).

    `requests` is the dispatcher's table of open requests (pdtb/router/dispatch.py), read here
    and never added to or removed from; `book` records the migrations."""

    def __init__(self, node_set: NodeSet, requests: dict[str, RequestHandle], book: MigrationBook) -> None:
        self.node_set = node_set
        self.requests = requests
        self.book = book
        self.on_downtime: Callable[[float], None] | None = None  # metrics: a migrated request's pause

    def on_batch(self, node: NodeState, batch: TokenBatch) -> None:
        for notice in batch.notices:  # before the events: an adoption, then its output
            self.on_notice(node, notice)
        for event in batch.events:
            self.on_event(node, event)
        for report in batch.migrations:
            self.on_migration_report(node, report)

    def on_event(self, node: NodeState, event: TokenEvent) -> None:
        handle = self.requests.get(event.request_id)
        if handle is None:
            return  # finished or aborted here already; late events are expected
        if node is handle.entry:
            if event.retry and handle.handed_off and handle.decode is not None and handle.decode is not node:
                # the hand-off timed out at the prefill node but landed: the decode node holds
                # the request and streams it; the prefill node's word to recompute is moot
                log.info("request %s: %s, but decode node %s holds it", event.request_id, event.error,
                         handle.decode.node_id)
                return
            handle.entry_started = True
            node.pending_tokens.pop(handle.request_id, None)
            handle.put(event)
            for held in handle.held:
                handle.put(held)
            handle.held.clear()
        elif handle.handoff is not None and node.spec.role == "decode":
            if handle.migration is not None and self._migration_event(node, handle, event):
                return
            if not self._held_by(node, handle):
                return
            if event.token_ids or event.finished:  # its pages now show in the node's device-tier stats
                node.pending_pages.pop(handle.request_id, None)  # (an adopted request may be parked in host)
            if handle.entry_started:
                handle.put(event)
            else:
                handle.held.append(event)
        else:
            log.warning("event for %s from unrelated node %s", event.request_id, node.spec.address)

    def on_notice(self, node: NodeState, notice: HandoffNotice) -> None:
        handle = self.requests.get(notice.request_id)
        if handle is None or handle.handoff is None:
            return  # finished, aborted, or colocated: nothing to follow
        if notice.migration_id and node.spec.role == "decode":
            self._migrated(node, handle, notice)
        elif node is handle.entry:
            d = handle.decode  # (the node it was sent to, where another answers to its id now)
            self._move(handle, d if d is not None and d.node_id == notice.decode_node else
                       self.node_set.by_id(notice.decode_node, "decode"), notice.decode_node)
            if notice.delivered and handle.decode is not None and handle.decode.node_id == notice.decode_node:
                self._deliver(handle)  # it depends on that decode node alone now
                if handle.decode.lost:  # (the judgement that would fail it came before this notice)
                    self._lost_there(handle, notice.decode_node)
        elif node.spec.role == "decode":
            self._held_by(node, handle)
        else:
            log.warning("hand-off notice for %s from unrelated node %s", notice.request_id, node.spec.address)

    def node_lost(self, node: NodeState, what: str) -> None:
        """`node`'s process is gone ("stopped answering", "restarted"): fail what depends on it;
        prefill nodes move hand-offs off it."""
        self.fail_dependents(node, what)
        for m in [m for m in self.book.in_flight.values() if m.source == node.node_id]:
            # its report will not come: the target took the request (switched), or it is recomputed
            self.book.end(m, "done" if m.switched else "failed", f"the source {what}" +
                          (" after the target took the request" if m.switched else ""))
        if node.spec.role == "decode":
            now = time.monotonic()
            for p in self.node_set.nodes:
                if p.spec.role == "prefill" and self.node_set.is_healthy(p, now):
                    self.node_set.send(p, NodeDown(node.node_id, what))

    def fail_dependents(self, node: NodeState, what: str = "stopped answering") -> None:
        """Fail the requests that depend on `node`, but those whose prefill node can still move
        the hand-off to a live fallback."""
        now = time.monotonic()
        healthy = self.node_set.is_healthy
        for handle in list(self.requests.values()):
            if node is handle.decode and not handle.handed_off and healthy(handle.entry, now) and any(
                    n.node_id in handle.fallbacks and n.node_id != node.node_id and healthy(n, now)
                    for n in self.node_set.nodes if n.spec.role == "decode"):
                continue  # its prefill node moves the hand-off to a fallback (NodeDown) or fails it
            mig = handle.migration
            due = mig is not None and mig.switched and mig.source == node.node_id and handle.tokens < mig.switch_at
            if node in handle.depends_on() or due:
                msg = f"{node.spec.role} node {node.node_id} {what}"
                if node.stats is not None and node.stats.draining:  # its last words (the aborts) were lost
                    msg = f"{node.spec.role} node {node.node_id} shut down: it was draining, then stopped answering"
                handle.queue.put_nowait(RequestFailed(503, msg, node_lost=True))

    def migrate(self, request_id: str, target_id: str, reason: str = "admin", inject: str = "") -> Migration:
        """Start moving a handed-off request to decode node `target_id`. ValueError says why not."""
        handle = self.requests.get(request_id)
        if handle is None or handle.decode is None:
            raise ValueError(f"request {request_id!r} is not decoding on a decode node here")
        if not handle.handed_off or not handle.entry_started:
            raise ValueError(f"request {request_id!r} is not decoding on its decode node yet ({handle.handoff.value})")
        if handle.migration is not None:
            raise ValueError(f"request {request_id!r} is moving already ({handle.migration.migration_id})")
        target = self.node_set.by_id(target_id, "decode")
        if target is None or target is handle.decode:
            raise ValueError(f"{target_id!r} is not another decode node")
        if not self.node_set.is_healthy(target) or self.node_set.draining(target) or not target.stats.kv_addr:
            raise ValueError(f"decode node {target_id} is not available (down or draining)")
        source = handle.decode
        m = self.book.new(request_id, source.node_id, target.node_id, reason, self.node_set.router_id)
        msg = Migrate(request_id, m.migration_id, Target(target.node_id, target.stats.kv_addr), reason, inject,
                      target.stats.prefix_ns)
        if not self.node_set.send(source, msg):
            self.book.end(m, "failed", f"decode node {source.node_id} is not reachable")
            raise ValueError(f"decode node {source.node_id} is not reachable")
        handle.migration = m
        return m

    def on_migration_report(self, node: NodeState, r: MigrationReport) -> None:
        m = self.book.report(r)
        if r.downtime_s > 0 and self.on_downtime is not None:
            self.on_downtime(r.downtime_s)
        handle = self.requests.get(r.request_id)
        if m is None or handle is None or handle.migration is not m:
            return
        if not r.ok and not m.switched:
            handle.migration = None  # it stays at the source (resumed), or ended there
        elif r.ok and not m.switched:  # the target confirmed to the source; its notice is on its way
            target = self.node_set.by_id(m.target, "decode")
            if target is not None:
                self._switch(handle, target, r.output_tokens)

    def _migrated(self, node: NodeState, handle: RequestHandle, notice: HandoffNotice) -> None:
        """The target adopted a migrated request: switch to it, or tell it to drop the request."""
        m = handle.migration
        if m is None or m.migration_id != notice.migration_id or m.target != node.node_id or m.switched:
            if node is not handle.decode:
                self.node_set.send(node, AbortRequest(handle.request_id,
                                                      "its migration is over: another node holds it"))
            return
        if handle.tokens > notice.output_tokens:  # the source resumed and went on: it holds the request
            self.node_set.send(node, AbortRequest(handle.request_id, "the source resumed the request"))
            self.book.end(m, "failed", "the source resumed it before the target's word came")
            handle.migration = None
            return
        self._switch(handle, node, notice.output_tokens)

    def _switch(self, handle: RequestHandle, target: NodeState, switch_at: int) -> None:
        m = handle.migration
        m.switched, m.switch_at = True, switch_at
        handle.decode = target
        if not self.node_set.is_healthy(target):  # it died after taking the request: recompute it
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
            handle.put(ev)
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
                handle.put(event)
                self._caught_up(handle)
            else:  # it went on after the target took over (its confirmation was lost): it lets go
                self.node_set.send(node, AbortRequest(handle.request_id, f"the request moved to {m.target}"))
            return True
        return False

    def _held_by(self, node: NodeState, handle: RequestHandle) -> bool:
        """Decode node `node` says (a notice or output) it holds `handle`'s request. True when
        it is the request's decode node now; False when another one holds it (told to drop it)."""
        if node is handle.decode:
            self._deliver(handle)
            return True
        if handle.handed_off:  # a second holder (a hand-off that timed out at the sender but landed)
            log.warning("request %s: decode node %s holds it, but it is handed to %s; dropping it there",
                        handle.request_id, node.node_id, handle.decode.node_id)
            self.node_set.send(node, AbortRequest(handle.request_id, "the request is held by another decode node"))
            return False
        # it adopted the KV (a move whose notice is still on its way, or a transfer the sender
        # gave up on that landed after all): it holds the request now
        log.info("request %s: decode node %s holds it (the router had %s)", handle.request_id, node.node_id,
                 handle.decode.node_id)
        self._move(handle, node, node.node_id, spoke=True)
        self.node_set.send(handle.entry, AbortRequest(handle.request_id, f"held by decode node {node.node_id}"))
        self._deliver(handle)
        return True

    @staticmethod
    def _deliver(handle: RequestHandle) -> None:
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

    @staticmethod
    def _lost_there(handle: RequestHandle, node_id: str) -> None:
        """`handle`'s request went to decode node `node_id` after the router judged it down: that
        judgement is not made again, so the request fails now rather than at the request timeout."""
        log.warning("request %s: handed to decode node %s, which is down", handle.request_id, node_id)
        handle.queue.put_nowait(RequestFailed(503, f"decode node {node_id} took the request but stopped answering",
                                              node_lost=True))
