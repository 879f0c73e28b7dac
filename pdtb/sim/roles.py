"""Colocated, prefill and decode by the nodes' own rules (`accept_request`,
`decode_node/placement.py`, `prefill_node/handoff.py`).

The three simulated roles over `SimNode`: what each does with a step's tokens and between
steps, by the same rules as the real nodes.

    colocated: GenerateRequest -> accept_request (pdtb/nodes/arrival.py) -> steps -> tokens
    prefill:   GenerateRequest -> accept_request -> PrefillOrder (prefill_node/order.py) ->
               first token -> detached, `Handoff` (prefill_node/handoff.py) -> header to the
               decode node -> transfer_ended on its answer: landed (pages freed), held (retry,
               backoff, rotation), moved, failed
    decode:    header -> decode_node/placement.place (accept, park, defer, refuse) -> pages
               RESERVED -> payload over the link -> committed, adopted (running or parked) ->
               steps -> tokens
"""
from __future__ import annotations

import copy

from decode_node.placement import Inherited, place
from kv_transport.admission import Verdict
from kv_transport.fail_codes import FailCode
from pdtb.engine.sequence import Sequence
from pdtb.nodes.handoff import HandoffEvent
from pdtb.nodes.arrival import accept_request, to_sampling
from pdtb.nodes.protocol import Target
from pdtb.sim.node import SimNode
from prefill_node.handoff import Handoff, Outcome, lose_target, transfer_ended, unbind
from prefill_node.order import PrefillOrder


def _queue(node: SimNode, req) -> None:
    seq = accept_request(node, req)
    if seq is not None:  # the nodes stamp wall-clock times: the simulated clock here
        seq.arrival_time = seq.timeline.prefill_queued = node.loop.now
        seq.timeline.router_arrival = req.arrival_time


class SimColocated(SimNode):
    def on_generate(self, req) -> None:
        _queue(self, req)

    def on_step_events(self, out, events, t0: float) -> None:
        now = self.loop.now
        for c in out.chunks:
            c.seq.timeline.stamp_once("prefill_start", t0)
        for ev in events:
            tl = ev.seq.timeline
            if tl.first_token is None:
                tl.first_token = tl.decode_admit = now
            tl.last_token = now
            self.emit(ev.seq, ev.finished)


class SimPrefill(SimNode):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.scheduler.prefill_only = True
        self.handoffs: dict[str, Handoff] = {}
        self.reqs: dict = {}

    def make_policy(self, shape):
        return PrefillOrder(super().make_policy(shape))

    def on_generate(self, req) -> None:
        _queue(self, req)
        if req.request_id in self.seqs:
            self.reqs[req.request_id] = req

    def on_step_events(self, out, events, t0: float) -> None:
        now = self.loop.now
        for c in out.chunks:
            c.seq.timeline.stamp_once("prefill_start", t0)
        for ev in events:
            seq = ev.seq
            seq.timeline.first_token = now
            if ev.finished:
                seq.timeline.last_token = now
                self.reqs.pop(seq.request_id, None)
                self.emit(seq, True)
                continue
            self.emit(seq, False)
            self.scheduler.detach(seq)  # pages stay, owned by the request id
            req = self.reqs.pop(seq.request_id)
            self.handoffs[seq.request_id] = Handoff(seq, req, [Target(req.decode_node, req.decode_kv_addr),
                                                               *req.fallbacks],
                                                    deadline=now + self.shape.hold_timeout_s)

    def poll_io(self) -> None:
        now, due = self.loop.now, None
        for h in list(self.handoffs.values()):
            if h.transfer_id is not None:
                continue
            if now >= h.retry_at:
                self._send(h)
            else:
                due = h.retry_at if due is None else min(due, h.retry_at)
        if due is not None:
            self.wake_at(due)

    def _send(self, h: Handoff) -> None:
        now, seq = self.loop.now, h.seq
        seq.timeline.stamp_once("transfer_start", now)
        seq.timeline.end_wait("held", now)
        h.transfer_id = f"{seq.request_id}#{h.attempts}"
        h.on(HandoffEvent.SEND)
        h.attempts += 1
        self.cluster.send_header(self, h)

    def on_transfer_end(self, h: Handoff, tid: str, landed: bool, code: FailCode | None, reason: str) -> None:
        rid = h.seq.request_id
        if self.handoffs.get(rid) is not h or h.transfer_id != tid:
            return  # an answer to an attempt given up already
        out = transfer_ended(h, landed, code, self.loop.now)
        if out is Outcome.HELD:
            h.seq.timeline.start_wait("held", self.loop.now)
        elif out is Outcome.FAILED:  # as prefill_node/node.py: the request's own fault is not retried
            self.fail(rid, f"KV transfer to the decode node failed: {code}: {reason}",
                      retry=code not in (FailCode.BAD_METADATA, FailCode.TOO_LARGE, FailCode.NO_PAGES))
        if out in (Outcome.LANDED, Outcome.FAILED):
            self.handoffs.pop(rid, None)
            self.pool.free(rid)
            self._forget(rid)

    def on_node_down(self, node_id: str) -> None:
        """The router found decode node `node_id` gone (prefill_node/node.py `on_node_down`):
        hand-offs move off it to their fallbacks, or fail."""
        unbind(self.reqs, node_id)  # not handed off yet: bound elsewhere from the start
        for rid, h in list(self.handoffs.items()):
            # (an answer for a cancelled transfer is ignored: its transfer id is forgotten)
            if lose_target(h, node_id, self.loop.now) is Outcome.FAILED:
                self.fail(rid, f"decode node {node_id} stopped answering", retry=True)
                self.handoffs.pop(rid, None)
                self.pool.free(rid)


class SimDecode(SimNode):
    def on_header(self, src: SimPrefill, h: Handoff, tid: str) -> None:
        if src.dead:
            return  # the sender died after sending it: nothing follows
        seq = h.seq
        req = Inherited(seq.request_id, seq.tenant, seq.priority, seq.slo_tier,
                        self.pool.spec.pages_for(seq.num_computed_tokens), seq.num_computed_tokens,
                        seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens)
        verdict = place(req, self.scheduler, self.policy, can_park=True)
        if verdict.verdict in (Verdict.DEFER, Verdict.REFUSE):
            self.cluster.answer(src, h, tid, False, verdict.code, verdict.reason)
            return
        target = self.host_pool if verdict.verdict is Verdict.PARK else self.pool
        if target.reserve(seq.request_id, req.num_pages) is None:
            self.cluster.answer(src, h, tid, False, FailCode.NO_PAGES,
                                f"need {req.num_pages} pages, {target.num_free} free")
            return
        self.cluster.send_payload(src, self, h, tid, target, req.num_pages * self.pool.bytes_per_page)

    def on_transfer_failed(self, src: SimPrefill, h: Handoff, tid: str, target, code, reason: str) -> None:
        target.free(h.seq.request_id)  # what it reserved for the transfer
        self.cluster.answer(src, h, tid, False, code, reason)

    def on_landed(self, src: SimPrefill, h: Handoff, tid: str, target, nbytes: int) -> None:
        if src.dead:  # the sender died before the last byte: the receiver lets the reservation go
            target.free(h.seq.request_id)
            return
        now, pre = self.loop.now, h.seq
        target.commit(pre.request_id)
        seq = Sequence(pre.request_id, list(pre.token_ids), pre.num_prompt_tokens, to_sampling(h.req.params),
                       tenant=pre.tenant, priority=pre.priority, slo_tier=pre.slo_tier,
                       num_computed_tokens=pre.num_computed_tokens)
        seq.arrival_time = now
        seq.timeline = tl = copy.copy(pre.timeline)  # it travels in the hand-off's metadata
        tl.transfer_end = tl.decode_admit = now
        tl.last_token = tl.first_token if tl.first_token is not None else now
        self.seqs[seq.request_id] = seq
        self.acct.add_received(seq, nbytes)
        if target is self.host_pool:
            tl.parked_since = now
            self.scheduler.add_parked(seq)
        else:
            self.scheduler.add_running(seq)
        self.cluster.on_adopted(self, seq)
        self.cluster.answer(src, h, tid, True, None, "")

    def on_step_events(self, out, events, t0: float) -> None:
        now, on_token = self.loop.now, self.cluster.on_token
        for ev in events:
            ev.seq.timeline.last_token = now
            if ev.finished:
                self.emit(ev.seq, True)
            else:  # (every decode token passes here: no detour through emit)
                on_token(self, ev.seq.request_id, False, None)
