"""torch.distributed payloads (gloo on CPU, NCCL on GPU), control over ZeroMQ.

torch.distributed backend: headers and control over ZeroMQ, payloads by point-to-point
send/recv (gloo for CPU pools, NCCL for CUDA pools: the same code, chosen by device).

    sender                               receiver (ROUTER, as in zmq_backend)
    header (mode "dist", src_rank) ───>  reserve pages; staging buffer; irecv(src, tag)
                                   <───  Credit(rank, tag)   "posted, send now"
    isend(payload, rank, tag) ═══════>   wait; verify checksum; copy staging -> pages; commit
                                   <───  Ack | Nack

Small payloads (<= inline_max_bytes) still ride inline over ZeroMQ, batched.

Payloads land in a reused staging buffer, never directly in pool pages: a recv that timed
out could otherwise still write into pages that were freed and handed to another request
(the "late writer"). After a timeout the staging buffer is retired, and the peer is
marked broken: gloo closes the pair on a timed-out wait, and NCCL has no tags to keep a
stale recv from matching the next send. Later dist transfers with that peer fail fast with
the reason (other peers are unaffected); recovery is a new process group (restart the nodes).
A header whose src_rank is not another rank of the group is refused before any dist call, and
so is one from a peer that does not speak for that rank (torch_ranks.py: each rank's sockets
carry a token it published in the group's store), so that no peer can make another pair's recv
wait for a send that never comes.
A transfer cancelled after its header went out keeps its payload until the receiver's
Credit (if one comes) is answered, so a recv posted before the Cancel arrived completes. Each side runs its dist operations
one at a time, in Credit order, which is also the order NCCL needs.
"""
from __future__ import annotations

import asyncio
import collections
import datetime
import itertools
import logging
import time

import torch
import torch.distributed as dist

from kv_transport import checksum, torch_ranks
from kv_transport.base import TransferState, TransportError
from kv_transport.config import TransportConfig
from kv_transport.fail_codes import FailCode
from pdtb.aio import bounded
from kv_transport.sender import to_host
from kv_transport.wire import Ack, AdmitFn, Credit
from kv_transport.zmq_backend import ZmqReceiver, ZmqSender
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

log = logging.getLogger(__name__)
S = TransferState


def _dist_backend(config: TransportConfig, device: torch.device) -> str:
    if config.dist_backend != "auto":
        return config.dist_backend
    return "nccl" if device.type == "cuda" else "gloo"


async def ensure_process_group(config: TransportConfig, device: torch.device) -> bool:
    """Initialise torch.distributed from the config unless the caller already did.

    Returns True if this call created the group (the transport then destroys it on close).
    """
    if dist.is_initialized():
        return False
    if config.dist_init_method is None:
        raise TransportError("torch backend: initialise torch.distributed first, or set "
                             "dist_init_method, dist_rank and dist_world_size")
    # init blocks until every rank joined; keep the event loop responsive meanwhile.
    await bounded(asyncio.to_thread(
        dist.init_process_group, _dist_backend(config, device),
        init_method=config.dist_init_method, rank=config.dist_rank,
        world_size=config.dist_world_size,
        timeout=datetime.timedelta(seconds=config.transfer_timeout_s)),
        config.transfer_timeout_s + 5)
    return True


async def wait_work(work, timeout: float, use_thread: bool) -> None:
    """Wait for a torch.distributed Work, at most `timeout` seconds.

    gloo's Work only completes inside wait(), which blocks: it runs in a worker thread here
    (the one place this package uses a thread: torch.distributed has no awaitable API).
    NCCL's is_completed() is a cheap CUDA event query, so it is polled instead.
    """
    if use_thread:
        # bounded: a wait that finished in the pass its timeout fired is not reported as a timeout
        await bounded(asyncio.to_thread(work.wait, datetime.timedelta(seconds=timeout)), timeout + 1.0)
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise asyncio.TimeoutError()
        await asyncio.sleep(0.0005)


async def next_job(jobs: collections.deque, evt: asyncio.Event, tick_s: float):
    """Pop the next queued dist job; with none queued, wait up to `tick_s` for a wake-up and
    return None (the worker loops, so a closed endpoint is noticed within a tick)."""
    if jobs:
        return jobs.popleft()
    evt.clear()
    try:
        await asyncio.wait_for(evt.wait(), tick_s)
    except asyncio.TimeoutError:
        pass
    return None


class TorchSender(ZmqSender):
    """ZmqSender whose large payloads go by torch.distributed isend."""

    def __init__(self, config: TransportConfig, spec: KVSpec, name: str = "tx",
                 device: str | torch.device = "cpu", **kwargs) -> None:
        super().__init__(config, spec, name, **kwargs)
        self.device = torch.device(device)
        self._owns_group = False
        self._jobs: collections.deque = collections.deque()
        self._job_evt: asyncio.Event | None = None
        self.broken: dict[int, str] = {}  # dst rank -> why; dist sends to it then fail fast
        # Cancelled while WAITING: the receiver may already have posted its irecv and sent a
        # Credit. Its payload is kept until that Credit is answered (or a transfer timeout
        # passed), else the receiver's recv would wait for a send that never comes.
        self._orphans: dict[str, tuple[torch.Tensor, float]] = {}

    async def start(self) -> None:
        self._owns_group = await ensure_process_group(self.config, self.device)
        # this rank's token into the group's store (a round trip) off the loop, before any socket
        await bounded(asyncio.to_thread(torch_ranks.routing_id), self.config.transfer_timeout_s)
        self._job_evt = asyncio.Event()
        self._wake = asyncio.Event()
        await self._start_tasks(self._writer(), self._reader(), self._dist_worker())

    async def close(self) -> None:
        await super().close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _stage(self, data: torch.Tensor, mode: str) -> torch.Tensor:
        return data.detach().contiguous() if mode == "dist" else to_host(data)

    def _mode_for(self, nbytes: int) -> str:
        return "inline" if nbytes <= self.config.inline_max_bytes else "dist"

    def _src_rank(self) -> int:
        return dist.get_rank()

    def _routing_id(self) -> bytes:
        return torch_ranks.routing_id()

    def _on_ready(self, o, credit: Credit) -> None:
        if o.status.state is S.WAITING:
            o.status.state, o.status.t_started = S.TRANSFERRING, time.monotonic()
            self._jobs.append((o, credit.rank, credit.tag))
            self._job_evt.set()

    def _finish(self, o, state, reason=None, notify=False, code=None) -> None:
        # Finished (cancelled, failed) before its payload went: the receiver may have posted a
        # recv for it already (WAITING: its Credit may be on the way; TRANSFERRING: the send is
        # queued). Keep the payload so that recv completes; a queued job sends it, or a late Credit.
        if o.header.mode == "dist" and o.status.state in (S.WAITING, S.TRANSFERRING) and o.data is not None \
                and not o.status.state.finished and o.status.bytes_done < o.status.bytes_total:
            self._orphans[o.status.transfer_id] = (o.data, time.monotonic() + self.config.transfer_timeout_s)
        super()._finish(o, state, reason, notify, code)

    def _on_control(self, msg) -> None:
        orphan = self._orphans.pop(getattr(msg, "transfer_id", ""), None) if isinstance(msg, Credit) else None
        if orphan is not None:  # answer the recv the receiver posted before it saw our Cancel
            self._jobs.append((orphan[0], msg.rank, msg.tag))
            self._job_evt.set()
            return
        now = time.monotonic()
        for tid in [t for t, (_, until) in self._orphans.items() if until < now]:
            del self._orphans[tid]
        super()._on_control(msg)

    async def _dist_worker(self) -> None:
        use_thread = _dist_backend(self.config, self.device) == "gloo"
        while True:
            job = await next_job(self._jobs, self._job_evt, self.config.tick_s)
            if job is None:
                continue
            o, rank, tag = job
            if isinstance(o, torch.Tensor):  # the payload of a cancelled transfer, for a posted recv
                await self._send_orphan(o, rank, tag, use_thread)
                continue
            if o.status.state.finished or o.data is None:
                orphan = self._orphans.pop(o.status.transfer_id, None)
                if orphan is not None:  # cancelled after the Credit: the posted recv still gets its bytes
                    await self._send_orphan(orphan[0], rank, tag, use_thread)
                continue
            if rank in self.broken:
                self._finish(o, S.FAILED, f"dist peer broken: {self.broken[rank]}", notify=True, code=FailCode.DIST_FAILED)
                continue
            data = o.data.reshape(-1).view(torch.uint8)
            try:
                work = dist.isend(data, dst=rank, tag=tag)
                await wait_work(work, max(0.1, o.deadline - time.monotonic()), use_thread)
            except (asyncio.TimeoutError, RuntimeError, ValueError) as e:
                self.broken[rank] = f"isend to rank {rank} failed: {e!r}"
                self._finish(o, S.FAILED, self.broken[rank], notify=True, code=FailCode.DIST_FAILED)
                continue
            o.status.bytes_done = o.status.bytes_total  # DONE comes with the receiver's Ack

    async def _send_orphan(self, data: torch.Tensor, rank: int, tag: int, use_thread: bool) -> None:
        if rank in self.broken:
            return
        try:
            work = dist.isend(data.reshape(-1).view(torch.uint8), dst=rank, tag=tag)
            await wait_work(work, self.config.transfer_timeout_s, use_thread)
        except (asyncio.TimeoutError, RuntimeError, ValueError) as e:
            self.broken[rank] = f"isend to rank {rank} failed: {e!r}"


class TorchReceiver(ZmqReceiver):
    """ZmqReceiver whose large payloads arrive by torch.distributed irecv."""


    def __init__(self, config: TransportConfig, pool: PagePool, admit: AdmitFn | None = None,
                 **kwargs) -> None:
        super().__init__(config, pool, admit, **kwargs)
        self._owns_group = False
        self._jobs: collections.deque = collections.deque()
        self._job_evt: asyncio.Event | None = None
        self._tags = itertools.count(1)
        self._staging: torch.Tensor | None = None  # reused; replaced after a failure
        self._retired: list = []  # (buffer, work) of timed-out recvs, kept alive
        self.broken: dict[int, str] = {}  # src rank -> why; its dist transfers then fail fast

    async def start(self) -> None:
        self._owns_group = await ensure_process_group(self.config, self.pool.kv.device)
        self._job_evt = asyncio.Event()
        self._completed_evt = asyncio.Event()
        self._prepare()
        await self._start_tasks(self._serve(), self._dist_worker())

    async def close(self) -> None:
        await super().close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def _start_dist(self, inb) -> None:
        src = inb.header.src_rank
        if not (isinstance(src, int) and 0 <= src < dist.get_world_size()) or src == dist.get_rank():
            # checked before any dist call: an unknown rank makes gloo wait on its store for
            # the whole timeout (blocking the loop), and our own rank can never send to us
            self._fail(inb, FailCode.BAD_MESSAGE, f"src_rank {src!r} is not another rank of the process group "
                                           f"(world size {dist.get_world_size()}, this rank {dist.get_rank()})")
            return
        if src in self.broken:
            self._fail(inb, FailCode.DIST_FAILED, f"dist peer broken: {self.broken[src]}")
            return
        self._jobs.append(inb)
        self._job_evt.set()

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.pool.kv.device)
        return self._staging[:nbytes]

    async def _dist_worker(self) -> None:
        use_thread = _dist_backend(self.config, self.pool.kv.device) == "gloo"
        while True:
            inb = await next_job(self._jobs, self._job_evt, self.config.tick_s)
            if inb is not None and not inb.status.state.finished:
                await self._receive_one(inb, use_thread)
                await self._flush()

    async def _receive_one(self, inb, use_thread: bool) -> None:
        h = inb.header
        ok, why = torch_ranks.known_verdict(inb.peer, h.src_rank), f"the peer that sent it does not speak for rank {h.src_rank}"
        if ok is None:  # a rank not seen before: its token from the group's store
            try:
                ok = await bounded(asyncio.to_thread(torch_ranks.speaks_for, inb.peer, h.src_rank), self.config.tick_s + 5)
            except (asyncio.TimeoutError, RuntimeError, ValueError) as e:  # the store: unreachable, or gone
                ok, why = False, f"the group's store did not answer: {e!r}"
        if inb.status.state.finished:  # expired or cancelled during the lookup: no recv for it
            return
        if not ok:
            self._fail(inb, FailCode.BAD_MESSAGE, f"src_rank {h.src_rank}: {why}")
            return
        buf = self._staging_for(h.payload_bytes)
        tag = next(self._tags) % (1 << 31)
        work = None
        try:
            work = dist.irecv(buf, src=h.src_rank, tag=tag)
            self._reply(inb.peer, Credit(h.transfer_id, 1, dist.get_rank(), tag), "credit", [inb])
            await self._flush()
            inb.status.state, inb.status.t_started = S.TRANSFERRING, time.monotonic()
            await wait_work(work, max(0.1, inb.deadline - time.monotonic()), use_thread)
        except (asyncio.TimeoutError, RuntimeError, ValueError) as e:
            # this peer only: other ranks' pairs are untouched by a failure on this one
            self.broken[h.src_rank] = f"irecv from rank {h.src_rank} failed: {e!r}"
            self._retired.append((self._staging, work))  # a late write lands here, not in pages
            self._staging = None
            self._fail(inb, FailCode.DIST_FAILED, self.broken[h.src_rank])
            return
        if inb.status.state.finished:  # cancelled while we waited: pages already freed
            return
        value = checksum.of(h.checksum_algo, buf)
        if value != h.checksum:
            self._fail(inb, FailCode.CHECKSUM, f"payload checksum {value:#x} != {h.checksum:#x}")
            return
        rows = buf.view(self.pool.kv.dtype).view(-1, inb.writer.row_elems)
        inb.writer.write(inb.plan, 0, rows)  # the device pool, or the host tier for a parked request
        inb.status.bytes_done = h.payload_bytes
        self._commit(inb)
        self._reply(inb.peer, Ack([h.transfer_id]), "ack")
