"""Chaos on the one-sided (shm) backend: a sender killed while it holds its write slot, a
receiver killed under a granted transfer, a late write after the receiver reclaimed the
pages and gave them to another request. No page is corrupted or leaked; every transfer ends.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from chaos_util import until
from kv_transport import FaultConfig, TransferState, TransportConfig, make_receiver, make_sender
from kv_transport.testing import TINY_SPEC, PeerProcess, make_export, make_pool
from pdtb.engine.page_pool import PagePool

PAGE = TINY_SPEC.bytes_per_page
CHUNK = 2 * PAGE  # 9 pages x 8 rows: a one-sided write in many pieces


def cfg(tmp_path, **kw) -> TransportConfig:
    base = dict(backend="shm", endpoint=f"ipc://{tmp_path}/rx.sock", chunk_bytes=CHUNK, window=2,
                inline_max_bytes=PAGE // 2, transfer_timeout_s=10.0, idle_timeout_s=10.0, tick_s=0.01)
    return TransportConfig(**{**base, **kw})


def test_a_sender_killed_inside_a_piece_holds_its_pages_until_it_is_gone(tmp_path):
    """The receiver's timeout fires while the writer holds its slot: the pages stay RESERVED
    (no revoke can succeed, so nobody else gets them); once the process is killed, the kernel
    drops its lock and the next tick frees them. A new sender then gets the same pages, intact."""
    dst = PagePool(TINY_SPEC, 9, shared=True)  # exactly one request's pages: a reuse gets the same ones

    async def body():
        rx = make_receiver(cfg(tmp_path, transfer_timeout_s=1.0), dst)
        await rx.start()
        child = PeerProcess(["--role", "send", "--backend", "shm", "--endpoint", rx.endpoint, "--send-pages", "9",
                             "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(PAGE // 2),
                             "--shm-stall-s", "60", "--timeout-s", "60"])
        try:
            assert "sent" in child.read_json(60)
            await until(lambda: any(rx.slots.busy(g.slot) for g in rx._slot_of.values()), 20, "the writer holds its slot")
            await until(lambda: rx.num_held_pages == 9, 5, "the timeout fails the transfer, pages held")
            assert dst.state_counts()["reserved"] == 9 and dst.num_free == 0
            child.kill()
            await until(lambda: rx.num_held_pages == 0, 5, "pages freed once the writer is gone")
            assert dst.state_counts()["reserved"] == 0 and dst.num_free == 9
            dst.check()
            src = make_pool(16, seed=4)
            good = make_export(src, "good", 9)
            tx = make_sender(dataclasses.replace(cfg(tmp_path), endpoint=rx.endpoint), TINY_SPEC)
            await tx.start()
            try:
                st = await tx.wait(tx.send(good), 10)
                assert st.state is TransferState.DONE, st.reason
                got = await rx.next_completed(5)
                assert torch.equal(dst.export_pages(got.pages), good.data) and tx.one_sided == 1
            finally:
                await tx.close()
        finally:
            child.kill()
            await rx.close()
    asyncio.run(asyncio.wait_for(body(), 90))


@pytest.mark.parametrize("local_link", [True, False], ids=["link", "zmq-control"])
def test_a_receiver_killed_under_a_granted_transfer_ends_it(tmp_path, local_link):
    """The receiver dies after granting (the sender waits before writing): the sender's write
    lands in memory nobody will read, no Ack comes, and the transfer ends FAILED: at once when
    its local link ends (peer_lost), else at its timeout. A new receiver then takes transfers
    from the same sender (over a new link)."""
    src = make_pool(32, seed=2)

    async def body():
        peer = PeerProcess(["--backend", "shm", "--endpoint", f"ipc://{tmp_path}/peer.sock", "--num-pages", "32",
                            "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(PAGE // 2), "--report"])
        late = FaultConfig(shm_delay_s=0.5)
        tx = make_sender(cfg(tmp_path, endpoint=peer.endpoint(), transfer_timeout_s=2.0, faults=late,
                             local_link=local_link), TINY_SPEC)
        await tx.start()
        try:
            tid = tx.send(make_export(src, "lost", 9))
            await until(lambda: tid in tx._writes and tx.links == int(local_link), 20, "granted (and linked)")
            peer.kill()
            st = await tx.wait(tid, 10)
            assert st.state is TransferState.FAILED, st
            assert str(st.code) == ("peer_lost" if local_link else "timeout"), st
            peer = PeerProcess(["--backend", "shm", "--endpoint", f"ipc://{tmp_path}/peer.sock", "--num-pages", "32",
                                "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(PAGE // 2), "--report"])
            peer.endpoint()
            good = make_export(src, "good", 9)
            st = await tx.wait(tx.send(good), 10)
            assert st.state is TransferState.DONE, st.reason
            assert peer.read_json(10)["request_id"] == "good"
            counts = peer.counts()
            assert counts["reserved"] == 0 and counts["resident"] == 0
            assert len(tx._targets) == 1  # the dead receiver's pool is no longer mapped
            await until(lambda: tx.links == 2 * int(local_link), 10, "linked to the new receiver")
        finally:
            await tx.close()
            peer.kill()
    asyncio.run(asyncio.wait_for(body(), 90))


def test_a_late_write_after_reclaim_touches_nothing(tmp_path):
    """Transfer A is granted, its sender sleeps past the receiver's timeout and never hears the
    Nack (dropped). The receiver revokes A's slot and frees its pages; B gets the same pages and
    lands. Then A's sender wakes and tries to write: the generation is gone, it writes nothing,
    and B's pages hold B's bytes."""
    dst = PagePool(TINY_SPEC, 9, shared=True)
    src = make_pool(32, seed=6)

    async def body():
        rx = make_receiver(cfg(tmp_path, transfer_timeout_s=0.5,
                               faults=FaultConfig(drop_prob=1, kinds=("nack",))), dst)
        await rx.start()
        late = make_sender(cfg(tmp_path, endpoint=rx.endpoint, faults=FaultConfig(shm_delay_s=2.0)), TINY_SPEC)
        good = make_sender(cfg(tmp_path, endpoint=rx.endpoint), TINY_SPEC)
        await late.start()
        await good.start()
        try:
            a = late.send(make_export(src, "a", 9))
            await until(lambda: a in late._writes, 20, "A granted")
            granted = list(late._writes[a].grant.pages)
            await until(lambda: rx.poll(a) is not None and rx.poll(a).state is TransferState.FAILED, 10, "A reclaimed")
            b_export = make_export(src, "b", 9)
            st = await good.wait(good.send(b_export), 10)
            assert st.state is TransferState.DONE, st.reason
            b = await rx.next_completed(5)
            assert sorted(b.pages) == sorted(granted)  # A's pages, handed out again
            st = await late.wait(a, 10)
            assert st.state is TransferState.FAILED and "revoked" in st.reason and st.bytes_done == 0, st
            assert torch.equal(dst.export_pages(b.pages), b_export.data)
            dst.free("b")
            assert dst.state_counts()["reserved"] == 0
            dst.check()
        finally:
            await late.close()
            await good.close()
            await rx.close()
    asyncio.run(asyncio.wait_for(body(), 60))
