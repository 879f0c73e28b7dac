"""Live migration of a decoding request between decode nodes: both ends of the protocol.

    source                                               target
    Migrate(request, target) from the router
    PRECOPY: full pages [0, k) as "<id>#pre"  ──────▶    admitted like any inherited request;
             (the request keeps decoding)                 staged, registered by page hash; leased
    on DONE: pause (detach from the batch)
    FINAL:   pages [k, n) + tokens + state    ──────▶    header shares the staged pages by hash
             (skip_pages = k, sealed)                     (prefix-cache path), reserves the rest;
                                                          on commit: adopt, drop the stage,
                                                          HandoffNotice(migration_id, output_tokens)
    on DONE (the target confirmed): free the pages,      first token: MigrationReport(downtime)
    MigrationReport(ok)

Every step can fail, and each failure leaves the request on one node:
- precopy refused, lost (timeout), cancelled: the request never paused; it goes on at the source.
  A stage that landed nowhere useful is freed at the target when its lease runs out.
- final refused, lost (timeout), target gone: the source resumes the request (it still holds
  every page). A `cache_miss` (a staged page was taken back) resends every page at once.
- the target adopted but its confirmation was lost: both hold it. The router keeps whichever it
  heard from first with the right token count and tells the other to drop it (pdtb/router/registry.py).
- the source dies: the target adopts if the final transfer landed, else the router recomputes.
- the request ends (finished, aborted) during the precopy: the transfer is cancelled.

Without a prefix cache at both ends (`--prefix-cache off`), or with page hashes of different
namespaces, there is nothing to share staged pages by, so a migration is one stop-and-copy
transfer of every page.

`inject` (tests, chaos runs; the Migrate message's field) makes one step fail on purpose:
"lose_precopy" and "lose_final" send nothing and wait out the migration timeout; "refuse_final"
has the target refuse the final header; "target_exits" ends the target process at the final
header (the target dies mid-migration); "exit_after_final" ends the source process right after
it sent the final transfer (the source dies mid-migration).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from kv_transport import TransferMeta, TransferState
from kv_transport.fail_codes import FailCode
from pdtb.engine.kv_export import export_request
from pdtb.engine.sequence import Sequence, SeqStatus
from pdtb.nodes.arrival import to_params
from pdtb.nodes.protocol import MIGRATE_INJECT, HandoffMeta, Migrate, MigrationReport, to_extra

log = logging.getLogger(__name__)
STAGE_SUFFIX = "#pre"  # owner of a precopy's pages at the target until the final transfer claims them
INJECT = MIGRATE_INJECT


def stage_owner(request_id: str) -> str:
    return request_id + STAGE_SUFFIX


@dataclass
class Outbound:
    """One migration, at its source."""

    msg: Migrate
    router: str  # the router that asked: where the report goes
    seq: Sequence
    started: float  # monotonic
    deadline: float  # monotonic: the current phase fails after this
    phase: str = "precopy"  # "precopy" | "final"
    transfer_id: str | None = None
    skip_pages: int = 0  # pages the precopy staged (the final transfer leaves them out)
    precopy_bytes: int = 0
    precopy_s: float = 0.0
    paused_at: float = 0.0  # wall clock
    final_started: float = 0.0  # monotonic
    to_send: bool = True  # the current phase's transfer is still to start (poll sends it)


class Migrations:
    """The decode node's migrations out (as source) and stages in (as target)."""

    def __init__(self, node, timeout_s: float) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.out: dict[str, Outbound] = {}  # request id -> migration under way from here
        self.staged: dict[str, float] = {}  # stage owner -> monotonic lease end (target side)
        self.arrived: dict[str, tuple[str, str, str, float, dict]] = {}  # request id -> (migration id, source, router, paused_at, report fields)
        self.done = {"out_ok": 0, "out_failed": 0, "in": 0}

    # ---- source ---------------------------------------------------------------------------------
    def start(self, msg: Migrate, router: str) -> None:
        node, rid = self.node, msg.request_id
        seq = node.seqs.get(rid)
        sch = node.engine.scheduler
        why = None
        if seq is None:
            why = "the request is not on this node"
        elif rid in self.out:
            why = "a migration of the request is under way"
        elif seq not in sch.running:
            why = "the request is not decoding in the device tier (parked or waiting)"
        elif msg.target.node_id == node.config.node_id or not msg.target.kv_addr:
            why = "the target is this node, or has no KV address"
        if why:
            self._report(msg, router, False, why, "precopy")
            return
        now = time.monotonic()
        o = Outbound(msg, router, seq, now, now + self.timeout_s)
        self.out[rid] = o
        full = seq.num_computed_tokens // node.engine.spec.page_size
        # stage what is full already and will not change; the tail (at least one page) goes in the final
        if sch.prefix_ns is None or sch.prefix_ns != msg.target_prefix_ns or full < 2:
            self._pause(o)
        else:
            o.skip_pages = full

    async def _send(self, o: Outbound) -> None:
        node, seq = self.node, o.seq
        rid, inject = seq.request_id, o.msg.inject
        o.to_send = False
        if seq not in node.engine.scheduler.running and o.phase == "precopy":
            self._fail(o, "the request left the device tier before its precopy", "precopy")
            return
        if o.phase == "precopy":
            if inject == "lose_precopy":
                return  # nothing sent: the phase times out
            ps = node.engine.spec.page_size
            meta = self._meta(o, "precopy", o.skip_pages * ps, node.engine.scheduler.hashes_of(seq, o.skip_pages))
            export = export_request(node.engine.pool, rid, o.skip_pages * ps)
            export = dataclasses.replace(export, header=dataclasses.replace(export.header, request_id=stage_owner(rid)))
            o.transfer_id = await node.send_kv(o.msg.target.kv_addr, export, meta)
            return
        need = node.engine.spec.pages_for(seq.num_computed_tokens)
        o.skip_pages = skip = min(o.skip_pages, need - 1)
        meta = self._meta(o, "final", seq.num_computed_tokens, node.engine.scheduler.hashes_of(seq, skip) if skip else [])
        if inject == "lose_final":
            return
        export = export_request(node.engine.pool, rid, seq.num_computed_tokens, skip)
        o.transfer_id = await node.send_kv(o.msg.target.kv_addr, export, meta)
        if inject == "exit_after_final":
            await node.exit_after_flush(f"fault injected: the source exits after sending the final transfer of {rid}")

    def _meta(self, o: Outbound, kind: str, num_tokens: int, hashes: list[int]) -> TransferMeta:
        node, seq = self.node, o.seq
        rid = seq.request_id
        hm = HandoffMeta(node.routes.get(rid, ""), to_params(seq.params), seq.priority, seq.timeline,
                         slo_tier=seq.slo_tier, migration=kind, migration_id=o.msg.migration_id, inject=o.msg.inject,
                         migration_from=node.config.node_id, paused_at=o.paused_at,
                         precopy_bytes=o.precopy_bytes, precopy_s=o.precopy_s,
                         age_s=max(0.0, time.monotonic() - seq.arrival_time))
        return TransferMeta(tenant=seq.tenant, prompt_token_ids=seq.prompt_token_ids,
                            output_token_ids=seq.output_token_ids, num_computed_tokens=num_tokens,
                            extra=to_extra(hm), page_hashes=hashes)

    def _pause(self, o: Outbound) -> None:
        """Stop stepping the request and send the rest of its KV (the final transfer)."""
        node, seq = self.node, o.seq
        sch = node.engine.scheduler
        if seq not in sch.running:  # demoted or preempted during the precopy: try again later
            self._fail(o, "the request left the device tier during the precopy", "precopy")
            return
        sch.detach(seq)
        o.phase, o.paused_at, o.final_started = "final", time.time(), time.monotonic()
        o.deadline = o.final_started + self.timeout_s
        seq.timeline.end_wait("turn_wait", o.paused_at)  # the pause is the migration's, not a turn's
        seq.timeline.start_wait("migrating", o.paused_at)
        o.to_send = True

    async def poll(self) -> None:
        """Move every migration out forward (between engine steps: no step reads or writes a
        paused request's pages while they are exported)."""
        self.expire()
        now = time.monotonic()
        for rid, o in list(self.out.items()):
            if o.to_send:
                try:
                    await self._send(o)
                except Exception as e:  # a sender that cannot start or send: the request stays here
                    log.warning("migration of %s to %s: %s", rid, o.msg.target.node_id, e, exc_info=True)
                    self.node.senders.drop(o.msg.target.kv_addr)
                    if self.out.get(rid) is o:
                        self._fail(o, f"could not send: {e}", o.phase)
                    continue
                if self.out.get(rid) is not o:  # ended (aborted, finished) during the send
                    continue
            st = self.node.senders.poll(o.msg.target.kv_addr, o.transfer_id) if o.transfer_id else None
            if st is not None and st.state.finished:
                o.transfer_id = None
                if st.state == TransferState.DONE:
                    self._phase_done(o, st)
                elif o.phase == "final" and st.code is FailCode.CACHE_MISS and o.skip_pages:
                    o.skip_pages, o.to_send = 0, True  # a staged page was taken back there: send every page
                    o.deadline = time.monotonic() + self.timeout_s
                else:
                    self._fail(o, f"{st.code}: {st.reason}", o.phase)
            elif now > o.deadline:
                if o.transfer_id:
                    self.node.senders.cancel(o.msg.target.kv_addr, o.transfer_id, "migration timed out")
                    o.transfer_id = None
                self._fail(o, f"{o.phase} not done after {self.timeout_s:g} s", o.phase)

    def _phase_done(self, o: Outbound, st) -> None:
        if o.phase == "precopy":
            o.precopy_bytes, o.precopy_s = st.bytes_total, time.monotonic() - o.started
            self._pause(o)
            return
        node, seq = self.node, o.seq
        rid = seq.request_id
        self.out.pop(rid, None)
        pages = node.engine.pool.num_held(rid)
        self._report(o.msg, o.router, True, "", "final", precopy_bytes=o.precopy_bytes, final_bytes=st.bytes_total,
                     precopy_s=o.precopy_s, final_s=time.monotonic() - o.final_started, pages=pages,
                     output_tokens=len(seq.output_token_ids))
        node.engine.pool.free(rid)  # the target confirmed: the request is its now
        node.acct.add_bytes(seq, "migrated_out", o.precopy_bytes + st.bytes_total)
        node.let_go(rid)
        self.done["out_ok"] += 1

    def _fail(self, o: Outbound, why: str, phase: str) -> None:
        node, seq = self.node, o.seq
        rid = seq.request_id
        self.out.pop(rid, None)
        self.done["out_failed"] += 1
        resumed = (o.phase == "final" and rid in node.seqs and seq.status == SeqStatus.RUNNING
                   and seq not in node.engine.scheduler.running)
        if resumed:  # it still holds every page here: decode on
            seq.timeline.end_wait("migrating", time.time())
            node.engine.scheduler.add_running(seq)
        log.info("migration of %s to %s failed (%s): %s", rid, o.msg.target.node_id, phase, why)
        self._report(o.msg, o.router, False, why, "resumed" if resumed else phase)

    def forget(self, request_id: str, reason: str) -> bool:
        """The request ended here (aborted, finished) during its migration: cancel the transfer.
        True when it was paused (not in the scheduler): the caller frees its pages."""
        o = self.out.pop(request_id, None)
        if o is None:
            return False
        if o.transfer_id:
            self.node.senders.cancel(o.msg.target.kv_addr, o.transfer_id, reason)
        self.done["out_failed"] += 1
        self._report(o.msg, o.router, False, f"the request ended during its migration: {reason}", o.phase)
        return o.phase == "final"

    def _report(self, msg: Migrate, router: str, ok: bool, reason: str, phase: str, **kw) -> None:
        node = self.node
        node.sink.migration(router, MigrationReport(msg.migration_id, msg.request_id, node.config.node_id,
                                                    msg.target.node_id, ok, reason, phase, **kw))

    # ---- target -----------------------------------------------------------------------------------
    def staged_in(self, owner: str) -> None:
        self.staged[owner] = time.monotonic() + 2 * self.timeout_s  # (the final header, which shares the stage, follows the precopy at once)

    def _let_go(self, owner: str) -> None:
        if self.staged.pop(owner, None) is not None:
            self.node.engine.pool.free(owner)

    def claim(self, request_id: str) -> None:
        """The final transfer of `request_id` landed (or failed for good): its stage lets go."""
        self._let_go(stage_owner(request_id))

    def free_stages(self) -> None:
        """Shutting down: every stage lets go."""
        for owner in list(self.staged):
            self._let_go(owner)

    def expire(self) -> None:
        now = time.monotonic()
        for owner in [o for o, until in self.staged.items() if now > until]:
            self._let_go(owner)
            log.info("stage %s expired: its final transfer never came", owner)

    def adopted(self, seq: Sequence, meta: HandoffMeta, nbytes: int) -> None:
        """A migrated request landed here (the final transfer): remember it for its first token."""
        self.done["in"] += 1
        self.arrived[seq.request_id] = (meta.migration_id, meta.migration_from, meta.router_id, meta.paused_at,
                                        {"precopy_bytes": meta.precopy_bytes, "final_bytes": nbytes,
                                         "precopy_s": meta.precopy_s})

    def first_token(self, seq: Sequence, now: float) -> None:
        entry = self.arrived.pop(seq.request_id, None)
        if entry is None:
            return
        mid, source, router, paused_at, kw = entry
        seq.timeline.end_wait("migrating", now)
        down = max(0.0, now - paused_at) if paused_at else 0.0
        node = self.node
        node.sink.migration(router, MigrationReport(mid, seq.request_id, source, node.config.node_id, True, "",
                                                    "resumed", downtime_s=down, **kw))

    def stats(self) -> dict:
        return {"migrations_out": len(self.out), "migrations_staged": len(self.staged), **self.done}

