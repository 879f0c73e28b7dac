"""`pdtb.aio.bounded`: never swallows its caller's cancellation, never drops a result."""
from __future__ import annotations

import asyncio

import pytest

from pdtb.aio import bounded


def test_a_cancellation_landing_as_the_awaited_item_arrives_still_cancels():
    """aiohttp cancels a handler whose client went away. If that lands in the loop turn in
    which the handler's `queue.get()` completed, `asyncio.wait_for` on Python 3.11 returned
    the item and the handler read on (CPython gh-86296): the request ran to max_tokens."""
    async def main() -> list:
        q: asyncio.Queue = asyncio.Queue()
        got: list = []

        async def reader() -> None:
            while True:
                got.append(await bounded(q.get(), 600))

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader waits on q.get()
        q.put_nowait(1)  # an item arrives ...
        await asyncio.sleep(0)  # ... the inner get() completes ...
        task.cancel()  # ... and the client goes away in the same turn
        for i in (2, 3):
            await asyncio.sleep(0.01)
            q.put_nowait(i)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 1.0)
        return got

    assert asyncio.run(main()) in ([], [1])  # nothing read after the cancellation


def test_within_times_out_and_returns():
    async def main():
        assert await bounded(asyncio.sleep(0, "x"), 1.0) == "x"
        with pytest.raises(asyncio.TimeoutError):
            await bounded(asyncio.sleep(5), 0.05)
    asyncio.run(main())
