"""The shm backend's sender (the protocol: shm_backend.py): maps the receiver's pool from a Grant
and writes pieces into the granted pages under the slot's lock, or offers the payload for the
receiver to read; the zmq sender underneath for everything else."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch
import zmq

from kv_transport import checksum
from kv_transport.base import TransferState
from kv_transport.config import TransportConfig
from kv_transport.fail_codes import FailCode
from kv_transport.local_link import LinkClient, LinkError
from kv_transport.page_writer import PageWriter, WritePlan
from kv_transport.sender import _Outbound, to_host
from kv_transport.shm_common import LINK, _next, piece_rows, _recv_now, RELINK_AFTER_S, S, _sent
from kv_transport.shm_read import ReadOffers
from kv_transport.shm_slots import SlotGuard
from kv_transport.wire import Ack, Commit, Credit, Grant, encode
from kv_transport.zmq_backend import ZmqSender
from pdtb.engine import cuda_ipc
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.shared_memory import Locator, SharedMemoryError, boot_id, data_tensor, open_buffer

log = logging.getLogger("kv_transport.shm_backend")


@dataclass
class _PoolView:
    """What PageWriter needs of a pool: its geometry and its tensor (here, a peer's mapping)."""

    spec: KVSpec
    num_pages: int
    kv: object  # torch.Tensor


@dataclass
class _Target:
    """A receiver pool this sender has mapped."""

    writer: PageWriter
    guard: SlotGuard
    receiver: str  # the token of the receiver's slot table: one per receiver process
    device: bool = False  # a GPU pool (CUDA IPC)


@dataclass
class _Write:
    """One granted transfer's one-sided write, piece by piece."""

    grant: Grant
    target: _Target
    plan: WritePlan
    next_row: int = 0  # payload rows [0, next_row) are written
    acc: int = 0  # running checksum of the rows written
    not_before: float = 0.0  # (fault injection: a late writer)


class ShmSender(ZmqSender):
    """A ZmqSender that writes granted transfers straight into the receiver's shared pool."""

    send_errors = (zmq.ZMQError, LinkError)

    def __init__(self, config: TransportConfig, spec: KVSpec, name: str = "tx", context=None) -> None:
        super().__init__(config, spec, name, context)
        self.strict = config.backend == "shm"
        self._targets: dict[tuple[str, str, str], _Target] = {}  # (pool locator path, its token, slot table's token)
        self._writes: dict[str, _Write] = {}  # transfer id -> its write in progress
        self.one_sided = 0  # transfers written one-sided (the rest went as chunks)
        self._link: LinkClient | None = None  # the receiver's local link, once connected
        self._linking: asyncio.Task | None = None
        self._unreachable: dict[str, float] = {}  # link that could not be connected -> when to try it again
        self._on_link: set[str] = set()  # live transfers announced on the link: all their messages go there
        self.links = 0  # local links connected (a restarted receiver needs a new one)
        self.offers: ReadOffers | None = None  # the read path (shm_read.py), made at the first export_buffer
        self._offered: set[str] = set()  # live transfers offered for reading, no Grant had (yet)
        self.read_by_receiver = 0  # transfers done that the receiver read from the arena
        self._no_arena = config.shm_arena_bytes == 0

    # ---- the read path (shm_read.py) ---------------------------------------------------------
    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        if nbytes <= self.config.inline_max_bytes or self.config.checksum != "sum64":
            return None  # rides in the header message; or no whole-payload sum without a pass (crc32): not offered
        if self.offers is None and not self._no_arena:
            try:
                self.offers = ReadOffers(self.config.shm_arena_bytes)
            except (OSError, ValueError) as e:  # (SharedMemoryError is an OSError)
                log.warning("sender: no export arena (%s); payloads are written one-sided", e)
                self._no_arena = True
        return None if self.offers is None else self.offers.lease(nbytes)

    def _source_for(self, transfer_id: str, data: torch.Tensor, mode: str, whole_sum: int | None):
        if self.offers is None or mode != "shm":
            return None
        source = self.offers.offer(transfer_id, data, whole_sum)
        if source is not None:
            self._offered.add(transfer_id)
        return source

    def _drop_source(self, transfer_id: str, source) -> None:
        self._offered.discard(transfer_id)
        if self.offers is not None:
            self.offers.withdraw(transfer_id)

    def _expire(self, now: float) -> None:
        super()._expire(now)
        if self.offers is not None:
            self.offers.retry()

    # ---- the local link -------------------------------------------------------------------
    def _maybe_link(self, g: Grant) -> None:
        if not (self.config.local_link and g.link and g.host == boot_id()) or \
                self._unreachable.get(g.link, 0.0) > time.monotonic() or self._link is not None or self._linking is not None:
            return
        self._linking = asyncio.ensure_future(self._connect_link(g.link, g.ticket))

    async def _connect_link(self, name: str, ticket: str) -> None:
        link = LinkClient(self.limits.max_batch + 1, self.config.max_header_bytes)
        try:
            await link.connect(name, ticket, self.config.send_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:  # (LinkError is an OSError)
            log.info("sender: no local link to the receiver (%s); control stays on ZeroMQ for %.0fs", e, RELINK_AFTER_S)
            now = time.monotonic()
            self._unreachable = {k: t for k, t in self._unreachable.items() if t > now}
            self._unreachable[name] = now + RELINK_AFTER_S
            return
        finally:
            if self._linking is asyncio.current_task():
                self._linking = None
        self._link = link
        self.links += 1

    def _link_lost(self) -> None:
        """The link ended (the receiver died, closed, or refused what it got), and every message
        that came on it before that was read: what is still in flight is lost."""
        self._link.close()
        self._link = None
        log.warning("sender: the local link to the receiver ended")
        self._on_disconnected()

    # A transfer's messages all take the way its header took, so none overtakes another (a
    # Commit on the link could pass an earlier one still in ZeroMQ's queues), and transfers are
    # announced on the link only once none announced on ZeroMQ is left, Cancels included (a
    # retry of a cancelled request could otherwise arrive before the Cancel: busy).
    def _zmq_pending(self, announcing: list[str]) -> bool:
        """Whether a transfer announced on ZeroMQ (other than `announcing`) or its Cancel is in flight."""
        return any(o.status.state > S.BOOTSTRAPPING and o.status.transfer_id not in self._on_link
                   and o.status.transfer_id not in announcing for o in self._live.values()) or \
            any(c.transfer_id not in self._on_link for c in self._control)

    async def _emit(self, frames: list, kind: str, owners: list, peer: bytes | None = None) -> None:
        tids = [o.status.transfer_id for o in owners]
        if kind in ("header", "batch") and self._link is not None and not self._zmq_pending(tids):
            self._on_link.update(tids)
        on_link = bool(tids) and all(t in self._on_link for t in tids)
        await super()._emit(frames, kind, owners, LINK if on_link else None)

    async def _flush_control(self) -> None:
        while self._control:
            c = self._control.popleft()
            # (a Cancel for a transfer whose link is gone goes on ZeroMQ: same peer, and it frees
            # the receiver's pages now rather than at its idle timeout)
            way = LINK if c.transfer_id in self._on_link and self._link is not None else None
            self._on_link.discard(c.transfer_id)
            await super()._emit(encode(c), "cancel", [], way)

    def _finish(self, o: _Outbound, state: TransferState, reason: str | None = None,
                notify: bool = False, code: FailCode | None = None) -> None:
        super()._finish(o, state, reason, notify, code)
        tid = o.status.transfer_id
        self.read_by_receiver += tid in self._offered and o.status.state is S.DONE  # (the state super() settled on)
        self._drop_source(tid, None)
        if not any(c.transfer_id == o.status.transfer_id for c in self._control):
            self._on_link.discard(o.status.transfer_id)  # (a queued Cancel keeps it until it goes)

    def _write(self, frames: list, peer: bytes | None):
        if peer is LINK:
            if self._link is None:
                raise LinkError("the local link ended")
            self._link.send(frames)
            return _sent()
        return super()._write(frames, peer)

    async def _read(self, timeout: float):
        # With a link up the receiver answers this peer only there; ZeroMQ can hold only what
        # it sent before the link came up, picked up here at the next link message or tick.
        link = self._link
        if link is None:
            return await super()._read(timeout)
        got = link.take() or _recv_now(self._sock)
        if got is None and not link.ended:
            await _next(link.ready, timeout)
            if link is not self._link:  # dropped meanwhile (a reset): its messages are the old socket's
                return None
            got = link.take() or _recv_now(self._sock)
        if got is None and link.ended:
            self._link_lost()
        return got

    async def _reset(self) -> None:
        self._drop_link()  # the link speaks for the old socket's identity
        await super()._reset()

    def _drop_link(self) -> None:
        if self._linking is not None:
            self._linking.cancel()
            self._linking = None
        if self._link is not None:
            self._link.close()
            self._link = None
        self._on_link.clear()

    def _mode_for(self, nbytes: int) -> str:
        return "inline" if nbytes <= self.config.inline_max_bytes else "shm"

    def _stage(self, data: torch.Tensor, mode: str) -> torch.Tensor:
        """A payload on a GPU stays there for a one-sided write into a GPU pool (a device copy);
        it comes to the host only if the receiver wants bytes (`_host_view`)."""
        if mode == "shm" and data.is_cuda:
            return data.detach().contiguous()
        return super()._stage(data, mode)

    def _host_view(self, o: _Outbound) -> None:
        """Give a payload kept on the GPU its host bytes (chunks, a host-memory pool)."""
        if o.view is None and o.data is not None:
            o.data = to_host(o.data)
            o.view = memoryview(o.data.reshape(-1).view(torch.uint8).numpy())

    def _on_control(self, msg) -> None:
        if isinstance(msg, Credit):
            self._offered.discard(msg.transfer_id)  # the receiver does not read it: chunks
        if isinstance(msg, Ack) and msg.link and self.config.local_link and self._link is None and \
                self._linking is None and self._unreachable.get(msg.link, 0.0) <= time.monotonic() and \
                any(t in self._offered for t in msg.transfer_ids):
            # (only a receiver that read from this sender's arena names a link: it is on this host)
            self._linking = asyncio.ensure_future(self._connect_link(msg.link, msg.ticket))
        if not isinstance(msg, Grant):
            o = self._live.get(msg.transfer_id) if isinstance(msg, Credit) else None
            if o is not None:  # the receiver takes chunks
                self._host_view(o)
            super()._on_control(msg)
            return
        self._maybe_link(msg)
        self._offered.discard(msg.transfer_id)  # the receiver does not read it: a write
        o = self._live.get(msg.transfer_id)
        if o is None or o.status.state is not S.WAITING:
            log.info("sender: late or duplicate grant for %s discarded", msg.transfer_id)
            return
        o.status.state, o.status.t_started = S.TRANSFERRING, time.monotonic()
        if len(msg.pages) != o.header.num_pages:  # the pieces' rows are the header's: they must all have a page
            self._finish(o, S.FAILED, f"the receiver granted {len(msg.pages)} pages for a transfer of "
                         f"{o.header.num_pages}", notify=True, code=FailCode.BAD_MESSAGE)
            return
        try:
            target = self._target(msg)
        except SharedMemoryError as e:
            if self.strict:
                self._finish(o, S.FAILED, f"cannot write the receiver's pool one-sided: {e} "
                             "(--transport auto falls back to ZeroMQ)", notify=True, code=FailCode.PEER_LOST)
                return
            log.info("sender: %s goes as chunks: %s", msg.transfer_id, e)
            self._host_view(o)
            o.upto = max(o.upto, msg.upto)
        else:
            if not (target.device and o.data is not None and o.data.is_cuda):
                self._host_view(o)  # bytes from the host: into host memory, or staged to the GPU
            delay = self.config.faults.shm_delay_s
            self._writes[msg.transfer_id] = _Write(msg, target, target.writer.plan(msg.pages),
                                                   acc=checksum.initial(o.header.checksum_algo),
                                                   not_before=time.monotonic() + delay if delay else 0.0)
        self._wake.set()

    def _target(self, g: Grant) -> _Target:
        key = (g.buffer, g.buffer_token, g.slots_token)  # (a receiver started anew over the same pool has new slots)
        t = self._targets.get(key)
        if t is not None:
            return t
        shape = self.spec.page_shape(g.pool_pages)
        if cuda_ipc.is_cuda_locator(g.buffer):  # a GPU pool: device copies into its memory
            kv = cuda_ipc.open_pool(Locator(g.buffer, g.buffer_token, g.host), shape, self.spec.torch_dtype)
            guard = SlotGuard(Locator(g.slots, g.slots_token, g.host))
        else:
            pool = open_buffer(Locator(g.buffer, g.buffer_token, g.host))
            try:
                if pool.nbytes != g.pool_pages * self.spec.bytes_per_page:
                    raise SharedMemoryError(f"the pool has {pool.nbytes} bytes, not {g.pool_pages} pages of this geometry")
                guard = SlotGuard(Locator(g.slots, g.slots_token, g.host))
            except BaseException:
                pool.close()
                raise
            kv = data_tensor(pool.map, pool.nbytes, shape, self.spec.torch_dtype)
            pool.close()  # the mapping stays (kv holds it); locks go through the guard's own file
        for k, old in list(self._targets.items()):  # a restarted receiver: let the dead one's memory go
            if old.receiver != g.slots_token:
                old.guard.close()
                del self._targets[k]
        t = self._targets[key] = _Target(PageWriter(_PoolView(self.spec, g.pool_pages, kv)), guard, g.slots_token,
                                         kv.is_cuda)
        return t

    async def _send_chunks(self) -> bool:
        wrote = False
        for tid, w in list(self._writes.items()):
            o = self._live.get(tid)
            if o is None or o.status.state.finished:
                del self._writes[tid]
            elif time.monotonic() >= w.not_before:
                wrote = await self._write_piece(o, w) or wrote
        return await super()._send_chunks() or wrote

    async def _write_piece(self, o: _Outbound, w: _Write) -> bool:
        """Write the next piece under the grant's slot; on the last, send the Commit."""
        g, guard = w.grant, w.target.guard
        held = guard.acquire(g.slot, g.gen)
        if held is None:  # the receiver is granting or revoking this very instant
            return False
        if held is False:
            del self._writes[o.status.transfer_id]
            self._finish(o, S.FAILED, "the receiver revoked the write grant (it timed out or was "
                         "cancelled there): nothing written", code=FailCode.CANCELLED)
            return False
        writer, row = w.target.writer, w.target.writer.row_bytes
        total = o.header.payload_bytes // row
        left, chunk_rows = total - w.next_row, max(1, self.config.chunk_bytes // row)
        rows = piece_rows(left, chunk_rows)
        algo = o.header.checksum_algo
        try:
            if o.view is None:  # GPU to GPU: a device copy, finished before the slot is let go
                data = o.data.reshape(-1, writer.row_elems)[w.next_row:w.next_row + rows]
                writer.write(w.plan, w.next_row, data)
                w.acc = checksum.update(algo, w.acc, data)
                torch.cuda.synchronize(writer.rows.device)
                nbytes = rows * row
            else:
                data = o.view[w.next_row * row:(w.next_row + rows) * row]
                fused = writer.write_bytes_sum64(w.plan, w.next_row, data, w.acc) if algo == "sum64" else None
                if fused is None:
                    writer.write_bytes(w.plan, w.next_row, data)
                    if not writer.cpu:
                        torch.cuda.synchronize(writer.rows.device)
                    fused = checksum.update(algo, w.acc, data)
                w.acc = fused
                nbytes = len(data)
            if self.config.faults.shm_stall_s and w.next_row == 0:
                log.error("fault injected: the writer stalls %.1fs holding its slot", self.config.faults.shm_stall_s)
                time.sleep(self.config.faults.shm_stall_s)  # blocks the whole process, as a stalled one would
        finally:
            guard.release(g.slot)
        w.next_row += rows
        o.status.bytes_done += nbytes
        if w.next_row == total:
            del self._writes[o.status.transfer_id]
            self.one_sided += 1
        await self._emit(encode(Commit(o.status.transfer_id, w.next_row, w.acc)), "commit", [o])
        return True

    async def _shutdown(self) -> None:
        self._drop_link()
        await super()._shutdown()
        for t in self._targets.values():
            t.guard.close()
        self._targets.clear()
        if self.offers is not None:
            self.offers.close()
            self.offers = None
            self._no_arena = True
