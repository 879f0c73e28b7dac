"""The one bounded wait of the project: `bounded(aw, timeout)`.

Two guarantees that `asyncio.wait_for` does not give on every supported Python:

- A cancellation of the caller always propagates. aiohttp tells a handler that its client went
  away by cancelling the handler's task; on Python 3.11 and older `wait_for` swallows that
  cancellation when it lands in the loop turn in which the awaited thing completed (CPython
  gh-86296), and the router would read tokens on for a client that is gone, holding KV pages.
- A result that arrives is never dropped. On Python 3.12 and later `wait_for` can lose one when
  the awaited future completes in the same loop pass as the timeout fires (a loop busy past the
  deadline: a CUDA kernel's first launch, an engine step): for a zmq receive the message is gone
  from the socket, for a send it went out yet is reported as timed out.

The outcome is read off the future after `asyncio.wait`, and only a future still pending is
cancelled. A future already done (a zmq send or receive that completed at once, the common
case) returns without a timer.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """Await `aw` for at most `timeout` seconds; asyncio.TimeoutError if it is not done by then."""
    fut = asyncio.ensure_future(aw)
    if not fut.done():
        try:
            await asyncio.wait((fut,), timeout=timeout)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        if not fut.done():
            fut.cancel()
            raise asyncio.TimeoutError(f"not done within {timeout}s")
    return fut.result()
