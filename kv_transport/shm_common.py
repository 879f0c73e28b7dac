"""What the shm backend's sender and receiver share: limits, the piece size, non-blocking
reads of a ZeroMQ socket (the protocol: shm_backend.py)."""
from __future__ import annotations

import asyncio

import zmq

from kv_transport.base import TransferState
from pdtb.aio import bounded


S = TransferState
NUM_SLOTS = 1024  # one-sided transfers a receiver lets write at once (more get chunks)


# A piece is a quarter of what is left to write, at least one chunk_bytes and at most
# PIECE_MAX_CHUNKS of them: few Commits (each one wakes the receiver), small pieces at the end,
# so that the read-back of the last one, which nothing overlaps, is short, and no piece holds
# either loop for long (64 MiB in 4 MiB chunks: 16, 12, 9, 6.75, 5.06, 4, 4, 4, 3.19 MiB).
PIECE_SHARE = 4
PIECE_MAX_CHUNKS = 4
MESSAGES_PER_PIECE = 8  # with reads pending, waiting messages taken before the next piece (neither starves)
RELINK_AFTER_S = 10.0  # a link that could not be connected (refused, full) is tried again after this long


def piece_rows(left: int, chunk_rows: int) -> int:
    """Rows in the next piece when `left` rows are still to write, `chunk_rows` to a chunk."""
    return min(left, PIECE_MAX_CHUNKS * chunk_rows, max(chunk_rows, left // PIECE_SHARE))


def _recv_now(sock) -> list | None:
    """A message already waiting on `sock`, or None (asks libzmq first: no future for nothing)."""
    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        return None
    try:
        fut = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        return fut.result() if fut.done() else None
    except zmq.Again:
        return None


async def _next(ready: asyncio.Event, timeout: float) -> None:
    """Wait at most `timeout` seconds for `ready`."""
    try:
        await bounded(ready.wait(), timeout)
    except asyncio.TimeoutError:
        pass


def _split(frames: list | None):
    """(peer, frames) of a message from the receiver's ROUTER socket, or None."""
    return None if frames is None else (frames[0].bytes, frames[1:])


def _sent() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


LINK = b"link"  # (sender) `peer` of a message that goes on the local link
