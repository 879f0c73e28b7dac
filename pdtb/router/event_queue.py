"""A request's events at the router: a FIFO with one bounded wait, cheap per token.

`get(timeout)` returns at once when an event is queued (the common case under load) and
otherwise waits on one future with one timer; asyncio.Queue.get under `bounded` took a task,
a wait set and a timer per token. The same guarantees as pdtb/aio.py's `bounded`: a
cancellation of the caller propagates, and an event that arrives is never dropped (it stays in
the FIFO until `get` takes it).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class EventQueue:
    """Events put by the registry's reader, taken by the request's handler (one consumer)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def peek(self) -> Any:
        """The oldest event, left queued; IndexError when there is none."""
        return self._items[0]

    def get_nowait(self) -> Any:
        """The oldest event; IndexError when there is none."""
        return self._items.popleft()

    async def get(self, timeout: float) -> Any:
        """The oldest event, waiting at most `timeout` seconds; asyncio.TimeoutError if none came."""
        if self._items:
            return self._items.popleft()
        if self._waiter is not None:
            raise RuntimeError("EventQueue has one consumer")
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(timeout, _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None
        if self._items:  # (an event that came with the deadline wins over it)
            return self._items.popleft()
        raise asyncio.TimeoutError(f"no event within {timeout}s")


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
