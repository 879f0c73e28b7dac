"""Decode node.

Queues and a request's path through them:

    KV header arrives -> refused for good if the node is draining, the metadata seal does not
    match (pdtb/nodes/kv_meta.py) or the request can never fit ("too_large": its pages at prompt +
    max_tokens exceed the whole device tier; the prefill side fails it at once) -> admission
    policy (fairness interface): accept | refuse "no_pages" (the prefill side keeps its pages and
    retries: backpressure) -> pages RESERVED while the payload lands -> verified and committed
    (RESIDENT) -> `take_completed` -> scheduler.running (continuous-batching decode; one token
    event per step to the request's router) -> finished: final event with the timeline, pages
    freed. Aborts free pages at any point. SIGTERM: new headers are refused, transfers already
    landing and running requests finish within the drain timeout, the rest fail. On adoption
    the node sends the router a HandoffNotice (delivered): from then on the request needs only this node.

Live migration (decode_node/migration.py): a router's Migrate moves a decoding request to another
decode node over the same transport (precopy of its full pages, then a short pause for the rest);
this node is the source of some migrations and the target of others. Draining (SIGTERM, or a
router's Drain) refuses new headers; a router moves the node's requests away while it drains.

The decode node never saw the prompt being admitted: it *inherits* the pages. Whether to take
them is decided here, by `fairness` policies, against this node's own pool.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import Counter, OrderedDict

from pdtb.common import host_port
from pdtb.nodes import kv_meta
from pdtb.nodes.arrival import to_sampling
from pdtb.nodes.node_base import NodeBase
from pdtb.nodes.protocol import HandoffNotice, Migrate, ProtocolError, handoff_meta
from decode_node.migration import INJECT, STAGE_SUFFIX, Migrations
from decode_node.placement import Inherited, place
from kv_transport import ReceivedTransfer, TransferMeta, TransportConfig, make_receiver
from pdtb.nodes.kv_senders import KVSenders
from kv_transport.admission import Admission, Verdict
from kv_transport.fail_codes import FailCode
from pdtb.engine.scheduler import StepEvent
from pdtb.engine.prefix_hash import page_hashes
from pdtb.engine.sequence import Sequence

log = logging.getLogger(__name__)
ABORTED_MEMORY = 4096  # request ids remembered as aborted, for transfers that land afterwards
REPORTED_REQUESTS = 64  # largest requests listed in NodeStats.extra["requests"] (what a rebalancer moves)
DEFERRED_KEPT = 65536  # deferred request ids remembered, so a retried one counts once


def _router_of(t: ReceivedTransfer) -> str:
    """The router to tell about a transfer whose metadata may not validate."""
    router = t.extra.get("router_id", "") if isinstance(t.extra, dict) else ""
    return router if isinstance(router, str) else ""


def _inherited(header, meta, request_id: str) -> Inherited:
    """What a transfer header tells placement about its request (a migration's stage: `request_id`
    is the request's own id, not the stage's)."""
    return Inherited(request_id, header.tenant, meta.priority, meta.slo_tier, header.num_pages + header.skip_pages,
                     header.num_tokens, len(header.prompt_token_ids), len(header.output_token_ids),
                     meta.params.max_tokens)


class DecodeNode(NodeBase):
    moves_kv = True

    def __init__(self, config, engine=None, transport: TransportConfig | None = None) -> None:
        super().__init__(config, engine)
        self.transport = transport or config.transport_config(endpoint=f"tcp://{host_port(config.host, config.kv_port)}")
        self.receiver = None
        self.aborted: OrderedDict[str, float] = OrderedDict()
        self.senders = KVSenders(self.transport, self.engine.spec)  # migrations out
        self.migrations = Migrations(self, config.migration_timeout_s)
        self.admissions: Counter[str] = Counter()  # hand-off headers' verdicts (_count_admission)
        self._deferred: OrderedDict[str, None] = OrderedDict()  # requests deferred so far (the latest)

    def _admit(self, header) -> Admission:
        """Header-only decision (before any payload byte): accept, park in the host tier,
        refuse for good (TOO_LARGE, DRAINING, BAD_METADATA: the prefill side moves the request
        or fails it), or defer (NO_PAGES: the prefill side keeps the pages and retries:
        backpressure, nothing is lost)."""
        if self.draining:
            return Admission.refuse(FailCode.DRAINING, "the decode node is shutting down")
        bad = kv_meta.check(header)
        if bad:
            return Admission.refuse(FailCode.BAD_METADATA, bad)
        try:
            meta = handoff_meta(header.extra)
        except ProtocolError as e:
            return Admission.refuse(FailCode.BAD_METADATA, str(e))
        if meta.migration:
            return self._admit_migration(header, meta)
        req = _inherited(header, meta, header.request_id)
        answer = place(req, self.engine.scheduler, self.policy, can_park=self.receiver is None or self.receiver.accepts_other_pools)
        self._count_admission(header.request_id, answer.verdict)
        return answer

    def _count_admission(self, rid: str, verdict: Verdict) -> None:
        """Per verdict, requests (a deferred one is retried: `defer` counts each request once,
        `defer_answers` every answer)."""
        if verdict is Verdict.DEFER:
            self.admissions["defer_answers"] += 1
            if rid in self._deferred:
                return
            self._deferred[rid] = None
            while len(self._deferred) > DEFERRED_KEPT:
                self._deferred.popitem(last=False)
        self.admissions[verdict.value] += 1

    def _admit_migration(self, header, meta) -> Admission:
        """A live migration's precopy or final header. It lands in the device tier only (it is
        decoding); the policy decides at the first of the two, the final takes what is staged."""
        rid = header.request_id.removesuffix(STAGE_SUFFIX)
        if meta.migration == "final":
            verdict = self._admit_final(header, meta, rid)
            if verdict.verdict is not Verdict.ACCEPT:
                self.migrations.claim(rid)  # refused: nothing can share its stage now, so it lets go at once
            return verdict
        if meta.migration != "precopy":
            return Admission.refuse(FailCode.BAD_METADATA, f"unknown migration phase {meta.migration!r}")
        # An abort remembered from when this node was told to drop a copy (the other end of an
        # earlier move held it) must not drop the request now: a client's abort reaches the
        # source too, which then cancels this migration.
        self.aborted.pop(rid, None)
        return self._place_migrated(header, meta, rid)

    def _admit_final(self, header, meta, rid: str) -> Admission:
        """A final header: taken where its precopy staged pages here, else placed whole."""
        if meta.inject == "target_exits":
            log.error("fault injected: the target exits at the final header of %s", rid)
            os._exit(17)
        if meta.inject == "refuse_final":
            return Admission.defer("fault injected: the target refuses the final transfer")
        if rid in self.seqs:
            return Admission.defer(f"request {rid} is here already")
        if rid in self.aborted:  # (refused before any byte lands: the source still holds it)
            return Admission.defer(f"request {rid} was aborted here")
        if self.engine.pool.num_held(rid + STAGE_SUFFIX):
            return Admission.accept()  # admitted at its precopy; the receiver checks the pages it needs
        return self._place_migrated(header, meta, rid)

    def _place_migrated(self, header, meta, rid: str) -> Admission:
        req = _inherited(header, meta, rid)
        verdict = place(req, self.engine.scheduler, self.policy, can_park=False)
        if verdict.verdict is not Verdict.ACCEPT:
            self.policy.forget(rid)  # the source keeps it: not an arrival this node owes room
            if verdict.verdict is not Verdict.REFUSE:
                return Admission.defer(f"no room for a migrated request: {verdict.reason}")
        return verdict

    async def start_extra(self) -> None:
        kw = {"context": self.ctx} if self.transport.backend in ("zmq", "shm", "auto") else {}  # the ZAP handler lives in self.ctx
        self.receiver = make_receiver(self.transport, self.engine.pool, admit=self._admit, **kw)
        sch = self.engine.scheduler
        if sch.prefix_ns is not None:
            ps, ns = self.engine.spec.page_size, sch.prefix_ns
            self.receiver.prefix_hashes = lambda tokens, n: page_hashes(tokens[:n * ps], ps, ns)
        await self.receiver.start()
        self.kv_addr = self.receiver.endpoint

    async def close_extra(self) -> None:
        await self.senders.close()
        self.migrations.free_stages()
        if self.receiver is None:
            return
        await self.receiver.close()  # frees the pages of transfers still in flight (NACKed)
        left = self.receiver.take_completed()  # committed after the drain's last look
        for t in left:
            self._free_landed(t)
            if t.request_id.endswith(STAGE_SUFFIX):  # a migration's stage is no request: its source goes on
                continue
            self.routes[t.request_id] = _router_of(t)
            self.fail(t.request_id, "node shut down before the request started")
        if left:
            await self.sink.flush()

    def on_generate(self, req) -> None:
        self.fail(req.request_id, "decode nodes take requests only through the KV transport")

    async def poll_io(self) -> None:
        for t in self.receiver.take_completed():
            self._adopt(t)
        await self.migrations.poll()

    # ---- migrations (decode_node/migration.py) ----------------------------------------------------
    def on_migrate(self, msg: Migrate, router_id: str) -> None:
        if msg.inject and msg.inject not in INJECT:
            msg = dataclasses.replace(msg, inject="")
        self.migrations.start(msg, router_id)

    async def send_kv(self, addr: str, export, meta: TransferMeta) -> str:
        """Send `export` (sealed with `meta`) to the decode node at `addr`: a transfer id."""
        h = export.header
        return (await self.senders.get(addr)).send(export, kv_meta.seal(meta, h.request_id, h.num_tokens, h.num_pages,
                                                                        h.skip_pages))

    def let_go(self, request_id: str) -> None:
        """The request moved to another node: forget it here, with no event."""
        self._end_id(request_id)
        self.migrations.arrived.pop(request_id, None)

    async def exit_after_flush(self, why: str) -> None:
        """Fault injection: die right here, once what was sent has had a moment to leave."""
        log.error("%s", why)
        await self.sink.flush()
        await asyncio.sleep(0.2)
        os._exit(17)

    def _free_landed(self, t: ReceivedTransfer) -> None:
        """Free the pages of a landed transfer that will not be adopted, in the tier it landed
        in (a parked arrival's pages are in the host tier: freeing the device tier instead would
        leave them owned by a request that no longer exists)."""
        pool = self.engine.host_pool if t.tier == "host" and self.engine.host_pool is not None else self.engine.pool
        pool.free(t.request_id)

    def _adopt(self, t: ReceivedTransfer) -> None:
        self.metrics.kv_recv.inc(t.status.bytes_total)
        nbytes = t.status.bytes_total
        self.metrics.transfers.labels(outcome="received", **self.metrics.labels).inc()
        if t.request_id in self.aborted or t.request_id in self.seqs:
            log.info("dropping pages of %s: request already aborted or present", t.request_id)
            self._free_landed(t)
            return
        try:  # validated at the header already (_admit); a transfer admitted otherwise is checked here
            meta = handoff_meta(t.extra)
            seq = Sequence(t.request_id, list(t.prompt_token_ids) + list(t.output_token_ids),
                           len(t.prompt_token_ids), to_sampling(meta.params), tenant=t.tenant, priority=meta.priority,
                           slo_tier=meta.slo_tier, num_computed_tokens=t.num_computed_tokens)
        except ValueError as e:  # ProtocolError, or parameters the engine refuses
            self._free_landed(t)
            self.routes[t.request_id] = _router_of(t)
            self.fail(t.request_id, f"bad request metadata from prefill: {e}")
            return
        if meta.migration == "precopy":  # staged: claimed by the final transfer, or freed at its lease's end
            self.migrations.staged_in(t.request_id)
            self.acct.add_bytes(seq, "migrated_in", nbytes)
            self.acct.forget(t.request_id)  # (metered per tenant; the stage is not a request)
            return
        self.routes[t.request_id] = meta.router_id
        now = time.time()
        seq.timeline = tl = meta.timeline
        self.seqs[seq.request_id] = seq
        if meta.migration == "final":
            self.migrations.claim(seq.request_id)  # its staged pages: shared by the request now
            self.migrations.adopted(seq, meta, nbytes)
            sch = self.engine.scheduler
            # its age and place in line come with it: victim choices (newest, lru) and aging see
            # the request the source had, not a newcomer
            seq.arrival_time, seq.last_step, seq.num_cached_tokens = time.monotonic() - meta.age_s, sch.num_steps, 0
            self.acct.add_bytes(seq, "migrated_in", nbytes)
            self.engine.scheduler.add_running(seq)
            self.sink.notice(meta.router_id, HandoffNotice(seq.request_id, self.config.node_id, True,
                                                           meta.migration_id, len(seq.output_token_ids)))
            return
        tl.transfer_end = tl.decode_admit = now
        tl.last_token = tl.first_token if tl.first_token is not None else now
        self.acct.add_received(seq, nbytes)
        self._count_prefix(seq, t)  # (its page hashes are this node's own, from its tokens, when needed)
        if t.tier == "host":
            tl.parked_since = now
            self.engine.scheduler.add_parked(seq)
        else:
            self.engine.scheduler.add_running(seq)
        # Tell the router this node holds the request now: it no longer depends on its prefill
        # node, which may exit (a drain, a scale-down) before this request's first decode step,
        # which can be far off for a parked or held-back one.
        self.sink.notice(self.routes[seq.request_id], HandoffNotice(seq.request_id, self.config.node_id, True))

    def _count_prefix(self, seq: Sequence, t: ReceivedTransfer) -> None:
        """Prompt tokens handed off, and those whose pages came from this node's cache (not
        sent), per tenant; the bytes not sent are metered as kind "cached"."""
        sch = self.engine.scheduler
        if sch.prefix_ns is None:
            return
        ps = self.engine.spec.page_size
        seq.num_cached_tokens = min(t.skip_pages * ps, seq.num_prompt_tokens)
        sch.prefix.count(seq.tenant, seq.num_prompt_tokens, seq.num_cached_tokens)
        if t.skip_pages:
            self.acct.add_bytes(seq, "cached", t.skip_pages * self.engine.pool.bytes_per_page)

    def on_step_events(self, events: list[StepEvent], t: float) -> None:
        now = time.time()
        mig = self.migrations
        for ev in events:
            tl = ev.seq.timeline
            if mig.arrived:
                mig.first_token(ev.seq, now)
            if ev.finished and mig.out:
                mig.forget(ev.seq.request_id, "it finished")
            self.metrics.itl.observe(now - (tl.last_token or now))
            tl.last_token = now
            self.metrics.gen_tokens.inc()
            self.emit(ev.seq, [ev.token_id], ev.finished)

    def on_abort(self, request_id: str, reason: str) -> None:
        self.policy.forget(request_id)  # a held arrival given up: no longer in line
        self.aborted[request_id] = time.monotonic()
        while len(self.aborted) > ABORTED_MEMORY:
            self.aborted.popitem(last=False)
        self.migrations.arrived.pop(request_id, None)
        self.migrations.claim(request_id)  # a stage of it lets go
        if self.migrations.forget(request_id, reason):  # paused mid-migration: not in the scheduler
            self.engine.pool.free(request_id)
            self.let_go(request_id)
            return
        super().on_abort(request_id, reason)

    def idle(self) -> bool:
        # transfers landing, landed and not yet adopted, and migrations out count as work: a drain
        # that looked past a landed one would adopt it in abort_all only to fail it
        rx = self.receiver
        return super().idle() and (rx is None or not (rx.num_reserved_pages or rx.num_landed)) and not self.migrations.out

    def abort_all_paused(self, reason: str) -> None:
        """Requests paused mid-migration are in no scheduler queue: fail them too."""
        for rid in list(self.migrations.out):
            if self.migrations.forget(rid, reason):
                self.engine.pool.free(rid)
                self.fail(rid, reason)

    def abort_all(self, reason: str) -> None:
        for t in self.receiver.take_completed() if self.receiver else ():  # landed since the last poll
            self._adopt(t)
        self.abort_all_paused(reason)
        super().abort_all(reason)

    def extra_stats(self) -> dict:
        sch, pool = self.engine.scheduler, self.engine.pool
        big = sorted(((pool.num_held(s.request_id), s.request_id, s.tenant) for s in sch.running), reverse=True)
        waiting = Counter(s.tenant for s in (*sch.parked, *sch.waiting))
        waiting.update(a.tenant for a in self.policy.waiting_arrivals(sch.state()))  # (those still retried here)
        return {"reserved_pages": pool.state_counts()["reserved"],
                # what a rebalancer moves (pdtb/router/rebalance.py): the largest decoding requests,
                # and per tenant, requests that wait here (parked, queued, or held at a prefill node)
                "requests": [[rid, tenant, n] for n, rid, tenant in big[:REPORTED_REQUESTS]],
                "tenant_waiting": dict(waiting), "admissions": dict(self.admissions), **self.migrations.stats()}


