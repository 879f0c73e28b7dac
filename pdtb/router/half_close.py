"""The HTTP runner that answers a client that half-closed (aiohttp internals, in this file only).

A client that half-closes its connection (shuts its sending side once its request is out) is
answered. aiohttp takes the end of a client's input for a disconnect and closes the connection,
answering nothing; this runner's connections keep their sending side open instead, answer the
requests they received, then close.

TCP cannot tell a half-close from a close until the server writes: a closed client's kernel
answers the first bytes with a reset, and the write after it fails. So once its client's input
has ended, a handler keeps writing to it while it waits (`peer_eof`): an SSE comment on a
stream, leading whitespace in an early-started JSON body (pdtb/router/completions.py).

aiohttp internals used here, and only here: the request handler's `eof_received`,
`data_received`, `_handle_request`, `close()`, its queue of parsed requests (`_messages`,
(message, body) pairs) and the future it waits on for the next (`_waiter`), the server's protocol factory (`__call__`, `_loop`, `_kwargs`) and the
runner's `_make_server`; the protocol's `writing_paused` (`write_cannot_wait`). Checked on
aiohttp 3.14.5 (tests/router/test_half_close.py, tests/router/test_router_stream_path.py). On
another minor version (`CHECKED`) `make_runner` gives aiohttp's own runner, which answers no
half-closed client, and says so once; `write_cannot_wait` then always says a write may wait.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

CHECKED = ((3, 14),)  # aiohttp minor versions whose internals this file was checked on (3.14.5)


def supported(version: str | None = None) -> bool:
    """Whether this aiohttp's internals are the ones this file was checked on."""
    try:
        major, minor = (int(x) for x in (version or aiohttp.__version__).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in CHECKED


def make_runner(app: web.Application, version: str | None = None, **kwargs) -> web.AppRunner:
    """HalfCloseRunner on a checked aiohttp, else aiohttp's own AppRunner (logged once)."""
    if supported(version):
        return HalfCloseRunner(app, **kwargs)
    log.warning("aiohttp %s is not among the versions the router's half-close support was checked on "
                "(%s): a client that half-closes its connection gets no answer", version or aiohttp.__version__,
                ", ".join(f"{a}.{b}" for a, b in CHECKED))
    return web.AppRunner(app, **kwargs)

HEARTBEAT_S = 1.0  # a closed client is found within two of these once its input ended
CHUNK_FRAMING = 16  # bytes HTTP/1.1 chunked encoding adds around a write (size line and CRLFs)


def write_cannot_wait(request: web.Request, nbytes: int) -> bool:
    """Whether a write of `nbytes` to `request`'s response completes without waiting on the
    client. aiohttp's write waits only in its drain, and only while the connection is paused;
    a paused connection resumes below the transport's low-water mark, so the buffer's size
    alone does not tell: not paused, and these bytes leave the buffer under the high-water
    mark (no pause begins with them)."""
    proto, tr = request.protocol, request.transport
    if proto is None or tr is None or tr.is_closing() or getattr(proto, "writing_paused", True):
        return False
    return tr.get_write_buffer_size() + nbytes + CHUNK_FRAMING < tr.get_write_buffer_limits()[1]


class _Handler(RequestHandler):
    __slots__ = ("peer_eof", "_last_body")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer_eof = asyncio.Event()
        self._last_body = None  # the body of the last request parsed: the only one that can be incomplete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:
            self._last_body = self._messages[-1][1]

    def eof_received(self) -> bool | None:
        idle = self._waiter is not None and not self._waiter.done() and not self._messages
        if idle or (self._last_body is not None and not self._last_body.is_eof()):
            return None  # nothing to answer, or a body cut short: aiohttp closes, as it does
        self.peer_eof.set()
        if not self._messages:
            self.close()  # none queued: close once the request in hand (if any) is answered
        return True  # the sending side stays open for the answers to what was received

    async def _handle_request(self, *args, **kwargs):
        try:
            return await super()._handle_request(*args, **kwargs)
        finally:
            if self.peer_eof.is_set() and not self._messages:
                self.close()  # the last request the client sent is answered: close after it


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class HalfCloseRunner(web.AppRunner):
    """web.AppRunner whose connections answer a client that half-closed."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # (the app builds the server; only its protocol factory differs)
        return server


def peer_eof(request: web.BaseRequest) -> asyncio.Event | None:
    """Set once the client's input ended (half-closed or closed); None outside HalfCloseRunner."""
    return getattr(request.protocol, "peer_eof", None)
