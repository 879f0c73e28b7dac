"""The typed seam between a KV transfer and the node that receives it.

A receiver asks its node's `admit(header)` before any payload byte, and gets an `Admission`:

    ACCEPT  reserve pages in the device pool and receive
    PARK    reserve pages in `pool` (the host tier: the request arrives parked)
    DEFER   refuse for now with FailCode.NO_PAGES; the sender keeps its pages and retries
    REFUSE  refuse for good with `code` (TOO_LARGE, DRAINING, BAD_METADATA)

Every way a transfer fails has a `FailCode`. The receiver sends it in `Nack.code`, the sender
puts the same member in `TransferStatus.code`, and the prefill node decides on it: retry
(NO_PAGES), move to another decode node, or fail the request (BAD_METADATA).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdtb.engine.page_pool import PagePool


class FailCode(str, enum.Enum):
    """Why a transfer failed; the value is what travels on the wire."""

    NO_PAGES = "no_pages"  # no room in the receiver's pool now: retry later (backpressure)
    TOO_LARGE = "too_large"  # the request can never fit the receiver's pool
    DRAINING = "draining"  # the receiving node is shutting down
    BAD_METADATA = "bad_metadata"  # the header's request metadata does not match its seal
    BUSY = "busy"  # the request already has a transfer in flight or pages at the receiver
    CLOSED = "closed"  # the transport is closing
    CHECKSUM = "checksum"  # a payload checksum did not match
    BAD_MESSAGE = "bad_message"  # a frame that does not decode or does not fit the transfer
    TIMEOUT = "timeout"  # not done within the transfer timeout, or no progress within the idle one
    CANCELLED = "cancelled"  # cancelled by either side
    PEER_LOST = "peer_lost"  # the connection to the other side dropped or could not send
    DIST_FAILED = "dist_failed"  # the torch.distributed process group is broken
    # the receiver no longer caches the leading pages the sender left out (skip_pages): resend them
    CACHE_MISS = "cache_miss"

    def __str__(self) -> str:
        return self.value


REFUSALS = (FailCode.NO_PAGES, FailCode.TOO_LARGE, FailCode.DRAINING, FailCode.BAD_METADATA)


class Verdict(enum.Enum):
    ACCEPT = "accept"
    PARK = "park"
    DEFER = "defer"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Admission:
    """A node's answer to a transfer header."""

    verdict: Verdict
    code: FailCode | None = None  # DEFER: NO_PAGES; REFUSE: why
    reason: str = ""  # human-readable detail, sent in the Nack
    pool: "PagePool | None" = None  # PARK: the pool (same geometry) to receive into

    @staticmethod
    def accept() -> "Admission":
        return _ACCEPT

    @staticmethod
    def park(pool: "PagePool") -> "Admission":
        return Admission(Verdict.PARK, pool=pool)

    @staticmethod
    def defer(reason: str) -> "Admission":
        return Admission(Verdict.DEFER, FailCode.NO_PAGES, reason)

    @staticmethod
    def refuse(code: FailCode, reason: str) -> "Admission":
        if code not in REFUSALS or code == FailCode.NO_PAGES:
            raise ValueError(f"{code!r} is not a refusal for good (DEFER is NO_PAGES)")
        return Admission(Verdict.REFUSE, code, reason)


_ACCEPT = Admission(Verdict.ACCEPT)
