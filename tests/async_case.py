"""Tests written as coroutines: `@async_test` runs one on a fresh event loop, bounded by a
timeout, so a hung await fails the test instead of holding the suite."""
from __future__ import annotations

import asyncio
import functools

DEFAULT_TIMEOUT_S = 120.0


def async_test(fn=None, *, timeout: float = DEFAULT_TIMEOUT_S):
    def wrap(f):
        @functools.wraps(f)  # pytest reads the fixtures from the wrapped signature
        def run(*args, **kwargs):
            return asyncio.run(asyncio.wait_for(f(*args, **kwargs), timeout))
        return run
    return wrap(fn) if fn is not None else wrap
