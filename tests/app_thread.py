"""An aiohttp app served from a thread with its own event loop, for tests that drive a client
whose own loop runs in the test's thread (the bench CLIs call asyncio.run themselves)."""
from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Iterator

from aiohttp import web


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on an ephemeral loopback port: (its runner, its base URL)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@contextmanager
def app_in_thread(app: web.Application, timeout: float = 10.0) -> Iterator[str]:
    """Yield the URL of `app` served from a background thread; stop it on the way out (bounded)."""
    loop, ready, box = asyncio.new_event_loop(), threading.Event(), {}

    def serve():
        asyncio.set_event_loop(loop)
        box["runner"], box["url"] = loop.run_until_complete(start(app))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(timeout), "the app did not start"
    try:
        yield box["url"]
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        loop.close()
