"""pdtb/router/half_close.py on aiohttp itself: a client that half-closes after its request is
answered, one whose body was cut short is not (closed at once, as aiohttp does), and aiohttp
alone answers neither: the behaviour the module works around (checked on aiohttp 3.14.5)."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from pdtb.router.half_close import HalfCloseRunner, peer_eof

REQUEST = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def answer(request: web.Request) -> web.Response:
    await request.read()
    eof = peer_eof(request)
    if eof is not None:
        await asyncio.wait_for(eof.wait(), 5)  # answered only once the client's input ended
    return web.json_response({"ok": True, "saw_eof": eof is not None})


async def exchange(runner_cls, data: bytes) -> bytes:
    """Serve `answer` with `runner_cls`; send `data`, shut the sending side, read to the end."""
    app = web.Application()
    app.router.add_post("/x", answer)
    runner = runner_cls(app, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.addresses[0][1])
        writer.write(data)
        await writer.drain()
        writer.write_eof()  # shutdown(SHUT_WR): the request is all there is
        got = await asyncio.wait_for(reader.read(), 10)  # to the server's close
        writer.close()
        return got
    finally:
        await asyncio.wait_for(runner.cleanup(), 10)


def test_a_half_closed_client_is_answered_then_the_connection_closes():
    got = asyncio.run(exchange(HalfCloseRunner, REQUEST))
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"ok": true, "saw_eof": true}'


def test_aiohttp_alone_answers_a_half_closed_client_nothing():
    assert asyncio.run(exchange(web.AppRunner, REQUEST)) == b""


@pytest.mark.parametrize("runner_cls", [HalfCloseRunner, web.AppRunner])
def test_a_body_cut_short_is_not_answered(runner_cls):
    assert asyncio.run(exchange(runner_cls, REQUEST[:-1])) == b""


def test_a_client_that_sends_nothing_is_closed():
    assert asyncio.run(exchange(HalfCloseRunner, b"")) == b""


def test_requests_before_the_half_close_are_all_answered():
    got = asyncio.run(exchange(HalfCloseRunner, REQUEST * 2))
    assert got.count(b"HTTP/1.1 200 ") == 2 and got.endswith(b'"saw_eof": true}')


def test_a_socket_shutdown_is_what_the_test_client_does():
    """(exchange's write_eof is a socket shutdown of the sending side, as curl --no-buffer with
    a closed stdin or a proxy does)"""
    a, b = socket.socketpair()
    with a, b:
        a.shutdown(socket.SHUT_WR)
        assert b.recv(1) == b""
        b.sendall(b"still open")
        assert a.recv(16) == b"still open"


def test_the_installed_aiohttp_is_one_the_internals_were_checked_on():
    from pdtb.router import half_close

    # a new aiohttp minor version: check half_close.py's internals on it, then add it to CHECKED
    assert half_close.supported(), f"aiohttp {__import__('aiohttp').__version__} not in {half_close.CHECKED}"


def test_an_unchecked_aiohttp_gets_its_own_runner_and_a_warning(caplog):
    from pdtb.router import half_close

    assert not half_close.supported("3.9.5") and not half_close.supported("4.0.0") and not half_close.supported("dev")
    app = web.Application()
    with caplog.at_level("WARNING", logger="pdtb.router.half_close"):
        runner = half_close.make_runner(app, version="3.9.5")
    assert type(runner) is web.AppRunner and "3.9.5" in caplog.text
    assert type(half_close.make_runner(web.Application())) is HalfCloseRunner
