"""`FailCode`: every way a KV transfer fails, one string member each.

The receiver sends the code in `Nack.code`, the sender puts the same member in
`TransferStatus.code`, and the prefill node decides on it: retry (NO_PAGES), move to another
decode node, or fail the request (BAD_METADATA). The value is what travels on the wire.
"""
from __future__ import annotations

import enum


class FailCode(str, enum.Enum):
    """Why a transfer failed; the value is what travels on the wire."""

    NO_PAGES = "no_pages"  # no room in the receiver's pool for the moment: retry later (backpressure)
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
