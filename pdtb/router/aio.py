"""Bounded waits that never lose a cancellation.

aiohttp tells a handler that its client went away by cancelling the handler's task. On Python
3.11 and older, `asyncio.wait_for` swallows that cancellation when it lands in the loop turn in
which the awaited thing completed (CPython gh-86296, fixed in 3.12): the handler then goes on
reading tokens for a client that is gone, and the request runs to max_tokens holding its KV
pages. The router waits on every token and every write, so this was common (2-9 of 20
disconnected requests ran on, in one test). `within` uses `asyncio.timeout` where it exists.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float) -> T:
    """`await aw`, raising asyncio.TimeoutError after `timeout` seconds; a cancellation of the
    caller always propagates (on 3.10, which has no asyncio.timeout, this is wait_for)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover - Python 3.10
