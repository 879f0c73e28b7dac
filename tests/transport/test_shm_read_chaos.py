"""Chaos on the shm backend's read path: a sender killed after offering its payload, a
receiver killed inside a read piece, a late read after the sender withdrew the payload and
gave its arena range to another export. No page is corrupted or leaked, no arena range is
handed out while a reader is in it, and every transfer ends."""
from __future__ import annotations

import asyncio
import gc
import hashlib

import torch

from chaos_util import until
from kv_transport import FaultConfig, TransferState, make_receiver, make_sender
from kv_transport.testing import TINY_SPEC, PeerProcess, make_export, make_pool, staged
from pdtb.engine.page_pool import PagePool
from tests.transport.test_shm_chaos import CHUNK, PAGE, cfg


def stalling_peer(tmp_path, *extra: str) -> PeerProcess:
    """A receiving child on the shm backend that reports what lands (`extra`: e.g. a stall)."""
    return PeerProcess(["--backend", "shm", "--endpoint", f"ipc://{tmp_path}/peer.sock", "--num-pages", "32",
                        "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(PAGE // 2), "--report", *extra])


async def offer_until_timeout(tx, src):
    """Send an export from `tx`'s arena to a receiver that stalls inside its first read piece;
    return it once the sender's transfer has timed out with the reader holding its slot."""
    e = staged(tx, make_export(src, "stalled", 9))
    tid = tx.send(e)
    slot = tx.offers._offered[tid][0]
    await until(lambda: tx.offers.slots.busy(slot), 20, "the reader holds its slot")
    st = await tx.wait(tid, 10)
    assert st.state is TransferState.FAILED and str(st.code) == "timeout", st
    return e


def test_a_sender_killed_after_its_offer_leaves_nothing_behind(tmp_path):
    """The receiver admits an offered payload and waits before reading (a late reader); the
    sender's process is killed meanwhile. The arena outlives it in the receiver's mapping: the
    read lands the sender's bytes intact, or the transfer fails; either way it ends and no page
    stays reserved."""
    dst = PagePool(TINY_SPEC, 16, shared=True)
    want = make_export(make_pool(9, seed=1), "sent", 9).data  # what the child gathers (bench_peer --role send)

    async def body():
        rx = make_receiver(cfg(tmp_path, faults=FaultConfig(shm_delay_s=1.0)), dst)
        await rx.start()
        child = PeerProcess(["--role", "send", "--backend", "shm", "--arena", "--endpoint", rx.endpoint,
                             "--send-pages", "9", "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(PAGE // 2),
                             "--timeout-s", "60"])
        try:
            assert "sent" in child.read_json(60)
            await until(lambda: bool(rx._reads), 20, "the offer admitted, its read pending")
            child.kill()
            await until(lambda: not rx._reads and not rx._live, 20, "the transfer ended")
            got = rx.take_completed()
            if got:
                assert torch.equal(dst.export_pages(got[0].pages), want)
                dst.free(got[0].request_id)
            assert dst.state_counts()["reserved"] == 0 and dst.num_free == 16
            dst.check()
        finally:
            child.kill()
            await rx.close()
    asyncio.run(asyncio.wait_for(body(), 90))


def test_a_receiver_killed_inside_a_read_keeps_the_range_until_it_is_gone(tmp_path):
    """The receiver stalls inside its first read piece, holding the read slot; the sender's
    transfer times out, but its withdraw cannot revoke the slot: the arena range stays out of
    the free list, export dropped or not. Once the receiver is killed the kernel drops its lock,
    the next tick revokes and the range comes back; a new receiver then reads a new export."""
    src = make_pool(32, seed=7)

    async def body():
        p = stalling_peer(tmp_path, "--shm-stall-s", "60")
        tx = make_sender(cfg(tmp_path, endpoint=p.endpoint(), transfer_timeout_s=1.0), TINY_SPEC)
        await tx.start()
        try:
            e = await offer_until_timeout(tx, src)
            del e
            gc.collect()
            await asyncio.sleep(0.1)  # ticks: the revoke is tried again, and fails
            arena = tx.offers.arena
            assert tx.offers.num_pending == 1 and arena.free_bytes < arena.nbytes
            p.kill()
            await until(lambda: tx.offers.num_pending == 0 and arena.free_bytes == arena.nbytes, 10,
                        "the range back once the reader is gone")
            p = stalling_peer(tmp_path)
            p.endpoint()
            good = staged(tx, make_export(src, "good", 9))
            st = await tx.wait(tx.send(good), 10)
            assert st.state is TransferState.DONE, st.reason
            r = p.read_json(10)
            assert r["request_id"] == "good" and tx.read_by_receiver == 1
            assert r["sha256"] == hashlib.sha256(good.data.numpy().tobytes()).hexdigest()
            counts = p.counts()
            assert counts["reserved"] == 0 and counts["resident"] == 0
        finally:
            await tx.close()
            p.kill()
    asyncio.run(asyncio.wait_for(body(), 90))


def test_a_late_read_after_the_offer_was_withdrawn_reads_nothing(tmp_path):
    """Transfer A is offered; the receiver admits it but reads late. The sender cancels A, the
    Cancel is lost, A is withdrawn and its export dies: its arena range goes to B's export,
    which is sent and lands. A's late read finds its slot revoked: it reads nothing (not B's
    bytes under A's name), fails, and frees A's pages."""
    dst = PagePool(TINY_SPEC, 32, shared=True)
    src = make_pool(32, seed=8)

    async def body():
        rx = make_receiver(cfg(tmp_path, faults=FaultConfig(shm_delay_s=1.0)), dst)
        await rx.start()
        tx = make_sender(cfg(tmp_path, endpoint=rx.endpoint, faults=FaultConfig(drop_prob=1, kinds=("cancel",))),
                         TINY_SPEC)
        await tx.start()
        try:
            a = staged(tx, make_export(src, "a", 9))
            a_off = tx.offers.arena.offset_of(a.data)
            a_id = tx.send(a)
            await until(lambda: a_id in rx._reads, 20, "A admitted, its read pending")
            tx.cancel(a_id, "gone")
            assert tx.offers.num_pending == 0  # withdrawn: nobody was reading yet
            del a
            gc.collect()
            b_export = make_export(src, "b", 9)
            b = staged(tx, b_export)
            assert tx.offers.arena.offset_of(b.data) == a_off  # A's range, handed out again
            b_id = tx.send(b)
            st = await tx.wait(b_id, 10)
            assert st.state is TransferState.DONE, st.reason
            got = await rx.next_completed(5)
            assert got.request_id == "b" and torch.equal(dst.export_pages(got.pages), b_export.data)
            ra = rx.poll(a_id)
            assert ra.state is TransferState.FAILED and "withdrew" in ra.reason and ra.bytes_done == 0, ra
            assert rx.reads == 1
            dst.free("b")
            assert dst.state_counts()["reserved"] == 0 and dst.num_free == 32
            dst.check()
        finally:
            await tx.close()
            await rx.close()
    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_reader_inside_a_piece_when_the_offer_is_withdrawn_stops_at_the_next(tmp_path):
    """The receiver stalls inside its first read piece; the sender's transfer times out and
    withdraws the offer while the reader holds the slot (its Cancel is lost). The withdraw
    clears the slot's word at once: when the reader comes out it finds the offer gone at its
    next piece, fails the transfer and frees its pages (it does not finish reading a transfer
    its sender has failed), and the sender's next retry gets the range back."""
    src = make_pool(32, seed=12)

    async def body():
        p = stalling_peer(tmp_path, "--shm-stall-s", "2")
        tx = make_sender(cfg(tmp_path, endpoint=p.endpoint(), transfer_timeout_s=1.0,
                             faults=FaultConfig(drop_prob=1, kinds=("cancel",))), TINY_SPEC)
        await tx.start()
        try:
            e = await offer_until_timeout(tx, src)
            assert tx.offers.num_pending == 1  # the reader is still inside its piece
            del e
            gc.collect()
            arena = tx.offers.arena
            await until(lambda: tx.offers.num_pending == 0 and arena.free_bytes == arena.nbytes, 20,
                        "the range back once the reader is out")
            p.proc.stdin.write(b"stats\n")
            p.proc.stdin.flush()
            seen = []
            while "counts" not in (msg := p.read_json(10)):
                seen.append(msg)
            assert not [m for m in seen if m.get("request_id") == "stalled"], seen  # never landed
            assert msg["counts"]["reserved"] == 0 and msg["counts"]["resident"] == 0
        finally:
            await tx.close()
            p.kill()
    asyncio.run(asyncio.wait_for(body(), 60))
