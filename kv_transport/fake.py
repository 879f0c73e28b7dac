"""In-process fake transport: the real sender/receiver state machines over asyncio queues.

Messages still go through `wire.encode`/`wire.decode` and the fault injector; each frame is
copied once on the way, as crossing a process boundary would. A `FakeNetwork` is passed
explicitly to every endpoint that should see each other (no module-level registry):

    net = FakeNetwork()
    rx = FakeReceiver(replace(cfg, endpoint="fake://decode0"), pool, network=net)
    tx = FakeSender(replace(cfg, endpoint="fake://decode0"), spec, network=net)
"""
from __future__ import annotations

import asyncio
import itertools

from kv_transport.base import TransportError
from kv_transport.config import TransportConfig
from kv_transport.receiver import ReceiverCore
from kv_transport.sender import SenderCore
from kv_transport.wire_check import frame_view
from kv_transport.wire import AdmitFn
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool


def _copy(frames: list) -> list[bytearray]:
    return [bytearray(frame_view(f)) for f in frames]


class FakeNetwork:
    """Endpoint name -> receiver inbox, plus one reply queue per connected sender."""

    def __init__(self, hwm: int = 64) -> None:
        self.hwm = hwm
        self._inboxes: dict[str, asyncio.Queue] = {}
        self._replies: dict[bytes, asyncio.Queue] = {}
        self._ids = itertools.count()

    def bind(self, endpoint: str) -> asyncio.Queue:
        if endpoint in self._inboxes:
            raise TransportError(f"{endpoint} is already bound")
        q: asyncio.Queue = asyncio.Queue(self.hwm)
        self._inboxes[endpoint] = q
        return q

    def unbind(self, endpoint: str) -> None:
        self._inboxes.pop(endpoint, None)

    def connect(self) -> tuple[bytes, asyncio.Queue]:
        peer = f"peer-{next(self._ids)}".encode()
        q: asyncio.Queue = asyncio.Queue(self.hwm)
        self._replies[peer] = q
        return peer, q

    def disconnect(self, peer: bytes) -> None:
        self._replies.pop(peer, None)

    async def to_receiver(self, endpoint: str, peer: bytes, frames: list) -> None:
        q = self._inboxes.get(endpoint)
        if q is None:
            raise TransportError(f"nothing bound at {endpoint}")
        await q.put((peer, _copy(frames)))

    async def to_sender(self, peer: bytes, frames: list) -> None:
        q = self._replies.get(peer)
        if q is None:
            raise TransportError(f"peer {peer!r} is gone")
        await q.put(_copy(frames))


async def _get(q: asyncio.Queue, timeout: float):
    try:
        return await asyncio.wait_for(q.get(), timeout)
    except asyncio.TimeoutError:
        return None


class FakeSender(SenderCore):
    """SenderCore over a FakeNetwork."""

    def __init__(self, config: TransportConfig, spec: KVSpec, network: FakeNetwork,
                 name: str = "fake-tx") -> None:
        super().__init__(config, spec, name)
        self.network = network
        self._peer = b""
        self._inbox: asyncio.Queue | None = None

    async def _open(self) -> None:
        self._peer, self._inbox = self.network.connect()

    def _write(self, frames: list, peer: bytes | None):
        return self.network.to_receiver(self.config.endpoint, self._peer, frames)

    async def _read(self, timeout: float):
        return await _get(self._inbox, timeout)

    async def _reset(self) -> None:
        self.network.disconnect(self._peer)  # replies to the old identity are lost
        await self._open()

    async def _shutdown(self) -> None:
        self.network.disconnect(self._peer)


class FakeReceiver(ReceiverCore):
    """ReceiverCore over a FakeNetwork."""

    def __init__(self, config: TransportConfig, pool: PagePool, network: FakeNetwork,
                 admit: AdmitFn | None = None) -> None:
        super().__init__(config, pool, admit)
        self.network = network
        self._inbox: asyncio.Queue | None = None

    async def _open(self) -> None:
        self._inbox = self.network.bind(self.endpoint)

    def _write(self, frames: list, peer: bytes | None):
        return self.network.to_sender(peer, frames)

    async def _read(self, timeout: float):
        return await _get(self._inbox, timeout)

    async def _reset(self) -> None:
        pass

    async def _shutdown(self) -> None:
        self.network.unbind(self.endpoint)
