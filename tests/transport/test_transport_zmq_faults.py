"""Fault injection through the real ZeroMQ backend (sender and receiver in one loop, ipc)."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from kv_transport import FaultConfig, TransferState, TransportConfig
from kv_transport.testing import TINY_SPEC, linked, make_export, make_pool
from kv_transport.zmq_backend import ZmqReceiver

PAGE = TINY_SPEC.bytes_per_page


@contextlib.contextmanager
def stranger(endpoint: str):
    """A raw DEALER socket connected to `endpoint` (another connection than the sender's)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("faults,reason", [
    (FaultConfig(disconnect_after_chunks=2), "disconnected"),
    (FaultConfig(corrupt_prob=1, kinds=("chunk",), max_faults=1), "checksum"),
    (FaultConfig(truncate_prob=1, kinds=("header",), max_faults=1), "payload"),
    (FaultConfig(drop_prob=1, kinds=("chunk",), max_faults=1), "missing"),
], ids=["disconnect", "corrupt", "truncate", "drop"])
def test_zmq_fault_then_recovery(faults, reason, tmp_path):
    config = TransportConfig(endpoint=f"ipc://{tmp_path}/kv.sock", chunk_bytes=2 * PAGE,
                             window=2, inline_max_bytes=PAGE, transfer_timeout_s=1.0,
                             idle_timeout_s=0.5, send_timeout_s=0.5, tick_s=0.01)
    src, dst = make_pool(64, seed=5), make_pool(64)

    async def body():
        async with linked(config, dst, faults=faults) as (tx, rx):
            pages = 1 if "header" in faults.kinds and faults.truncate_prob else 9
            t0 = time.monotonic()
            status = await tx.wait(tx.send(make_export(src, "bad", pages)), 3.0)
            assert status.state is TransferState.FAILED and reason in f"{status.code}: {status.reason}", status
            assert time.monotonic() - t0 < 1.5
            deadline = time.monotonic() + 2.0
            while dst.state_counts()["reserved"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert dst.state_counts()["reserved"] == 0
            dst.check()
            good = make_export(src, "good", 9)
            status = await tx.wait(tx.send(good), 3.0)
            assert status.state is TransferState.DONE, status.reason
            got = await rx.next_completed(2.0)
            assert got.request_id == "good"
            assert torch.equal(dst.export_pages(got.pages), good.data)
    asyncio.run(asyncio.wait_for(body(), 20))


@pytest.mark.parametrize("kind", ["cancel", "malformed chunk"])
def test_a_message_from_another_connection_is_discarded(tmp_path, kind):
    """Only the connection that announced a transfer may feed or cancel it: a Cancel for a
    live transfer id sent over another socket is discarded, and so is a malformed message naming
    it (a chunk whose payload is not its nbytes); the transfer completes (no peer can end
    another's transfer)."""
    from kv_transport.wire import Cancel, KVChunk, encode

    config = TransportConfig(endpoint=f"ipc://{tmp_path}/kv.sock", chunk_bytes=2 * PAGE, window=1,
                             inline_max_bytes=PAGE, transfer_timeout_s=5.0, tick_s=0.01)
    src, dst = make_pool(64, seed=5), make_pool(64)
    slow = FaultConfig(delay_prob=1, delay_s=0.03, kinds=("chunk",))

    async def body():
        async with linked(config, dst, faults=slow) as (tx, rx):
            with stranger(rx.endpoint) as other:
                export = make_export(src, "victim", 12)
                tid = tx.send(export)
                while dst.state_counts()["reserved"] == 0:
                    await asyncio.sleep(0.005)
                other.send_multipart(encode(Cancel(tid, "not yours")) if kind == "cancel"
                                     else encode(KVChunk(tid, 0, 0, 2 * PAGE, 1), [b"x"]))
                status = await tx.wait(tid, 5.0)
            assert status.state is TransferState.DONE, status.reason
            got = await rx.next_completed(2.0)
            assert torch.equal(dst.export_pages(got.pages), export.data)
    asyncio.run(asyncio.wait_for(body(), 20))


def test_every_transfer_of_a_bad_batch_is_nacked(tmp_path):
    """A batch of inline headers, one of them not inline: the batch is refused, and each
    transfer it names gets a Nack at once (none is left to its sender's timeout); the pool
    holds nothing."""
    from tests.transport.test_transport_wire import make_header, payload

    from kv_transport.wire import Nack, TransferBatch, decode, encode

    config = TransportConfig(endpoint=f"ipc://{tmp_path}/kv.sock", tick_s=0.01)
    dst = make_pool(16)

    async def body():
        rx = ZmqReceiver(config, dst)
        await rx.start()
        try:
            with stranger(rx.endpoint) as sock:
                batch = TransferBatch([make_header(1, transfer_id="t0"), make_header(3, mode="chunked", transfer_id="t1"),
                                       make_header(1, transfer_id="t2")])
                sock.send_multipart(encode(batch, [payload(1), payload(1)]))
                nacked = set()
                deadline = time.monotonic() + 5
                while len(nacked) < 3 and time.monotonic() < deadline:
                    if sock.poll(0):
                        m = decode(sock.recv_multipart(), rx.limits).msg
                        assert isinstance(m, Nack) and str(m.code) == "bad_message", m
                        nacked.add(m.transfer_id)
                    else:
                        await asyncio.sleep(0.01)
            assert nacked == {"t0", "t1", "t2"}
            assert dst.num_free == 16
            dst.check()
        finally:
            await rx.close()
    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_second_receiver_cannot_take_over_a_live_ipc_path(tmp_path):
    """libzmq binds over an ipc path another process listens on, silently, and the first
    receiver's close then unlinks the second's socket file (a restart case). The second bind
    is refused while the first lives, and succeeds over a dead one's stale file."""
    from kv_transport.base import TransportError

    endpoint = f"ipc://{tmp_path}/shared.sock"

    async def body():
        first = ZmqReceiver(TransportConfig(endpoint=endpoint), make_pool(8))
        await first.start()
        with pytest.raises(TransportError, match="listening"):
            await ZmqReceiver(TransportConfig(endpoint=endpoint), make_pool(8)).start()
        await first.close()
        open(f"{tmp_path}/shared.sock", "w").close()  # a stale file, nobody listening
        second = ZmqReceiver(TransportConfig(endpoint=endpoint), make_pool(8))
        await second.start()
        await second.close()
    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_peer_that_never_reads_its_nacks_holds_only_its_own_replies(tmp_path):
    """A peer that sends bad batches and never reads the Nacks fills its queue at the receiver:
    the replies that do not fit are dropped at once (ROUTER_MANDATORY makes a full queue an
    error, not a wait), and the receiver goes on serving the other peers, instead of waiting on
    that one send for send_timeout_s."""
    import zmq

    from tests.transport.test_transport_wire import make_header, payload

    from kv_transport.wire import TransferBatch, encode

    config = TransportConfig(endpoint=f"ipc://{tmp_path}/kv.sock", hwm=8, window=2, send_timeout_s=60.0,
                             tick_s=0.01)
    src, dst = make_pool(32, seed=3), make_pool(64)

    async def body():
        async with linked(config, dst) as (tx, rx):
            with stranger(rx.endpoint) as deaf:
                deaf.setsockopt(zmq.RCVHWM, 1)
                deadline = time.monotonic() + 15
                i = 0
                while i < 1500 and time.monotonic() < deadline:  # (far more Nacks than its queue holds)
                    try:  # three Nacks each, never read (the receiver runs on this loop: never block it)
                        deaf.send_multipart(encode(TransferBatch([
                            make_header(1, transfer_id=f"a{i}"), make_header(3, mode="chunked", transfer_id=f"b{i}"),
                            make_header(1, transfer_id=f"c{i}")]), [payload(1), payload(1)]), flags=zmq.NOBLOCK)
                        i += 1
                    except zmq.Again:
                        pass
                    await asyncio.sleep(0)
                export = make_export(src, "served", 5)
                status = await tx.wait(tx.send(export), 10.0)  # (the deaf peer's send would hold it 60 s)
                assert status.state is TransferState.DONE, status
                got = await rx.next_completed(2.0)
                assert torch.equal(dst.export_pages(got.pages), export.data)
    asyncio.run(asyncio.wait_for(body(), 40))
