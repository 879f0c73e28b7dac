"""The local link (kv_transport/local_link.py): framing, tickets, and what a bad peer gets."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import pytest

from chaos_util import until
from kv_transport.local_link import HELLO, LinkClient, LinkError, LinkListener, _Framer, pack


def wire_bytes(frames: list) -> bytes:
    return b"".join(bytes(b) for b in pack(frames))


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def feed(framer: _Framer, data: bytes) -> list[list[bytes]]:
    """Every whole message `data` completes, as a connection reads them."""
    framer.buf += data
    out = []
    while (frames := framer.next()) is not None:
        out.append(frames)
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_frames_come_out_whole_however_the_stream_is_split(step):
    messages = [[b"header", b"x" * 300], [b""], [bytes(range(256)) * 3, b"a", b"bc"]]
    stream = b"".join(wire_bytes(m) for m in messages)
    framer, got = _Framer(max_frames=4, max_bytes=4096), []
    for i in range(0, len(stream), step):
        got += feed(framer, stream[i:i + step])
    assert got == messages and not framer.buf


@pytest.mark.parametrize("head", [struct.pack("<I", 0), struct.pack("<I", 5),
                                  struct.pack("<3I", 2, 4000, 97)], ids=["no-frames", "too-many", "too-big"])
def test_a_message_over_the_limits_is_refused_before_its_bytes(head):
    with pytest.raises(LinkError):
        feed(_Framer(max_frames=4, max_bytes=4096), head)


def test_tickets_name_peers_and_the_oldest_lapse():
    listener = LinkListener(4, 1024)
    a, b = listener.ticket(b"a", limit=2), listener.ticket(b"b", limit=2)
    assert listener.ticket(b"a", limit=2) == a and a != b
    listener.ticket(b"c", limit=2)  # a's ticket lapses
    assert a not in listener._tickets and b in listener._tickets and b"a" not in listener._ticket_of


def test_a_link_carries_messages_both_ways_as_the_peer_its_ticket_names():
    async def body():
        client = LinkClient(4, 1 << 20)
        async with listening() as (listener, _), contextlib.AsyncExitStack() as stack:
            stack.callback(client.close)
            await client.connect(listener.name, listener.ticket(b"peer-1"), 5)
            client.send([b"a", memoryview(b"bc")])
            await until(lambda: listener.queue, 5, "the message arrives")
            assert listener.take() == (b"peer-1", [b"a", b"bc"]) and listener.linked(b"peer-1")
            listener.send(b"peer-1", [b"answer"])
            await until(lambda: client.queue, 5, "the answer arrives")
            assert client.take() == [b"answer"]
            with pytest.raises(LinkError):
                listener.send(b"peer-2", [b"x"])  # nobody linked as peer-2
            listener.send(b"peer-1", [b"last words"])  # then the listener goes away
            await listener.close()
            await until(lambda: not client.up, 5, "the client learns the link ended")
            assert not client.ended  # what came before the end is still to be read
            assert client.take() == [b"last words"] and client.ended
            with pytest.raises(LinkError):
                client.send([b"late"])
    run(body())


async def stranger(listener: LinkListener) -> socket.socket:
    """A plain socket connected to the listener, as any local process could open one."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, listener.name)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def listening():
    """A started listener and a way to open stranger sockets to it; all closed on the way out."""
    listener = LinkListener(4, 1 << 20)
    await listener.start()
    socks: list[socket.socket] = []

    async def connect() -> socket.socket:
        socks.append(await stranger(listener))
        return socks[-1]
    try:
        yield listener, connect
    finally:
        for s in socks:
            s.close()
        await listener.close()


async def _closed_by_peer(sock: socket.socket, limit: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while loop.time() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 4096), 0.2)
        except asyncio.TimeoutError:
            continue
        except ConnectionError:
            return True
        if not data:
            return True
    return False


@pytest.mark.parametrize("first", [
    wire_bytes([HELLO, b"0" * 32]),  # a ticket nobody was given
    wire_bytes([b"hello", b"x"]),  # not the hello
    struct.pack("<I", 0xFFFFFFFF),  # garbage
    struct.pack("<3I", 2, 9, 1000),  # a first message larger than any hello
], ids=["wrong-ticket", "no-hello", "garbage", "big-first"])
def test_a_connection_without_a_valid_ticket_is_closed_and_nothing_is_dispatched(first):
    async def body():
        async with listening() as (listener, connect):
            listener.ticket(b"peer-1")
            sock = await connect()
            await asyncio.get_running_loop().sock_sendall(sock, first + wire_bytes([b"would-be message"]))
            assert await _closed_by_peer(sock)
            assert not listener.queue and not listener._links
    run(body())


def test_a_connection_that_ends_inside_a_message_dispatches_nothing_of_it():
    async def body():
        async with listening() as (listener, connect):
            ticket = listener.ticket(b"peer-1")
            sock = await connect()
            loop = asyncio.get_running_loop()
            whole = wire_bytes([b"whole"])
            await loop.sock_sendall(sock, wire_bytes([HELLO, ticket.encode()]) + whole + wire_bytes([b"cut" * 10])[:-5])
            await until(lambda: listener.queue, 5, "the whole message arrives")
            sock.close()
            await until(lambda: not listener._links, 5, "the link is dropped")
            assert listener.take() == (b"peer-1", [b"whole"]) and listener.take() is None
    run(body())


def test_bench_link_times_both_paths_between_two_processes():
    from pdtb.microbench import link as bench_link

    out = bench_link.run(50)
    assert out["n"] == 50 and set(out) == {"n", "zmq", "link", "ratio_median"}
    for path in ("zmq", "link"):
        assert 0 < out[path]["p10_us"] <= out[path]["median_us"]
    assert out["ratio_median"] == round(out["zmq"]["median_us"] / out["link"]["median_us"], 2)


def test_a_connection_that_shows_no_ticket_in_time_is_closed(monkeypatch):
    import kv_transport.local_link as ll

    monkeypatch.setattr(ll, "HELLO_TIMEOUT_S", 0.2)

    async def body():
        async with listening() as (listener, connect):
            assert await _closed_by_peer(await connect())  # said nothing: closed at the deadline
            await until(lambda: not listener._conns, 5, "the listener forgets it")
    run(body())


def test_only_so_many_connections_wait_for_their_ticket(monkeypatch):
    import kv_transport.local_link as ll

    monkeypatch.setattr(ll, "MAX_STRANGERS", 2)

    async def body():
        async with listening() as (listener, connect):
            socks = [await connect() for _ in range(3)]
            assert await _closed_by_peer(socks[2])  # the third stranger is turned away
            assert len(listener._conns) == 2 and all(c.peer is None for c in listener._conns)
    run(body())


def test_a_failed_connect_leaves_nothing_open():
    async def body():
        client = LinkClient(4, 1 << 20)
        async with listening() as (listener, _):
            with pytest.raises(LinkError, match="ASCII"):
                await client.connect(listener.name, "t\u00e9", 5)
            assert not client.up
            await until(lambda: not listener._conns, 5, "the listener sees it closed")
            with pytest.raises(OSError):
                await LinkClient(4, 1 << 20).connect("\0pdtb-link-nobody-here", "t", 5)
    run(body())
