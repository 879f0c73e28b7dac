"""The one transport interface: what a node sees of a KV transfer, whatever the backend.

Sender (prefill side), inside the node's asyncio loop:

    sender = make_sender(config, spec); await sender.start()
    tid = sender.send(export, TransferMeta(...))    # never blocks; state BOOTSTRAPPING
    sender.poll(tid).state                          # ... WAITING, TRANSFERRING, DONE | FAILED
    await sender.wait(tid, timeout)                 # optional, bounded

Receiver (decode side):

    receiver = make_receiver(config, pool, admit=policy); await receiver.start()
    for t in receiver.take_completed(): ...         # ReceivedTransfer: pages are RESIDENT
    t = await receiver.next_completed(timeout)      # or wait, bounded

Page ownership across a transfer:
- receiver: pages are RESERVED under `request_id` from the header until the payload is
  verified (then committed: RESIDENT, handed over in a ReceivedTransfer) or the transfer
  fails, times out or is cancelled (then freed by the transport before the NACK is sent).
- sender: `KVExport.data` is a copy of the pages; the transport only holds a reference to it.
  The caller owns its pool pages throughout and frees them when it sees DONE or FAILED.
  A FAILED transfer may still have been committed on the receiver if only the ACK was lost;
  the node layer resolves that with a request-level abort.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kv_transport.fail_codes import FailCode

if TYPE_CHECKING:  # (torch only where pages move: the simulator imports this package without it)
    from pdtb.engine.kv_export import KVExport
    import torch


class TransportError(RuntimeError):
    """The transport itself is unusable (closed, crashed, process group broken)."""


class TransferState(enum.IntEnum):
    """Ordered: every state >= DONE is final."""

    BOOTSTRAPPING = 0  # created; the receiver has not heard of it yet
    WAITING = 1  # announced; waiting for the receiver to reserve pages (credits)
    TRANSFERRING = 2  # payload in flight (sender: until the ACK)
    DONE = 3  # receiver verified and committed the pages
    FAILED = 4  # see TransferStatus.reason; nothing stays reserved on the receiver

    @property
    def finished(self) -> bool:
        return self >= TransferState.DONE


@dataclass
class TransferStatus:
    """Snapshot of one transfer, as returned by poll(). Times are time.monotonic()."""

    transfer_id: str
    request_id: str
    state: TransferState
    code: FailCode | None = None  # why it FAILED, as a code (the receiver's Nack.code unchanged)
    reason: str | None = None  # why it FAILED, in words
    bytes_total: int = 0  # payload bytes of the transfer
    bytes_done: int = 0  # payload bytes sent (sender) or written into pages (receiver)
    t_created: float = 0.0  # send() called / header received
    t_started: float | None = None  # first payload byte sent or received
    t_finished: float | None = None  # reached DONE or FAILED

    @property
    def duration_s(self) -> float | None:
        return None if self.t_finished is None else self.t_finished - self.t_created

    def snapshot(self) -> "TransferStatus":
        return dataclasses.replace(self)


@dataclass(frozen=True)
class TransferMeta:
    """Sequence state that travels with the KV (see wire.KVTransferHeader)."""

    tenant: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    extra: dict = field(default_factory=dict)  # msgpack-safe values only
    page_hashes: list[int] = field(default_factory=list)  # hashes of the full pages (prefix cache)


@dataclass
class ReceivedTransfer:
    """A completed inbound transfer: its pages are committed (RESIDENT) in the receiver pool
    under `request_id`, in the order of the sender's page table. A read-only value (not
    frozen only because a frozen __init__ is slow on the small-request path)."""

    transfer_id: str
    request_id: str
    tenant: str
    num_tokens: int  # tokens whose K/V are in `pages`
    pages: list[int]  # page table in the receiver's pool
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    extra: dict
    status: TransferStatus  # final status (DONE), with timings
    tier: str = "device"  # pool the pages were committed in: "device" or "host" (parked)
    skip_pages: int = 0  # leading pages shared from the receiver's prefix cache, not sent
    page_hashes: list[int] = field(default_factory=list)  # hashes of the request's full pages


class KVSender(Protocol):
    """Sending side of a transport. All methods run in the owner's event loop."""

    async def start(self) -> None:
        """Connect and start the background tasks."""

    def send(self, export: KVExport, meta: TransferMeta | None = None) -> str:
        """Queue `export` for transfer and return its transfer id. Never blocks."""

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        """Where to gather an export that goes to this sender (export_request(out=...)), when
        the backend sends it faster from there (shm: its export arena); None: anywhere."""

    def poll(self, transfer_id: str) -> TransferStatus | None:
        """Current status without blocking; None if unknown or forgotten (see config.history)."""

    async def wait(self, transfer_id: str, timeout: float | None = None) -> TransferStatus:
        """Wait until finished or `timeout` (default: the transfer timeout) passes."""

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Fail the transfer now and tell the receiver to free its pages."""

    async def close(self) -> None:
        """Fail unfinished transfers, stop tasks, close sockets (linger 0). Bounded."""


class KVReceiver(Protocol):
    """Receiving side of a transport. Writes payloads straight into the pool's pages."""

    endpoint: str  # where senders connect (ephemeral port or ipc path resolved)

    async def start(self) -> None:
        """Bind and start the background tasks."""

    def poll(self, transfer_id: str) -> TransferStatus | None:
        """Current status of an inbound transfer without blocking."""

    def take_completed(self) -> list[ReceivedTransfer]:
        """Completed transfers not yet taken, oldest first. Never blocks."""

    async def next_completed(self, timeout: float) -> ReceivedTransfer | None:
        """The next completed transfer, or None after `timeout` seconds."""

    def cancel(self, transfer_id: str, reason: str = "cancelled") -> None:
        """Fail an inbound transfer now: free its reserved pages and NACK the sender."""

    async def close(self) -> None:
        """Fail unfinished transfers (freeing their pages), stop tasks, close sockets."""
