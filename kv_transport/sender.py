"""Sender state machine, independent of how frames move (zmq, fake link, ...).

Lifecycle of one transfer (TransferState):

    send() -> BOOTSTRAPPING --(inline: header+payload sent)----------> TRANSFERRING
                  |                                                        |
                  +--(chunked: header sent)--> WAITING --(Credit)--> TRANSFERRING
                                                                           |
               Ack -> DONE; Nack, timeout, cancel(), close(), disconnect -> FAILED

(mode "dist", torch_backend: the Credit carries the receiver's rank and tag; the payload then
goes by torch.distributed instead of chunks.)

Queues: `_inline_q` and `_chunked_q` hold BOOTSTRAPPING transfers in send order;
`_streaming` holds announced chunked transfers (at most `max_active_transfers`);
`_control` holds Cancel messages to send. One writer task owns every send; one reader task
handles Credit/Ack/Nack. Backends implement `_open`, `_write`, `_read`, `_reset`, `_shutdown`.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import torch

from kv_transport import checksum
from kv_transport.base import TransferMeta, TransferState, TransferStatus, TransportError
from kv_transport.config import TransportConfig
from kv_transport.endpoint_core import EndpointCore
from kv_transport.fail_codes import FailCode
from kv_transport.wire import (STREAMED, Ack, Cancel, Credit, KVChunk, KVTransferHeader, Nack,
                               TransferBatch, WireError, decode, encode)
from pdtb.engine.kv_export import SUM_BLOCK_BYTES, KVExport
from pdtb.engine.kv_spec import KVSpec

log = logging.getLogger(__name__)
S = TransferState


def to_host(data: torch.Tensor) -> torch.Tensor:
    """`data` contiguous on the CPU. From an accelerator the copy lands in pinned memory (torch
    caches pinned blocks, so a transfer's staging is not a fresh page-locking each time): the
    device copies into it at full bus speed instead of through the driver's pageable bounce."""
    data = data.detach().contiguous()
    if data.device.type == "cpu":
        return data
    host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
    host.copy_(data)
    return host


@dataclass
class _Outbound:
    header: KVTransferHeader
    data: torch.Tensor | None  # the payload; dropped once finished
    view: memoryview | None  # byte view of `data` (CPU backends)
    status: TransferStatus
    deadline: float  # monotonic time at which it fails with a timeout
    frame0: bytes = b""  # encoded header, reused when sent alone
    upto: int = 0  # chunks [0, upto) may be sent: the highest Credit.upto seen
    next_chunk: int = 0
    sums: list[int] = field(default_factory=list)  # running checksum after chunk i
    inline_bytes: int = 0  # counted in the sender's inline in-flight budget
    done: asyncio.Event | None = None  # created by wait()


class SenderCore(EndpointCore):
    """Backend-independent sender. See the module docstring for the state machine."""

    role = "sender"

    def __init__(self, config: TransportConfig, spec: KVSpec, name: str = "tx") -> None:
        super().__init__(config, spec)
        self._prefix = f"{name}-{os.getpid()}-{secrets.token_hex(3)}"
        self._seq = itertools.count()
        self._live: dict[str, _Outbound] = {}
        self._inline_q: collections.deque[_Outbound] = collections.deque()
        self._chunked_q: collections.deque[_Outbound] = collections.deque()
        self._streaming: list[_Outbound] = []
        self._control: collections.deque[Cancel] = collections.deque()
        self._inline_inflight = 0
        self._chunk_bytes = max(self.limits.chunk_align,
                                config.chunk_bytes // self.limits.chunk_align
                                * self.limits.chunk_align)
        self._wake: asyncio.Event | None = None

    # ---- public API (see base.KVSender) ----------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        await self._start_tasks(self._writer(), self._reader())

    def send(self, export: KVExport, meta: TransferMeta | None = None) -> str:
        self._check_usable()
        meta = meta or TransferMeta()
        h = export.header
        if h.spec != self.spec:
            raise ValueError(f"export spec {h.spec} != transport spec {self.spec}")
        nbytes = h.payload_bytes
        mode = self._mode_for(nbytes)
        data = self._stage(export.data, mode)
        if data.numel() * data.element_size() != nbytes:
            raise ValueError(f"export data has {data.numel() * data.element_size()} bytes, "
                             f"header says {nbytes}")
        view = None if data.device.type != "cpu" else \
            memoryview(data.reshape(-1).view(torch.uint8).numpy())
        algo = self.config.checksum
        streamed = mode in STREAMED
        chunk = self._chunk_bytes if streamed else nbytes
        sums = None  # running checksum after each chunk, if the export already summed it
        if algo == "sum64" and export.block_sums is not None:
            sums = checksum.running_from_blocks(export.block_sums, SUM_BLOCK_BYTES,
                                                chunk if streamed else nbytes, nbytes,
                                                whole=not streamed)
        tid = f"{self._prefix}-{next(self._seq)}"
        source = self._source_for(tid, data, mode, sums[-1] if sums and streamed else None)
        try:  # (an offer made for a header that is never sent is withdrawn)
            header = KVTransferHeader(
                transfer_id=tid, request_id=h.request_id, tenant=meta.tenant,
                num_tokens=h.num_tokens, prompt_token_ids=list(meta.prompt_token_ids),
                output_token_ids=list(meta.output_token_ids),
                num_computed_tokens=meta.num_computed_tokens, extra=dict(meta.extra),
                num_pages=h.num_pages, page_size=self.spec.page_size, dtype=self.spec.dtype,
                num_layers=self.spec.num_layers, num_kv_heads=self.spec.num_kv_heads,
                head_dim=self.spec.head_dim, payload_bytes=nbytes, mode=mode,
                chunk_bytes=chunk,
                num_chunks=-(-nbytes // self._chunk_bytes) if streamed else 1,
                checksum_algo=algo,
                checksum=None if streamed else sums[-1] if sums else
                checksum.of(algo, data if view is None else view),
                src_rank=self._src_rank(), skip_pages=h.skip_pages, page_hashes=list(meta.page_hashes),
                source=source)
            frame0 = encode(header)[0]  # fails here, in the caller, if meta is not msgpack-safe
        except BaseException:
            self._drop_source(tid, source)
            raise
        now = time.monotonic()
        status = TransferStatus(tid, h.request_id, S.BOOTSTRAPPING, bytes_total=nbytes,
                                t_created=now)
        o = _Outbound(header, data, view, status, now + self.config.transfer_timeout_s, frame0,
                      sums=sums if streamed and sums else [])
        self._live[tid] = o
        (self._inline_q if mode == "inline" else self._chunked_q).append(o)
        self._wake.set()
        return tid

    def poll(self, transfer_id: str) -> TransferStatus | None:
        o = self._live.get(transfer_id)
        if o is not None:
            return o.status.snapshot()
        st = self._history.get(transfer_id)
        return None if st is None else st.snapshot()

    async def wait(self, transfer_id: str, timeout: float | None = None) -> TransferStatus:
        o = self._live.get(transfer_id)
        if o is not None:
            o.done = o.done or asyncio.Event()
            limit = self.config.transfer_timeout_s + 1.0 if timeout is None else timeout
            try:
                await asyncio.wait_for(o.done.wait(), limit)
            except asyncio.TimeoutError:
                pass
        st = self.poll(transfer_id)
        if st is None:
            raise KeyError(transfer_id)
        return st

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        o = self._live.get(transfer_id)
        if o is not None:
            self._finish(o, S.FAILED, reason, notify=True, code=FailCode.CANCELLED)

    async def close(self) -> None:
        self._closing = True  # send() refuses from here on: nothing can start during the flush
        for o in list(self._live.values()):
            self._finish(o, S.FAILED, "transport closed", notify=True, code=FailCode.CLOSED)
        try:  # best effort: tell the receiver to free what it reserved
            await asyncio.wait_for(self._flush_control(), self.config.close_timeout_s)
        except (asyncio.TimeoutError, TransportError, RuntimeError):
            pass
        await self._stop_tasks()
        for o in list(self._live.values()):  # none should be left; never leave one unfinished
            self._finish(o, S.FAILED, "transport closed", notify=True, code=FailCode.CLOSED)

    # ---- backend hooks ---------------------------------------------------------------------
    def _stage(self, data: torch.Tensor, mode: str) -> torch.Tensor:
        """The payload as this backend sends it in `mode`: contiguous, on the CPU."""
        return to_host(data)

    def _mode_for(self, nbytes: int) -> str:
        return "inline" if nbytes <= self.config.inline_max_bytes else "chunked"

    def _src_rank(self) -> int:
        return -1

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 CPU tensor of `nbytes` to gather an export into (export_request(out=)), where
        this backend can send an export from there faster; None: any tensor will do."""
        return None

    def _source_for(self, transfer_id: str, data: torch.Tensor, mode: str, whole_sum: int | None):
        """A header's ReadSource: where the receiver may read the payload itself (shm_backend)."""
        return None

    def _drop_source(self, transfer_id: str, source) -> None:
        """The ReadSource of `transfer_id` ends: its header was never sent, or its transfer ended."""

    def _on_ready(self, o: _Outbound, credit: Credit) -> None:
        raise TransportError(f"{type(self).__name__} has no dist payload path")

    # ---- state changes ----------------------------------------------------------------------
    def _finish(self, o: _Outbound, state: TransferState, reason: str | None = None,
                notify: bool = False, code: FailCode | None = None) -> None:
        st = o.status
        if st.state.finished:
            return
        announced = st.state > S.BOOTSTRAPPING
        st.state, st.reason, st.code, st.t_finished = state, reason, code, time.monotonic()
        self._live.pop(st.transfer_id, None)
        self._remember(st)
        self._inline_inflight -= o.inline_bytes
        o.inline_bytes = 0
        if o in self._streaming:
            self._streaming.remove(o)
        o.data = o.view = None  # zmq keeps its own reference to frames still queued
        if state is S.FAILED:
            log.info("transfer %s (%s) failed: %s: %s", st.transfer_id, st.request_id, code, reason)
        if notify and announced:
            self._control.append(Cancel(st.transfer_id, reason or "cancelled"))
        if o.done is not None:
            o.done.set()
        if self._wake is not None:
            self._wake.set()

    def _fail_all(self, reason: str, notify: bool = False, code: FailCode = FailCode.CLOSED) -> None:
        for o in list(self._live.values()):
            self._finish(o, S.FAILED, reason, notify, code)

    def _expire(self, now: float) -> None:
        for o in list(self._live.values()):
            if now > o.deadline:
                self._finish(o, S.FAILED, f"timeout after {self.config.transfer_timeout_s}s "
                             f"in state {o.status.state.name}", notify=True, code=FailCode.TIMEOUT)

    def _on_disconnected(self) -> None:
        """The link was reset: everything announced on it is lost."""
        for o in list(self._live.values()):
            if o.status.state > S.BOOTSTRAPPING:
                self._finish(o, S.FAILED, "disconnected from receiver", notify=True, code=FailCode.PEER_LOST)

    # ---- reader task ------------------------------------------------------------------------
    async def _reader(self) -> None:
        # Timeouts are checked here, not in the writer: a writer stuck in a slow send must not
        # delay them.
        next_check = 0.0
        while True:
            frames = await self._read(self.config.tick_s)
            now = time.monotonic()
            if now >= next_check:
                self._expire(now)
                next_check = now + self.config.tick_s
            if frames is None:
                continue
            try:
                msg = decode(frames, self.limits).msg
            except WireError as e:
                log.warning("sender: discarding a bad message: %s", e)
                continue
            self._on_control(msg)

    def _on_control(self, msg) -> None:
        if isinstance(msg, Ack):
            for tid in msg.transfer_ids:
                o = self._live.get(tid)
                if o is None:
                    log.info("sender: late or duplicate ack for %s discarded", tid)
                else:
                    o.status.bytes_done = o.status.bytes_total
                    self._finish(o, S.DONE)
            return
        o = self._live.get(getattr(msg, "transfer_id", ""))
        if o is None:
            log.info("sender: late %s for %s discarded", type(msg).__name__,
                     getattr(msg, "transfer_id", "?"))
        elif isinstance(msg, Nack):
            self._finish(o, S.FAILED, f"receiver: {msg.reason}", code=msg.code)
        elif isinstance(msg, Credit):
            self._on_credit(o, msg)
        else:
            log.warning("sender: unexpected %s discarded", type(msg).__name__)

    def _on_credit(self, o: _Outbound, credit: Credit) -> None:
        if o.header.mode == "dist":
            self._on_ready(o, credit)
            return
        o.upto = max(o.upto, credit.upto)  # cumulative: a duplicate or a late one grants nothing
        if o.status.state is S.WAITING:
            o.status.state = S.TRANSFERRING
            o.status.t_started = time.monotonic()
        self._wake.set()

    # ---- writer task ------------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            if not self._wake.is_set() and self._checksum_ahead():
                await asyncio.sleep(0)  # let the reader run between precomputed chunks
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            await self._flush_control()
            while await self._send_inline() | await self._announce() | await self._send_chunks():
                await self._flush_control()

    async def _flush_control(self) -> None:
        while self._control:
            await self._emit(encode(self._control.popleft()), "cancel", [])

    async def _send_inline(self) -> bool:
        budget = self.config.window * self.config.chunk_bytes - self._inline_inflight
        batch: list[_Outbound] = []
        size = 0
        while self._inline_q and len(batch) < self.config.max_batch:
            o = self._inline_q[0]
            if o.status.state.finished:
                self._inline_q.popleft()
                continue
            n = o.header.payload_bytes
            if batch and (size + n > self.config.chunk_bytes or size + n > budget):
                break
            if not batch and n > budget and self._inline_inflight:
                break
            batch.append(self._inline_q.popleft())
            size += n
        if not batch:
            return False
        now = time.monotonic()
        for o in batch:
            o.inline_bytes = o.header.payload_bytes
            self._inline_inflight += o.inline_bytes
            o.status.state, o.status.t_started = S.TRANSFERRING, now
        if len(batch) == 1:
            frames, kind = [batch[0].frame0, batch[0].view], "header"
        else:
            frames = encode(TransferBatch([o.header for o in batch]), [o.view for o in batch])
            kind = "batch"
        await self._emit(frames, kind, batch)
        return True

    async def _announce(self) -> bool:
        sent = False
        while self._chunked_q and len(self._streaming) < self.config.max_active_transfers:
            o = self._chunked_q.popleft()
            if o.status.state.finished:
                continue
            o.status.state = S.WAITING
            self._streaming.append(o)
            await self._emit([o.frame0], "header", [o])
            sent = True
        return sent

    async def _send_chunks(self) -> bool:
        sent = False
        for o in list(self._streaming):  # one chunk per transfer per round: round robin
            h = o.header
            if o.status.state is not S.TRANSFERRING or o.next_chunk >= o.upto or \
                    o.next_chunk >= h.num_chunks or o.view is None:
                continue
            off = o.next_chunk * h.chunk_bytes
            piece = o.view[off:off + h.chunk_bytes]
            if len(o.sums) == o.next_chunk:
                self._checksum_next(o)
            chunk = KVChunk(h.transfer_id, o.next_chunk, off, len(piece), o.sums[o.next_chunk])
            o.next_chunk += 1
            await self._emit(encode(chunk, [piece]), "chunk", [o])
            o.status.bytes_done += len(piece)
            sent = True
        return sent

    def _checksum_next(self, o: _Outbound) -> None:
        h, i = o.header, len(o.sums)
        piece = o.view[i * h.chunk_bytes:(i + 1) * h.chunk_bytes]
        o.sums.append(checksum.update(h.checksum_algo, o.sums[-1] if o.sums else 0, piece))

    def _checksum_ahead(self) -> bool:
        """While idle (waiting for credits), checksum one chunk that will be sent soon, so
        that a credit is answered by a send and not by a pass over 4 MiB. True if it did."""
        for o in self._streaming:
            if o.header.mode != "chunked" or o.view is None:  # (shm: written one-sided, no chunk sums)
                continue
            if len(o.sums) < min(o.header.num_chunks, o.next_chunk + self.config.window):
                self._checksum_next(o)
                return True
        return False

    async def _emit_failed(self, owners: list, reason: str) -> None:
        for o in owners:
            self._finish(o, S.FAILED, reason, notify=True, code=FailCode.PEER_LOST)
