"""Prefill node.

Queues and a request's path through them:

    GenerateRequest -> validate -> scheduler.waiting -> scheduler.running (chunked prefill under
    the token budget) -> first token sampled (event to the router: TTFT is measured here) ->
    detached from the scheduler, pages kept -> `handoffs` (KV export in flight to the chosen
    decode node; states in pdtb/nodes/handoff.py) -> DONE: pages freed | NO_PAGES: held,
    retried with backoff until hold_timeout_s (backpressure, nothing dropped) | FAILED (any
    other FailCode: too_large, draining, bad_metadata; a transport fault or timeout): error
    event, pages freed (after a transport fault or timeout marked `retry`: the router sends the
    request anew elsewhere, as it does for a lost node).
The request metadata sent with the KV (protocol.HandoffMeta) is sealed (pdtb/nodes/kv_meta.py)
right before each send.

Fallbacks: the router names, with the chosen decode node, up to a few other decode nodes that
could hold the request. A hand-off the chosen node cannot take moves to the next of them at
once (the router is told with a HandoffNotice, and with `delivered` when the KV has landed)
instead of failing: refused for good (DRAINING, TOO_LARGE) or a transport failure drops that
node from the request's list; NO_PAGES rotates to the next node (backoff only once every node
has refused in turn); a router's `NodeDown` moves hand-offs off a decode node that stopped
answering (their transfers would otherwise wait out the transfer timeout). BAD_METADATA fails
at once: it is this request's fault, not the node's. Without fallbacks (one decode node) every
refusal but NO_PAGES fails the request.

A request that ends at its first token (EOS, max_tokens=1) finishes here without a transfer.
The prefill node owns a request's pages until the decode side confirms receipt.
"""
from __future__ import annotations

import logging
import time

from pdtb.nodes import kv_meta
from pdtb.nodes.node_base import NodeBase
from prefill_node.order import PrefillOrder
from prefill_node.peer_pages import PeerPages
from pdtb.nodes.handoff import HandoffEvent
from prefill_node.handoff import Handoff, Outcome, lose_target, transfer_ended, unbind
from pdtb.nodes.protocol import GenerateRequest, HandoffMeta, HandoffNotice, Target, to_extra
from pdtb.nodes.arrival import accept_request
from kv_transport import TransferMeta, TransferState, TransportConfig
from pdtb.nodes.kv_senders import KVSenders
from kv_transport.fail_codes import FailCode
from pdtb.engine.scheduler import StepEvent
from pdtb.engine.kv_export import export_request
from pdtb.engine.sequence import Sequence

log = logging.getLogger(__name__)
class PrefillNode(NodeBase):
    moves_kv = True

    def __init__(self, config, engine=None, transport: TransportConfig | None = None) -> None:
        super().__init__(config, engine)
        self.engine.scheduler.prefill_only = True  # a prompt needs its own pages here, not its output's
        self.transport = transport or config.transport_config()
        self.senders = KVSenders(self.transport, self.engine.spec)
        self.handoffs: dict[str, Handoff] = {}
        self.reqs: dict[str, GenerateRequest] = {}
        self.peer_pages = PeerPages()  # what each decode node was sent and may still cache
        self.kv_bytes = {"sent": 0, "not_sent": 0}  # hand-off payload bytes, and bytes left out (cached there)

    def make_policy(self, config):
        """Prompts only, in arrival order: the fairness policy decides on the side that holds
        KV for the whole decode (the decode node, the colocated twin)."""
        return PrefillOrder(super().make_policy(config))

    def policy_label(self) -> str:
        return f"prefill-{self.policy_info.name}"  # it orders prompts only

    def on_generate(self, req: GenerateRequest) -> None:
        no_decode = None if req.decode_kv_addr else "no decode node given for a disaggregated request"
        if accept_request(self, req, no_decode) is not None:
            self.reqs[req.request_id] = req

    def on_step_events(self, events: list[StepEvent], t: float) -> None:
        now = time.time()
        for c in self.engine.last_output.chunks:
            c.seq.timeline.stamp_once("prefill_start", t)
            self.metrics.prompt_tokens.inc(c.num_new_tokens)
        for ev in events:
            seq = ev.seq
            tl = seq.timeline
            tl.first_token = now
            self.metrics.ttft.observe(now - tl.arrival)
            self.metrics.gen_tokens.inc()
            if ev.finished:
                tl.last_token = now
                self.reqs.pop(seq.request_id, None)
                self.emit(seq, [ev.token_id], True)
                continue
            self.emit(seq, [ev.token_id])
            self.engine.scheduler.detach(seq)  # pages stay, owned by the request id
            self._hand_off(seq, self.reqs.pop(seq.request_id))

    def _hand_off(self, seq: Sequence, req: GenerateRequest) -> None:
        h = Handoff(seq, req, [Target(req.decode_node, req.decode_kv_addr), *req.fallbacks],
                    deadline=time.monotonic() + self.config.hold_timeout_s)
        self.handoffs[seq.request_id] = h

    # ---- hand-offs -----------------------------------------------------------------------------
    async def _start_transfer(self, h: Handoff) -> None:
        seq, req = h.seq, h.req
        hashes = self._page_hashes(seq)
        addr = req.decode_kv_addr
        need = self.engine.spec.pages_for(seq.num_computed_tokens)
        h.skip_pages = 0 if h.no_skip else min(self.peer_pages.leading(addr, hashes), need - 1)
        sender = await self.senders.get(addr)
        if self.handoffs.get(seq.request_id) is not h or h.req.decode_kv_addr != addr or h.transfer_id is not None:
            return  # released, moved to another decode node or started while a new sender started: looked at again
        # gathered where the sender sends from fastest (shm: its arena, read there by the receiver)
        out = sender.export_buffer((need - h.skip_pages) * self.engine.spec.bytes_per_page) \
            if self.engine.pool.kv.device.type == "cpu" else None
        export = export_request(self.engine.pool, seq.request_id, seq.num_computed_tokens, h.skip_pages, out)
        now = time.time()
        seq.timeline.stamp_once("transfer_start", now)
        seq.timeline.end_wait("held", now)  # the decode side had deferred it: time held here
        meta = TransferMeta(tenant=seq.tenant, prompt_token_ids=seq.prompt_token_ids,
                            output_token_ids=seq.output_token_ids, num_computed_tokens=seq.num_computed_tokens,
                            extra=to_extra(HandoffMeta(req.router_id, req.params, req.priority, seq.timeline,
                                                       h.attempts, h.targets[1:], slo_tier=req.slo_tier)),
                            page_hashes=hashes)
        # sealed last: the digest covers exactly what the header will carry (pdtb/nodes/kv_meta.py)
        meta = kv_meta.seal(meta, seq.request_id, export.header.num_tokens, export.header.num_pages, h.skip_pages)
        h.transfer_id = sender.send(export, meta)
        h.on(HandoffEvent.SEND)
        h.attempts += 1

    def _page_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the prompt's full pages (none with the prefix cache off)."""
        sch = self.engine.scheduler
        if sch.prefix_ns is None:
            return []
        return sch.hashes_of(seq, seq.num_computed_tokens // self.engine.spec.page_size)

    def _landed_bytes(self, h: Handoff, addr: str, sent: int) -> None:
        """Count a landed hand-off's bytes, sent and left out, and remember its pages there."""
        seq = h.seq
        skipped = h.skip_pages * self.engine.pool.bytes_per_page
        self.kv_bytes["sent"] += sent
        self.kv_bytes["not_sent"] += skipped
        if skipped:
            self.acct.add_bytes(seq, "not_sent", skipped)
        self.peer_pages.add(addr, self._page_hashes(seq))

    async def poll_io(self) -> None:
        mono = time.monotonic()
        for rid, h in list(self.handoffs.items()):
            if h.transfer_id is None:
                continue
            st = self.senders.poll(h.req.decode_kv_addr, h.transfer_id)
            if st is None or not st.state.finished:
                continue
            st_node = h.req.decode_node
            addr = h.req.decode_kv_addr
            out = transfer_ended(h, st.state == TransferState.DONE, st.code, mono)
            if st.code is FailCode.CACHE_MISS:
                self.peer_pages.forget(addr)
            if out is Outcome.LANDED:
                self._landed_bytes(h, addr, st.bytes_total)
                if h.req.fallbacks:  # the router may have fallbacks in mind: the request is that node's now
                    self._notify(rid, h.req.decode_node, delivered=True)
                self.metrics.kv_sent.inc(st.bytes_total)
                self.metrics.transfers.labels(outcome="done", **self.metrics.labels).inc()
                if st.duration_s is not None:
                    self.metrics.transfer_s.observe(st.duration_s)
                self._release(rid)
                continue
            outcome = "deferred" if out is Outcome.HELD else "failed"
            self.metrics.transfers.labels(outcome=outcome, **self.metrics.labels).inc()
            if out is Outcome.HELD:  # backpressure: the pages stay here, the request waits
                h.seq.timeline.start_wait("held", time.time())
            if out is not Outcome.FAILED and h.req.decode_node != st_node:
                self._moved(h, st_node, f"{st.code}: {st.reason}")
            elif out is Outcome.FAILED:
                # fail() before _release(): the error event needs the route _release forgets.
                # A transport failure (a lost, late or damaged message) or a draining decode
                # node is no fault of the request: the router may recompute it elsewhere. What
                # no pool can hold, metadata that does not validate, and pages that stayed
                # short for the whole hold timeout would fail there too.
                self.fail(rid, f"KV transfer to the decode node failed: {st.code}: {st.reason}",
                          retry=st.code not in (FailCode.BAD_METADATA, FailCode.TOO_LARGE, FailCode.NO_PAGES))
                self._release(rid)
        for h in list(self.handoffs.values()):  # after the above: a moved hand-off starts at once
            if h.transfer_id is None and mono >= h.retry_at:
                await self._start_transfer(h)

    def _moved(self, h: Handoff, old: str, why: str) -> None:
        """The hand-off went to `h.targets[0]` (retargeted) from node `old`: tell the request's router."""
        log.info("request %s: hand-off moves from decode node %s to %s (%s)", h.seq.request_id, old,
                 h.req.decode_node, why)
        self._notify(h.seq.request_id, h.req.decode_node)

    def _notify(self, rid: str, decode_node: str, delivered: bool = False) -> None:
        """Tell the request's router which decode node it goes to (a notice, not output)."""
        self.sink.notice(self.routes.get(rid, ""), HandoffNotice(rid, decode_node, delivered))

    def on_node_down(self, node_id: str, reason: str) -> None:
        """Move every hand-off off decode node `node_id` (cancelling a transfer in flight to it),
        or fail those that have nowhere else to go."""
        for rid in unbind(self.reqs, node_id):  # not handed off yet: bound elsewhere from the start
            self._notify(rid, self.reqs[rid].decode_node)
        for rid, h in list(self.handoffs.items()):
            if h.transfer_id is not None and h.targets and h.targets[0].node_id == node_id:
                self.senders.cancel(h.req.decode_kv_addr, h.transfer_id, f"decode node {node_id} is down")
            out = lose_target(h, node_id, time.monotonic())
            if out is Outcome.MOVED:
                self._moved(h, node_id, f"decode node {node_id} is down")
            elif out is Outcome.FAILED:  # a lost node is no fault of the request: the router may recompute it
                self.fail(rid, f"decode node {node_id} {reason or 'stopped answering'}", retry=True)
                self._release(rid)

    def _release(self, rid: str) -> None:
        self.handoffs.pop(rid, None)
        self.engine.pool.free(rid)
        self._end_id(rid)  # its route, meters (they stayed forever after every hand-off), policy state

    def on_abort(self, request_id: str, reason: str) -> None:
        h = self.handoffs.get(request_id)
        if h is None:
            self.reqs.pop(request_id, None)
            return super().on_abort(request_id, reason)
        if h.transfer_id is not None:
            self.senders.cancel(h.req.decode_kv_addr, h.transfer_id, reason)
        self._release(request_id)

    def abort_all(self, reason: str) -> None:
        for rid in list(self.handoffs):
            self.fail(rid, reason)  # before on_abort, which forgets the request's route
            self.on_abort(rid, reason)
        super().abort_all(reason)

    def idle(self) -> bool:
        return super().idle() and not self.handoffs

    def extra_stats(self) -> dict:
        return {"handoffs": len(self.handoffs), "kv_bytes_sent": self.kv_bytes["sent"],
                "kv_transfers_one_sided": self.senders.one_sided,
                "kv_transfers_read": self.senders.read_by_receiver,
                "kv_bytes_not_sent": self.kv_bytes["not_sent"],
                "held_pages": sum(len(self.engine.pool.pages_of(r)) for r in self.handoffs)}

    async def close_extra(self) -> None:
        await self.senders.close()
