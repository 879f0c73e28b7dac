"""What sender and receiver share: limits, history, fault-aware sends.

What a sender and a receiver share: limits, bounded history, fault-aware sends, task
supervision, and the contract between the cores and the backends built on them.

Every hook runs on the endpoint's one asyncio loop (the node's loop), so it may read and change
the endpoint's state without locks, and none may block it: a wait is awaited, bounded by a
timeout of the config. A hook that raises fails what it was called for (a send, a transfer),
never the loop. Chain: EndpointCore -> SenderCore | ReceiverCore (sender.py, receiver.py) ->
ZmqSender | ZmqReceiver (zmq_backend.py) -> ShmSender | ShmReceiver (shm_sender.py,
shm_receiver.py); torch_backend.py and fake.py sit on the zmq classes or the cores the same way.

Every backend (I/O):
    _open()                   once, from start(), before any task runs: connect (sender) or bind
                              (receiver); raising leaves nothing running
    _write(frames, peer)      an awaitable that sends one message (peer: the receiver's reply
                              address); only _emit calls it, through the fault injector and
                              bounded by send_timeout_s; errors in `send_errors` fail the owners
    _read(timeout)            one message (a list of frames) or None after `timeout` s; only the
                              reader task (sender) or the serve task (receiver) calls it
    _reset()                  a disconnect fault: drop the link and reconnect (the transfers in
                              flight end through _on_disconnected)
    _shutdown()               from close(), after the tasks stopped: close sockets, linger 0

Sender (SenderCore), at send() before the header goes out:
    _mode_for(nbytes)         how the payload goes ("inline", "chunked" or a backend's own)
    _stage(data, mode)        the payload as the backend sends it (contiguous; on the CPU for zmq)
    _source_for(...)          what the header offers the receiver to read itself (None: nothing);
    _drop_source(tid, src)    its end, when the header was never sent or the transfer ends
  in the reader task, per message and per tick:
    _on_control(msg)          every control message first (a backend takes its own: Grant, ...)
    _expire(now)              time out what waits (call super: transfer_timeout_s)
  in the writer task, between sends and at close:
    _flush_control()          send queued control messages
    _send_chunks() -> bool    stream the next chunks within credit; True if it sent any
  whenever a transfer ends:
    _finish(o, state, ...)    release what the backend holds for it, then call super

Receiver (ReceiverCore), in the serve task:
    _on_other(peer, m)        a message type the core does not take (default: refused)
    _start_shm(inb)           an admitted header of mode "shm" (default: credit for chunks)
    _commit(inb)              the whole payload is in: check it, then commit (call super)
    _pages_free_now(inb)      at a failure, whether its pages may be freed now (shm: not while a
                              writer may still be inside them)
    _expire(now)              time out what waits (call super)
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

from kv_transport.base import TransferStatus, TransportError
from kv_transport.config import FaultConfig, TransportConfig
from kv_transport.faults import Fault, FaultInjector
from kv_transport.wire import WireLimits
from pdtb.aio import bounded
from pdtb.engine.kv_spec import KVSpec

log = logging.getLogger(__name__)


class EndpointCore:
    """Base of SenderCore and ReceiverCore; not used on its own."""

    role = "endpoint"
    send_errors: tuple[type[BaseException], ...] = ()  # backend errors that fail a send

    def __init__(self, config: TransportConfig, spec: KVSpec) -> None:
        self.config = config
        self.spec = spec
        self.limits = WireLimits.from_config(config, spec)
        self.faults = FaultInjector(config.faults)
        self.error: BaseException | None = None  # set if a background task crashed
        self._history: collections.OrderedDict[str, TransferStatus] = collections.OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self._closed = False
        self._closing = False  # close() has begun: no new transfers (it may still flush replies)

    def set_faults(self, faults: FaultConfig) -> None:
        """Inject `faults` into this endpoint's messages from the next one on (chaos runs)."""
        self.config = dataclasses.replace(self.config, faults=faults)
        self.faults = FaultInjector(faults)

    # ---- supervision ------------------------------------------------------------------------
    async def _start_tasks(self, *coros) -> None:
        try:
            if self._started:
                raise TransportError(f"{self.role} already started")
            await self._open()
        except BaseException:
            for coro in coros:  # never started: close them (no "never awaited" warnings)
                coro.close()
            raise
        self._started = True
        for coro in coros:
            task = asyncio.create_task(coro, name=f"kv-{self.role}-{coro.__name__}")
            task.add_done_callback(self._task_done)
            self._tasks.append(task)

    def _task_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._closed:
            return
        exc = task.exception()
        if exc is not None and self.error is None:
            self.error = exc
            log.error("%s task %s crashed", self.role, task.get_name(), exc_info=exc)
            self._fail_all(f"transport crashed: {exc!r}")

    async def _stop_tasks(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.close_timeout_s)
        self._tasks = []
        await self._shutdown()

    def _check_usable(self) -> None:
        if self.error is not None:
            raise TransportError(f"{self.role} crashed: {self.error!r}") from self.error
        if not self._started or self._closed or self._closing:
            raise TransportError(f"{self.role} is not started or already closed")

    def _remember(self, status: TransferStatus) -> None:
        """Keep finished statuses (for poll and to recognise late messages), bounded."""
        self._history[status.transfer_id] = status
        while len(self._history) > self.config.history:
            self._history.popitem(last=False)

    def _fail_all(self, reason: str) -> None:
        raise NotImplementedError

    # ---- sends ------------------------------------------------------------------------------
    async def _emit(self, frames: list, kind: str, owners: list, peer: bytes | None = None) -> None:
        """Send one message through the fault injector, bounded by send_timeout_s.

        A send that times out or fails fails the transfers in `owners`.
        """
        fault = self.faults.decide(kind)
        if fault is Fault.DROP:
            return
        if fault is Fault.DISCONNECT:
            await self._reset()
            self._on_disconnected()
            return
        if fault is Fault.DELAY:
            await asyncio.sleep(self.config.faults.delay_s)
        elif fault in (Fault.CORRUPT, Fault.TRUNCATE):
            frames = self.faults.mangle(fault, frames)
        try:
            for _ in range(2 if fault is Fault.DUPLICATE else 1):
                await bounded(self._write(frames, peer), self.config.send_timeout_s)
        except asyncio.TimeoutError:
            await self._emit_failed(owners, f"send timed out after {self.config.send_timeout_s}s")
        except (TransportError, *self.send_errors) as e:
            await self._emit_failed(owners, f"send failed: {e!r}")

    async def _emit_failed(self, owners: list, reason: str) -> None:
        raise NotImplementedError

    def _on_disconnected(self) -> None:
        pass

    # ---- I/O hooks (backends) ---------------------------------------------------------------
    async def _open(self) -> None:
        raise NotImplementedError

    def _write(self, frames: list, peer: bytes | None):
        raise NotImplementedError

    async def _read(self, timeout: float):
        raise NotImplementedError

    async def _reset(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError
