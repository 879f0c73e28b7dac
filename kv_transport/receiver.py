"""Receiver state machine: validates, reserves pages, writes payloads into them, commits.

Path of one inbound transfer:

    header ──validate──> admit(header)? ──pool.reserve(request_id, n)──> pages RESERVED
      │ refused / no pages: NACK, nothing held                            │
      ├─ inline: payload in the same message: verify, write, commit, ACK  │
      └─ chunked: Credit(window) ─> chunks, each summed and written into the pages
                  piece by piece, then verified (running checksum) ─> last: commit, ACK
      any failure (bad chunk, checksum, Cancel, idle/total timeout, close):
                  pool.free(pages) first, then NACK

Chunks land in pool memory by whole (layer, k/v, page) slabs (page_writer.PageWriter):

    payload  [layer, kv, i, slot, head, dim]  row r = (layer*2 + kv) * n + i
    pool.kv  [layer, kv, page, slot, head, dim] row   (layer*2 + kv) * P + pages[i]

One task (`_serve`) owns the socket: it reads, dispatches, checks timeouts every tick and
flushes the outbox; nothing else sends.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from kv_transport import checksum
from kv_transport.admission import Verdict
from kv_transport.base import ReceivedTransfer, TransferState, TransferStatus
from kv_transport.config import TransportConfig
from kv_transport.endpoint_core import EndpointCore
from kv_transport.fail_codes import FailCode
from kv_transport.malloc_tuning import keep_freed_memory
from kv_transport.page_writer import PageWriter, WritePlan
from kv_transport.wire import (STREAMED, Ack, AdmitFn, Cancel, Credit, KVChunk, KVTransferHeader, Nack,
                               TransferBatch, WireError, decode, encode)
from pdtb.engine.page_pool import PagePool, PoolError


log = logging.getLogger(__name__)
S = TransferState


@dataclass
class _Inbound:
    header: KVTransferHeader
    peer: bytes | None  # where replies go
    pages: list[int]  # RESERVED under header.request_id until commit or free
    pool: PagePool  # the tier receiving it (the device pool, or the host pool when parked)
    writer: PageWriter  # that pool's writer
    status: TransferStatus
    deadline: float  # total timeout
    last_seen: float  # for the idle timeout
    next_chunk: int = 0
    running: int = 0  # running checksum of the chunks received
    owed: int = 0  # credits earned by consumed chunks, not yet returned
    granted: int = 0  # chunks [0, granted) the sender may send (the last Credit's upto)
    shared: list[int] = field(default_factory=list)  # cached pages it shares (skip_pages), ahead of `pages`
    _plan: WritePlan | None = field(default=None, repr=False)

    @property
    def plan(self) -> WritePlan:
        """Where each payload row goes in the pool (see page_writer), made on first use: a
        one-sided transfer's Grant goes out without it (its first Commit makes it)."""
        if self._plan is None:
            self._plan = self.writer.plan(self.pages)
        return self._plan


class ReceiverCore(EndpointCore):
    """Backend-independent receiver. See the module docstring."""

    role = "receiver"

    def __init__(self, config: TransportConfig, pool: PagePool, admit: AdmitFn | None = None):
        super().__init__(config, pool.spec)
        self.pool = pool
        self.endpoint = config.endpoint
        self._admit = admit
        self._writer = PageWriter(pool)
        self._writers: dict[int, PageWriter] = {id(pool): self._writer}  # per receiving pool
        self._live: dict[str, _Inbound] = {}
        self._by_request: dict[str, str] = {}  # request_id -> transfer in flight
        self._completed: collections.deque[ReceivedTransfer] = collections.deque()
        self._completed_evt: asyncio.Event | None = None
        self._outbox: collections.deque[tuple[bytes | None, object, str, list]] = \
            collections.deque()

    # ---- public API (see base.KVReceiver) --------------------------------------------------
    async def start(self) -> None:
        self._completed_evt = asyncio.Event()
        self._prepare()
        await self._start_tasks(self._serve())

    def _prepare(self) -> None:
        if self.config.tune_malloc:
            keep_freed_memory()

    def poll(self, transfer_id: str) -> TransferStatus | None:
        inb = self._live.get(transfer_id)
        st = inb.status if inb is not None else self._history.get(transfer_id)
        return None if st is None else st.snapshot()

    def take_completed(self) -> list[ReceivedTransfer]:
        out = list(self._completed)
        self._completed.clear()
        return out

    async def next_completed(self, timeout: float) -> ReceivedTransfer | None:
        deadline = time.monotonic() + timeout
        while not self._completed:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._completed_evt.clear()
            try:
                await asyncio.wait_for(self._completed_evt.wait(), left)
            except asyncio.TimeoutError:
                return None
        return self._completed.popleft()

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        inb = self._live.get(transfer_id)
        if inb is not None:
            self._fail(inb, FailCode.CANCELLED, reason)

    async def close(self) -> None:
        self._closing = True  # headers arriving during the flush below are refused, not reserved
        self._fail_all("receiver closed")
        try:
            await asyncio.wait_for(self._flush(), self.config.close_timeout_s)
        except Exception:  # best effort on the way out; the pages are already free
            log.debug("receiver: could not flush NACKs on close", exc_info=True)
        await self._stop_tasks()
        self._fail_all("receiver closed")  # anything accepted despite the flag: never left reserved

    @property
    def num_reserved_pages(self) -> int:
        return sum(len(i.pages) for i in self._live.values())

    @property
    def num_landed(self) -> int:
        """Transfers completed and not yet taken (`take_completed`): requests the node holds
        committed pages for but has not adopted yet."""
        return len(self._completed)

    # ---- serve loop -------------------------------------------------------------------------
    async def _serve(self) -> None:
        next_check = 0.0
        while True:
            got = await self._read(self.config.tick_s)
            if got is not None:
                await self._dispatch(*got)
                got = None  # free the zmq buffer now, not after the next message arrives
            now = time.monotonic()
            if now >= next_check:
                self._expire(now)
                next_check = now + self.config.tick_s
            await self._flush()

    async def _flush(self) -> None:
        while self._outbox:
            peer, msg, kind, owners = self._outbox.popleft()
            await self._emit(encode(msg), kind, owners, peer)

    def _reply(self, peer: bytes | None, msg, kind: str, owners: list | None = None) -> None:
        self._outbox.append((peer, msg, kind, owners or []))

    async def _emit_failed(self, owners: list, reason: str) -> None:
        for inb in owners:
            if inb.status.transfer_id in self._live:
                self._fail(inb, FailCode.PEER_LOST, reason, nack=False)

    async def _dispatch(self, peer: bytes | None, frames: list) -> None:
        try:
            d = decode(frames, self.limits)
        except WireError as e:
            self._on_bad_message(peer, e)
            return
        m = d.msg
        if isinstance(m, KVTransferHeader):
            if self._accept(peer, m, d.payloads[0] if d.payloads else None):
                self._reply(peer, Ack([m.transfer_id]), "ack")
        elif isinstance(m, TransferBatch):
            acked = [h.transfer_id for h, p in zip(m.headers, d.payloads)
                     if self._accept(peer, h, p)]
            if acked:
                self._reply(peer, Ack(acked), "ack")
        elif isinstance(m, KVChunk):
            if self._foreign(peer, m.transfer_id, "chunk"):
                return
            await self._on_chunk(m, d.payloads[0])
        elif isinstance(m, Cancel):
            inb = self._live.get(m.transfer_id)
            if inb is None:
                log.info("receiver: late cancel for %s discarded", m.transfer_id)
            elif self._foreign(peer, m.transfer_id, "cancel"):
                return
            else:
                self._fail(inb, FailCode.CANCELLED, f"sender cancelled: {m.reason}", nack=False)
        else:
            self._on_other(peer, m)

    def _on_other(self, peer: bytes | None, m) -> None:
        """A message type this backend does not take (backends extend it)."""
        log.warning("receiver: unexpected %s from %r discarded", type(m).__name__, peer)

    def _foreign(self, peer: bytes | None, transfer_id: str, kind: str) -> bool:
        """A chunk, Cancel or malformed message for a live transfer from another connection than
        its header's: discarded (only the sender that announced a transfer may feed or end it)."""
        inb = self._live.get(transfer_id)
        if inb is None or peer is None or inb.peer is None or peer == inb.peer:
            return False
        log.warning("receiver: %s for %s from another connection than its header's discarded", kind, transfer_id)
        return True

    def _on_bad_message(self, peer: bytes | None, e: WireError) -> None:
        log.warning("receiver: bad message from %r discarded: %s", peer, e)
        for tid in e.batch_ids:  # a bad batch: every transfer in it fails now
            if tid not in self._history and tid not in self._live:
                self._reply(peer, Nack(tid, FailCode.BAD_MESSAGE, str(e)), "nack")
        tid = e.transfer_id
        if tid is None or tid in e.batch_ids or tid in self._history or self._foreign(peer, tid, "bad message"):
            return
        inb = self._live.get(tid)
        if inb is not None:
            self._fail(inb, FailCode.BAD_MESSAGE, str(e))
        else:  # a header we cannot accept: tell the sender now instead of letting it time out
            self._reply(peer, Nack(tid, FailCode.BAD_MESSAGE, str(e)), "nack")

    # ---- accepting a transfer ---------------------------------------------------------------
    def _accept(self, peer: bytes | None, h: KVTransferHeader, payload: memoryview | None) -> bool:
        """Reserve pages for `h`; for inline payloads also write and commit. True: ACK it."""
        tid = h.transfer_id
        if tid in self._live or tid in self._history:
            log.info("receiver: duplicate header for %s discarded", tid)
            return False
        now = time.monotonic()
        status = TransferStatus(tid, h.request_id, S.WAITING, bytes_total=h.payload_bytes,
                                t_created=now)
        refusal, target = self._refusal(h)
        shared: list[int] = []
        if refusal is None and h.skip_pages:
            refusal, shared = self._share_cached(h, target)
        pages = None if refusal else target.reserve(h.request_id, h.num_pages)
        if pages is None:
            if shared:
                target.free(h.request_id, shared)
            code, reason = refusal or (FailCode.NO_PAGES, f"need {h.num_pages} pages, {target.num_free} free")
            self._finish_status(status, S.FAILED, reason, code)
            self._reply(peer, Nack(tid, code, reason), "nack")
            return False
        writer = self._writers.get(id(target))
        if writer is None:
            writer = self._writers[id(target)] = PageWriter(target)
        inb = _Inbound(h, peer, pages, target, writer, status,
                       now + self.config.transfer_timeout_s, now, shared=shared)
        self._live[tid] = inb
        self._by_request[h.request_id] = tid
        if h.mode == "inline":
            status.state, status.t_started = S.TRANSFERRING, now
            value = checksum.of(h.checksum_algo, payload)
            if value != h.checksum:
                self._fail(inb, FailCode.CHECKSUM, f"payload checksum {value:#x} != {h.checksum:#x}",
                           nack=True)
                return False
            self._write_pages(inb, 0, payload)
            self._commit(inb)
            return True
        if h.mode == "chunked":
            self._first_credit(inb)
        elif h.mode == "shm":
            self._start_shm(inb)
        else:
            self._start_dist(inb)
        return False

    # The node's prefix cache: (token ids, n) -> the hashes of their first n pages under the
    # node's namespace (prefix_hash.page_hashes); None: no cache. The header's hashes are
    # checked against it before any page is shared or registered by them, so a sender of
    # another model (another namespace) or a faulty one cannot make requests read KV that is
    # not of their tokens, nor plant such pages in the cache.
    prefix_hashes = None

    def _hashes_ok(self, h: KVTransferHeader) -> bool:
        if self.prefix_hashes is None or not h.page_hashes:
            return False
        tokens = [*h.prompt_token_ids, *h.output_token_ids]
        return self.prefix_hashes(tokens, len(h.page_hashes)) == h.page_hashes

    def _share_cached(self, h: KVTransferHeader, target: PagePool) -> tuple[tuple[FailCode, str] | None, list[int]]:
        """Share the cached pages the sender left out, or say why not (then it resends them)."""
        if self.prefix_hashes is None or target is not self.pool:
            return (FailCode.CACHE_MISS, "no prefix cache in the tier receiving it"), []
        if not self._hashes_ok(h):
            return (FailCode.CACHE_MISS, "the page hashes are not this node's hashes of the request's tokens"), []
        shared = target.match(h.page_hashes[:h.skip_pages])
        if len(shared) < h.skip_pages:
            return (FailCode.CACHE_MISS, f"{len(shared)} of the {h.skip_pages} skipped pages are cached here"), []
        if target.num_free - target.num_revived(shared) < h.num_pages:
            return (FailCode.NO_PAGES, f"need {h.num_pages} pages, {target.num_free} free"), []
        target.share(h.request_id, shared)
        return None, shared

    def _refusal(self, h: KVTransferHeader) -> tuple[tuple[FailCode, str] | None, PagePool]:
        """(refusal or None, pool to receive into). `admit` may PARK the request in a pool of
        the same geometry (the host tier: the request arrives parked)."""
        if self._closing:
            return (FailCode.CLOSED, "the receiver is closing"), self.pool
        if h.request_id in self._by_request:
            return (FailCode.BUSY, f"request {h.request_id} already has a transfer in flight"), self.pool
        if any(w.pool.num_held(h.request_id) for w in self._writers.values()):
            # Its pages from an earlier transfer are still here: reserving more under the same
            # owner would let whoever frees that request free these RESERVED pages too, and a
            # late write would land in pages handed to someone else.
            return (FailCode.BUSY, f"request {h.request_id} already holds pages here"), self.pool
        if self._admit is None:
            return None, self.pool
        answer = self._admit(h)
        if answer.verdict is Verdict.ACCEPT:
            return None, self.pool
        if answer.verdict is Verdict.PARK:
            if answer.pool is not None and answer.pool.spec == self.spec and self.accepts_other_pools:
                return None, answer.pool
            return (FailCode.NO_PAGES, "this backend receives into the device tier only"), self.pool
        return (answer.code, answer.reason), self.pool

    accepts_other_pools = True  # backends that write only into `self.pool` set False

    def _write_pages(self, inb: _Inbound, offset: int, view: memoryview) -> None:
        """Copy whole slabs of payload (bytes at `offset`) into the reserved pages."""
        inb.writer.write_bytes(inb.plan, offset // inb.writer.row_bytes, view)
        inb.status.bytes_done += len(view)

    async def _on_chunk(self, c: KVChunk, view: memoryview) -> None:
        inb = self._live.get(c.transfer_id)
        if inb is None:
            log.info("receiver: late chunk %d of %s discarded", c.chunk_index, c.transfer_id)
            return
        h = inb.header
        if h.mode not in STREAMED or c.chunk_index < inb.next_chunk:
            log.info("receiver: duplicate chunk %d of %s discarded", c.chunk_index, h.transfer_id)
            return
        if c.chunk_index > inb.next_chunk:
            self._fail(inb, FailCode.BAD_MESSAGE, f"chunk {inb.next_chunk} missing "
                                           f"(got {c.chunk_index})")
            return
        offset = c.chunk_index * h.chunk_bytes
        if c.offset != offset or c.nbytes != min(h.chunk_bytes, h.payload_bytes - offset):
            self._fail(inb, FailCode.BAD_MESSAGE, f"chunk {c.chunk_index}: offset/nbytes "
                                           f"{c.offset}/{c.nbytes} do not match the header")
            return
        last = c.chunk_index + 1 == h.num_chunks
        inb.owed += 0 if last else 1
        if inb.owed >= max(1, self.config.window // 2):
            # These chunks have left the socket queue: return their credits before the checksum
            # and the copy, so the next chunks travel while this one is being written. Returning
            # them in batches of window/2 halves the control messages and cannot stall the
            # sender: it always keeps at least window - window/2 + 1 credits.
            inb.granted, inb.owed = min(h.num_chunks, inb.granted + inb.owed), 0
            await self._emit(encode(Credit(h.transfer_id, inb.granted)), "credit", [inb], inb.peer)
            if inb.status.state.finished:
                return
        now = time.monotonic()
        if inb.status.state is S.WAITING:
            inb.status.state, inb.status.t_started = S.TRANSFERRING, now
        inb.last_seen = now
        # Pages written before a mismatch is found are still only reserved: the failure frees
        # them and nobody has read them.
        inb.running = inb.writer.write_summed(inb.plan, offset // inb.writer.row_bytes, view, h.checksum_algo,
                                              inb.running)
        inb.status.bytes_done += len(view)
        if inb.running != c.checksum:
            self._fail(inb, FailCode.CHECKSUM, f"running checksum after chunk {c.chunk_index} "
                                        f"{inb.running:#x} != {c.checksum:#x}")
            return
        inb.next_chunk += 1
        if last:
            self._commit(inb)
            self._reply(inb.peer, Ack([h.transfer_id]), "ack")

    def _first_credit(self, inb: _Inbound) -> None:
        """Pages reserved: let the sender stream its first window of chunks."""
        inb.granted = min(inb.header.num_chunks, self.config.window)
        self._reply(inb.peer, Credit(inb.status.transfer_id, inb.granted), "credit", [inb])

    def _start_shm(self, inb: _Inbound) -> None:
        """Mode shm on a receiver with no one-sided path: the sender streams chunks instead."""
        self._first_credit(inb)

    def _start_dist(self, inb: _Inbound) -> None:
        self._fail(inb, FailCode.BAD_MESSAGE, "this receiver has no dist payload path")

    # ---- finishing --------------------------------------------------------------------------
    def _finish_status(self, st: TransferStatus, state: TransferState, reason: str | None,
                       code: FailCode | None = None) -> None:
        st.state, st.reason, st.code, st.t_finished = state, reason, code, time.monotonic()
        self._remember(st)

    def _release(self, inb: _Inbound) -> None:
        self._live.pop(inb.status.transfer_id, None)
        if self._by_request.get(inb.header.request_id) == inb.status.transfer_id:
            del self._by_request[inb.header.request_id]

    def _commit(self, inb: _Inbound) -> None:
        inb.pool.commit(inb.header.request_id)
        h = inb.header
        if h.page_hashes and inb.pool is self.pool and (h.skip_pages or self._hashes_ok(h)):  # (checked when shared)
            inb.pool.register(h.request_id, 0, h.page_hashes)
        self._release(inb)
        self._finish_status(inb.status, S.DONE, None)
        self._completed.append(ReceivedTransfer(
            h.transfer_id, h.request_id, h.tenant, h.num_tokens, inb.shared + inb.pages,
            h.prompt_token_ids, h.output_token_ids, h.num_computed_tokens, h.extra,
            inb.status, inb.pool.tier, h.skip_pages, h.page_hashes))  # final: never mutated again
        self._completed_evt.set()

    def _fail(self, inb: _Inbound, code: FailCode, reason: str, nack: bool = True) -> None:
        """Free the transfer's pages (unless a writer may still be in them: `_pages_free_now`),
        then (optionally) tell the sender."""
        if inb.status.state.finished:
            return
        if self._pages_free_now(inb):
            try:
                inb.pool.free(inb.header.request_id, inb.shared + inb.pages)
            except PoolError as e:  # someone freed them behind our back: report, do not crash the receiver
                log.error("receiver: pages of %s were already freed: %s", inb.status.transfer_id, e)
        self._release(inb)
        self._finish_status(inb.status, S.FAILED, reason, code)
        log.info("receiver: transfer %s (%s) failed: %s: %s", inb.status.transfer_id,
                 inb.header.request_id, code, reason)
        if nack:
            self._reply(inb.peer, Nack(inb.status.transfer_id, code, reason), "nack")

    def _pages_free_now(self, inb: _Inbound) -> bool:
        """Whether a failed transfer's pages may be freed at once (backends whose senders write
        into pages themselves keep them while a writer may be inside: shm_backend)."""
        return True

    def _fail_all(self, reason: str) -> None:
        for inb in list(self._live.values()):
            self._fail(inb, FailCode.CLOSED, reason)

    def _expire(self, now: float) -> None:
        for inb in list(self._live.values()):
            if now > inb.deadline:
                self._fail(inb, FailCode.TIMEOUT, f"not done after {self.config.transfer_timeout_s}s")
            elif inb.header.mode != "dist" and now - inb.last_seen > self.config.idle_timeout_s:
                # (a dist payload wait is bounded by its own timeout in the torch backend)
                self._fail(inb, FailCode.TIMEOUT, f"no progress for {self.config.idle_timeout_s}s")
