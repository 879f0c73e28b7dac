"""`KVSenders`: one started KV sender per destination address (the prefill node's hand-offs, a
decode node's migrations).

A node's KV senders, one per destination address, started on first use: the prefill node's
hand-offs and a decode node's live migrations go through the same kind of pool."""
from __future__ import annotations

import asyncio
import collections
import dataclasses

from kv_transport import TransferStatus, TransportConfig, make_sender
from pdtb.engine.kv_spec import KVSpec

COUNTS = ("one_sided", "read_by_receiver")  # senders' transfer counts (shm) kept across their lives


class KVSenders:
    def __init__(self, transport: TransportConfig, spec: KVSpec) -> None:
        self.transport, self.spec = transport, spec
        self.by_addr: dict[str, object] = {}  # destination KV address -> its sender
        self._gone: collections.Counter = collections.Counter()  # COUNTS of senders dropped or closed

    @property
    def one_sided(self) -> int:
        """Transfers written straight into a receiver's pool (shm backend), so far."""
        return self._count("one_sided")

    @property
    def read_by_receiver(self) -> int:
        """Transfers the receiver read from the sender's export arena (shm backend), so far."""
        return self._count("read_by_receiver")

    def _count(self, name: str) -> int:
        return self._gone[name] + sum(getattr(s, name, 0) for s in self.by_addr.values())

    def _forget(self, s) -> None:
        for name in COUNTS:
            self._gone[name] += getattr(s, name, 0)

    async def get(self, addr: str):
        """The started sender to `addr` (a new one if there is none yet)."""
        s = self.by_addr.get(addr)
        if s is None:
            s = make_sender(dataclasses.replace(self.transport, endpoint=addr), self.spec)
            await s.start()
            if s.config.faults != self.transport.faults:  # a fault window began or ended during the start
                s.set_faults(self.transport.faults)
            self.by_addr[addr] = s
        return s

    def poll(self, addr: str, transfer_id: str) -> TransferStatus | None:
        s = self.by_addr.get(addr)
        return s.poll(transfer_id) if s is not None else None

    def cancel(self, addr: str, transfer_id: str, reason: str) -> None:
        s = self.by_addr.get(addr)
        if s is not None:
            s.cancel(transfer_id, reason)

    def drop(self, addr: str) -> None:
        """A sender that failed: the next transfer to `addr` starts a new one."""
        s = self.by_addr.pop(addr, None)
        if s is not None:
            self._forget(s)
            asyncio.get_running_loop().create_task(s.close())

    def set_faults(self, faults) -> None:
        """Faults on every KV send from now on: the started senders' and those started later."""
        self.transport = dataclasses.replace(self.transport, faults=faults)
        for s in self.by_addr.values():
            s.set_faults(faults)

    async def close(self) -> None:
        for s in self.by_addr.values():
            self._forget(s)
            await s.close()
        self.by_addr.clear()
