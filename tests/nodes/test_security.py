"""ZeroMQ CURVE on the control plane and the KV transport: a peer without the client key gets
nothing, a peer with it is served; everything binds to loopback by default."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import zmq
import zmq.asyncio

from pdtb.nodes.control import ControlServer
from pdtb.nodes.protocol import NodeStats, Ping, decode_message, encode_message
from pdtb.security import CurveKeys, generate, secure_client, start_authenticator
from kv_transport import TransferState, TransportConfig, make_receiver, make_sender
from pdtb.engine.kv_export import export_request
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

SPEC = KVSpec(2, 1, 4, 4, "float32")


async def _ask(ctx, addr, keys, timeout=1.5):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    secure_client(s, keys)
    s.connect(addr)
    try:
        try:  # a DEALER whose handshake was refused may have no pipe to queue on: the send waits
            await asyncio.wait_for(s.send(encode_message(Ping(7))), timeout)
        except asyncio.TimeoutError:
            return None
        if not await s.poll(int(timeout * 1000)):
            return None
        return decode_message(await s.recv())
    finally:
        s.close(linger=0)


def test_control_socket_requires_the_client_key(tmp_path):
    keys = CurveKeys.load(generate(tmp_path / "keys"))
    other = CurveKeys.load(generate(tmp_path / "other"))

    async def main():
        ctx = zmq.asyncio.Context()
        auth = start_authenticator(ctx, keys)
        stop = asyncio.Event()

        def handler(ident, msg):
            asyncio.get_running_loop().create_task(server.send(ident, NodeStats("n", "decode", msg.seq, 1, 1)))

        server = ControlServer(ctx, "tcp://127.0.0.1:0", handler, keys)
        assert server.address.startswith("tcp://127.0.0.1:")
        task = asyncio.create_task(server.serve(stop, tick_s=0.05))
        try:
            ok = await _ask(ctx, server.address, keys)
            plain = await _ask(ctx, server.address, None)
            wrong_client = dataclasses.replace(keys, client_public=other.client_public, client_secret=other.client_secret)
            stranger = await _ask(ctx, server.address, wrong_client)
        finally:
            stop.set()
            await task
            server.close()
            auth.stop()
            ctx.term()
        return ok, plain, stranger

    ok, plain, stranger = asyncio.run(main())
    assert isinstance(ok, NodeStats) and ok.seq == 7
    assert plain is None and stranger is None


def test_kv_transport_over_curve(tmp_path):
    generate(tmp_path / "keys")
    cfg = TransportConfig(endpoint="tcp://127.0.0.1:0", curve_dir=str(tmp_path / "keys"), transfer_timeout_s=5)

    async def main():
        src, dst = PagePool(SPEC, 8), PagePool(SPEC, 8)
        src.allocate("r", 3)
        src.kv.copy_(torch.randn_like(src.kv))
        ctx = zmq.asyncio.Context()
        auth = start_authenticator(ctx, CurveKeys.load(cfg.curve_dir))
        rx = make_receiver(cfg, dst, context=ctx)
        await rx.start()
        tx = make_sender(dataclasses.replace(cfg, endpoint=rx.endpoint), SPEC)
        await tx.start()
        try:
            tid = tx.send(export_request(src, "r", 10))
            st = await tx.wait(tid, 5)
            got = await rx.next_completed(5)
        finally:
            await tx.close()
            await rx.close()
            auth.stop()
            ctx.term()
        return st, got, src, dst

    st, got, src, dst = asyncio.run(main())
    assert st.state == TransferState.DONE
    assert torch.equal(dst.kv[:, :, got.pages], src.kv[:, :, src.pages_of("r")])


def test_missing_keys_are_a_clear_error(tmp_path):
    from pdtb.security import SecurityError

    with pytest.raises(SecurityError, match="server"):
        CurveKeys.load(tmp_path)
