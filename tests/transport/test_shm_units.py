"""The one-sided backend's parts: shared buffers, write slots, the Grant/Commit wire checks,
and the fallback to chunks where the receiver's pool cannot be mapped."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import struct

import msgpack
import pytest
import torch

from chaos_util import until
from kv_transport import TransferState, TransportConfig, make_receiver, make_sender
from kv_transport.shm_slots import SlotGuard, WriteSlots
from kv_transport.testing import TINY_SPEC, linked, make_export, make_pool
from kv_transport.wire import Commit, Grant, WireError, WireLimits, decode, encode
from pdtb.engine.page_pool import PagePool
from pdtb.engine.shared_memory import Locator, SharedBuffer, SharedMemoryError, boot_id, open_buffer

PAGE = TINY_SPEC.bytes_per_page


def test_a_shared_buffer_is_seen_by_a_peer_and_only_with_its_token():
    buf = SharedBuffer(1 << 16)
    t = buf.tensor((1 << 14,), torch.float32)
    t[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    peer = open_buffer(buf.locator)
    seen = torch.frombuffer(peer.map, dtype=torch.float32, count=4, offset=4096)
    assert seen.tolist() == [1.0, 2.0, 3.0, 4.0]
    seen[0] = 9.0  # and a peer's write is ours
    assert t[0].item() == 9.0
    with pytest.raises(SharedMemoryError, match="token"):
        open_buffer(dataclasses.replace(buf.locator, token="00" * 16))
    with pytest.raises(SharedMemoryError, match="another host"):
        open_buffer(dataclasses.replace(buf.locator, host="not-" + boot_id()))
    with pytest.raises(SharedMemoryError):
        open_buffer(Locator(f"/proc/{os.getpid()}/fd/0", buf.locator.token, boot_id()))  # not a buffer
    with pytest.raises(SharedMemoryError):
        open_buffer(Locator("/etc/passwd", buf.locator.token, boot_id()))
    peer.close()
    buf.close()


def test_a_shared_buffer_cannot_be_resized_and_a_reader_maps_it_read_only():
    """Sealed at its size (a peer's mapping can never lose its pages under it: SIGBUS), and a
    peer that only reads maps it without write access."""
    buf = SharedBuffer(1 << 16)
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 4096)
    with pytest.raises(PermissionError):
        os.ftruncate(buf.fd, 1 << 20)
    peer = open_buffer(buf.locator, writable=False)
    buf.map[4096:4100] = b"abcd"
    assert peer.map[4096:4100] == b"abcd"
    with pytest.raises(TypeError):
        peer.map[4096:4100] = b"wxyz"
    peer.close()
    buf.close()


def test_a_shared_pool_is_a_pool():
    pool = PagePool(TINY_SPEC, 8, shared=True)
    assert pool.shared is not None and pool.kv.shape == TINY_SPEC.page_shape(8) and pool.kv.abs().sum() == 0
    pages = pool.allocate("r", 3)
    pool.kv[:, :, pages] = 1.5
    assert open_buffer(pool.shared.locator).nbytes == 8 * PAGE
    with pytest.raises(ValueError, match="host memory"):
        PagePool(TINY_SPEC, 8, device="meta", shared=True)


def test_write_slots_grant_revoke_and_generations():
    slots = WriteSlots(2)
    a, b = slots.grant(), slots.grant()
    assert a[0] != b[0] and a[1] < b[1] and slots.grant() is None  # both slots in use
    guard = SlotGuard(slots.locator)
    assert guard.acquire(*a) is True
    assert slots.busy(a[0]) and not slots.busy(b[0])
    assert slots.revoke(a[0]) is False  # a writer is inside: the receiver must wait
    guard.release(a[0])
    assert slots.revoke(a[0]) is True and not slots.busy(a[0])
    assert slots.revoke(a[0]) is True and slots.num_free == 1  # revoked twice (a failure after a last commit): free once
    assert guard.acquire(*a) is False  # revoked: the late writer writes nothing
    c = slots.grant()  # the same slot again, with a new generation
    assert c[0] == a[0] and c[1] > b[1] and slots.grant() is None
    assert guard.acquire(a[0], a[1]) is False and guard.acquire(*c) is True
    guard.release(c[0])
    assert guard.acquire(99, c[1]) is False  # outside the table


def _limits() -> WireLimits:
    return WireLimits.from_config(TransportConfig(), TINY_SPEC)


def _with(frames: list, **fields) -> list:
    """`frames` with fields of its msgpack body replaced as they would go on the wire."""
    body = msgpack.unpackb(frames[0], raw=False)
    body.update(fields)
    return [msgpack.packb(body, use_bin_type=True), *frames[1:]]


def test_grant_and_commit_round_trip_and_reject_bad_fields():
    g = Grant("t1", 2, "host", "/proc/1/fd/3", "ab", "/proc/1/fd/4", "cd", 0, 7, 100, [5, 6, 99])
    frames = encode(g)
    assert decode(frames, _limits()).msg == g
    assert msgpack.unpackb(frames[0])["pages"] == struct.pack("<3I", 5, 6, 99)  # packed little-endian
    c = Commit("t1", 16, 12345)
    assert decode(encode(c), _limits()).msg == c
    for bad in (encode(dataclasses.replace(g, pages=[100])), encode(dataclasses.replace(g, pages=[])),
                encode(dataclasses.replace(g, gen=0)), _with(frames, pages=[5, 6]),
                _with(frames, pages=b"\x05\x00\x00"), _with(frames, pages=True),
                _with(frames, pages=struct.pack("<I", 1 << 31)),
                _with(frames, pages=b"\0" * 4 * (_limits().max_pages + 1))):
        with pytest.raises(WireError):
            decode(bad, _limits())
    for bad in ([-1], [1 << 32], [True], [2.0]):  # what does not fit the wire's 32-bit ids never leaves
        with pytest.raises(ValueError):
            encode(dataclasses.replace(g, pages=bad))
    with pytest.raises(WireError):
        decode(encode(Commit("t1", 0, 1)), _limits())


def shm_config(tmp_path, backend: str = "shm") -> TransportConfig:
    return TransportConfig(backend=backend, endpoint=f"ipc://{tmp_path}/rx.sock", chunk_bytes=2 * PAGE,
                           inline_max_bytes=PAGE // 2, transfer_timeout_s=5.0, tick_s=0.01)


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("backend", ["auto", "shm"])
def test_a_pool_it_cannot_map_goes_as_chunks_under_auto_and_fails_under_shm(backend, tmp_path, monkeypatch):
    """A Grant naming another host's pool: `auto` streams chunks under the Grant's credit and
    the transfer lands; `shm` fails it with the reason. Nothing stays reserved either way."""
    import kv_transport.shm_receiver as shm_receiver
    import kv_transport.shm_sender as shm_sender

    for side in (shm_receiver, shm_sender):  # what the receiver puts in its Grants, and the sender compares
        monkeypatch.setattr(side, "boot_id", lambda: "another-host")
    src, dst = make_pool(32, seed=8), PagePool(TINY_SPEC, 32, shared=True)

    async def body():
        async with linked(shm_config(tmp_path, backend), dst) as (tx, rx):
            e = make_export(src, "r", 9)
            st = await tx.wait(tx.send(e), 10)
            if backend == "auto":
                assert st.state is TransferState.DONE, st.reason
                got = await rx.next_completed(5)
                assert torch.equal(dst.export_pages(got.pages), e.data) and tx.one_sided == 0
                dst.free("r")
            else:
                assert st.state is TransferState.FAILED and "another host" in st.reason and "auto" in st.reason
            for _ in range(100):
                if not dst.state_counts()["reserved"] and not rx._slot_of:
                    break
                await asyncio.sleep(0.02)
            assert dst.state_counts()["reserved"] == 0 and not rx._slot_of and rx.slots.num_free == rx.slots.num_slots
            dst.check()
    run(body())


def test_a_receiver_whose_pool_is_not_shared_answers_with_credits(tmp_path):
    src, dst = make_pool(32, seed=9), make_pool(32)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            e = make_export(src, "r", 9)
            st = await tx.wait(tx.send(e), 10)
            assert st.state is TransferState.DONE and tx.one_sided == 0, st.reason
            got = await rx.next_completed(5)
            assert torch.equal(dst.export_pages(got.pages), e.data)
    run(body())


def test_a_commit_whose_rows_do_not_sum_fails_and_frees(tmp_path, monkeypatch):
    """A sender that commits rows it did not write (its pieces lost): the read-back sum
    differs, the transfer fails checksum, the pages are free."""
    import kv_transport.shm_backend as shm
    from kv_transport import checksum

    src, dst = make_pool(32, seed=10), PagePool(TINY_SPEC, 32, shared=True)

    def skip_copy(self, plan, row0, data, acc):  # sums the bytes, copies none of them
        return checksum.update("sum64", acc, data)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            monkeypatch.setattr(shm.PageWriter, "write_bytes_sum64", skip_copy)
            st = await tx.wait(tx.send(make_export(src, "r", 9)), 10)
            assert st.state is TransferState.FAILED and str(st.code) == "checksum", st
            assert dst.state_counts()["reserved"] == 0
            dst.check()
    run(body())


def test_a_receiver_started_anew_over_the_same_pool_is_written_under_its_own_slots(tmp_path):
    """A receiver closed and started again over the same shared pool hands out a new slot table:
    the sender locks that one (not the first receiver's), and every transfer lands."""
    src, dst = make_pool(64, seed=13), PagePool(TINY_SPEC, 40, shared=True)
    config = shm_config(tmp_path)

    async def body():
        rx = make_receiver(config, dst)
        await rx.start()
        tx = make_sender(dataclasses.replace(config, endpoint=rx.endpoint), TINY_SPEC)
        await tx.start()
        try:
            for i in range(4):
                if i == 2:  # the same endpoint and pool, a new receiver
                    await rx.close()
                    rx = make_receiver(config, dst)
                    await rx.start()
                e = make_export(src, f"r{i}", 9)
                st = await tx.wait(tx.send(e), 10)
                if st.state is not TransferState.DONE:  # (the first after the restart may find the link gone)
                    assert i == 2 and str(st.code) == "peer_lost", st
                    st = await tx.wait(tx.send(e), 10)
                assert st.state is TransferState.DONE, st
                await landed(rx, dst, e)
            assert tx.one_sided >= 3 and [t.receiver for t in tx._targets.values()] == [rx.slots.locator.token]
            assert dst.num_free == 40
            dst.check()
        finally:
            await tx.close()
            await rx.close()
    run(body())


def test_duplicated_commits_are_discarded_and_the_transfer_lands(tmp_path):
    """Every Commit sent twice (a duplicating link): the second of each is discarded as rows
    already checked, as a duplicated chunk is; the transfer is DONE with the exact bytes."""
    from kv_transport import FaultConfig

    src, dst = make_pool(64, seed=12), PagePool(TINY_SPEC, 40, shared=True)
    faults = FaultConfig(duplicate_prob=1.0, kinds=("commit",))  # (a receiver sends no Commit)

    async def body():
        async with linked(dataclasses.replace(shm_config(tmp_path), faults=faults), dst) as (tx, rx):
            e = make_export(src, "r", 30)  # 30 pages in pieces of 2: several Commits
            st = await tx.wait(tx.send(e), 10)
            assert st.state is TransferState.DONE and tx.one_sided == 1, st
            assert sum(kind == "commit" for kind, _ in tx.faults.injected) > 1
            await landed(rx, dst, e)
            assert dst.num_free == 40
            dst.check()
    run(body())


async def landed(rx, dst: PagePool, e) -> None:
    """The receiver's next completed transfer holds `e`'s bytes; its pages are freed."""
    got = await rx.next_completed(5)
    assert got.request_id == e.header.request_id and torch.equal(dst.export_pages(got.pages), e.data)
    dst.free(got.request_id)


@pytest.mark.parametrize("granted", [8, 10])
def test_a_grant_of_the_wrong_number_of_pages_writes_nothing(tmp_path, monkeypatch, granted):
    """A Grant whose page list does not match the header (a faulty receiver): the sender fails
    the transfer bad_message before it writes a byte (its pieces would run past the pages
    granted), the receiver frees the pages on the sender's Cancel, and the pool is untouched."""
    import kv_transport.shm_backend as shm

    src, dst = make_pool(32, seed=12), PagePool(TINY_SPEC, 32, shared=True)
    before = dst.kv.clone()
    reply = shm.ShmReceiver._reply

    def miscount(self, peer, msg, kind, owners=None):
        if isinstance(msg, Grant):
            extra = [p for p in range(dst.num_pages) if p not in msg.pages]
            msg = dataclasses.replace(msg, pages=(msg.pages + extra)[:granted])
        return reply(self, peer, msg, kind, owners)

    async def body():
        monkeypatch.setattr(shm.ShmReceiver, "_reply", miscount)
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            st = await tx.wait(tx.send(make_export(src, "r", 9)), 10)
            assert st.state is TransferState.FAILED and str(st.code) == "bad_message", st
            assert f"granted {granted} pages for a transfer of 9" in st.reason and tx.one_sided == 0
            await until(lambda: dst.state_counts()["reserved"] == 0 and not rx._slot_of, 5, "the pages freed")
            assert torch.equal(dst.kv, before)
            dst.check()
    run(body())


@pytest.mark.parametrize("algo", ["sum64", "crc32"])
@pytest.mark.parametrize("pages", [list(range(100, 35, -1)) + list(range(120, 190)), [5, 3, 9, 40, 41, 2, 77]],
                         ids=["runs", "scattered"])
def test_the_read_back_checksum_of_any_row_range_is_the_payloads(algo, pages):
    """PageWriter.checksum over pieces of a written payload (descending and ascending runs, or
    scattered pages) extends to the checksum of the payload as sent, piece by piece."""
    from kv_transport import checksum
    from kv_transport.page_writer import PageWriter

    pool = PagePool(TINY_SPEC, 200)
    writer = PageWriter(pool)
    plan = writer.plan(pages)
    assert (plan.runs is not None) == (len(pages) > 10)
    data = torch.randint(0, 255, (len(pages) * TINY_SPEC.bytes_per_page,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(3)).numpy()
    writer.write_bytes(plan, 0, memoryview(data))
    rows, acc, r = writer.num_lk * len(pages), None, 0
    for k in (1, 7, 100, 3, 10 ** 9):  # uneven pieces, crossing runs and layers
        nxt = min(rows, r + k)
        acc = writer.checksum(plan, algo, r, nxt, acc)
        r = nxt
    assert r == rows and acc == checksum.of(algo, memoryview(data)) == writer.checksum(plan, algo)


@pytest.mark.parametrize("local_link", [True, False], ids=["link", "zmq-control"])
def test_control_moves_to_the_local_link_after_the_first_grant(tmp_path, monkeypatch, local_link):
    """The first Grant names the receiver's local link: the sender connects, and the next
    transfer sends nothing on ZeroMQ either way. Both land intact. With local_link=False
    every message stays on ZeroMQ."""
    import kv_transport.zmq_backend as zb

    sends = {"tx": 0, "rx": 0}
    for side, cls in (("tx", zb.ZmqSender), ("rx", zb.ZmqReceiver)):
        def counted(self, frames, peer, _orig=cls._write, _side=side):
            sends[_side] += 1
            return _orig(self, frames, peer)
        monkeypatch.setattr(cls, "_write", counted)
    src, dst = make_pool(64, seed=11), PagePool(TINY_SPEC, 64, shared=True)

    async def body():
        async with linked(dataclasses.replace(shm_config(tmp_path), local_link=local_link), dst) as (tx, rx):
            first = make_export(src, "first", 9)
            assert (await tx.wait(tx.send(first), 10)).state is TransferState.DONE
            await until(lambda: tx.links == int(local_link), 2, "the link connected")
            assert tx.links == int(local_link) and (rx.link is not None) == local_link
            sends.update(tx=0, rx=0)
            second = make_export(src, "second", 12)
            st = await tx.wait(tx.send(second), 10)
            assert st.state is TransferState.DONE and tx.one_sided == 2, st.reason
            if local_link:
                assert sends == {"tx": 0, "rx": 0}
            else:
                assert sends["tx"] >= 2 and sends["rx"] >= 2  # header and Commit(s); Grant and Ack
            for e in (first, second):
                got = await rx.next_completed(5)
                assert got.request_id == e.header.request_id and torch.equal(dst.export_pages(got.pages), e.data)
                dst.free(got.request_id)
            dst.check()
    run(body())


def test_a_link_that_could_not_be_connected_is_tried_again_later(tmp_path, monkeypatch):
    """A refused link (the receiver's listener full of strangers, say) leaves control on ZeroMQ
    for RELINK_AFTER_S, not for good: a Grant after that connects it."""
    import kv_transport.shm_sender as shm_sender
    from kv_transport.local_link import LinkClient, LinkError

    monkeypatch.setattr(shm_sender, "RELINK_AFTER_S", 0.2)
    connect, refused = LinkClient.connect, []

    async def refuse_once(self, *args):
        if not refused:
            refused.append(1)
            raise LinkError("refused (a full listener)")
        return await connect(self, *args)

    monkeypatch.setattr(LinkClient, "connect", refuse_once)
    src, dst = make_pool(64, seed=14), PagePool(TINY_SPEC, 64, shared=True)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            for i in range(2):
                if i:
                    assert refused and tx.links == 0
                    await asyncio.sleep(0.3)  # past RELINK_AFTER_S
                e = make_export(src, f"r{i}", 4)
                assert (await tx.wait(tx.send(e), 10)).state is TransferState.DONE
                await landed(rx, dst, e)
            await until(lambda: tx.links == 1, 5, "the link connected on a later Grant")
            dst.check()
    run(body())


@pytest.mark.parametrize("junk", [b"\xff" * 64, b"\x02\x00\x00\x00" + b"\x00" * 60], ids=["garbage", "no-ticket"])
def test_a_stranger_on_the_receivers_link_is_shut_out_and_transfers_go_on(tmp_path, junk):
    import socket

    src, dst = make_pool(32, seed=12), PagePool(TINY_SPEC, 32, shared=True)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stranger.setblocking(False)
            try:
                loop = asyncio.get_running_loop()
                await loop.sock_connect(stranger, rx.link.name)
                await loop.sock_sendall(stranger, junk)
                for e in (make_export(src, "a", 9), make_export(src, "b", 9)):
                    st = await tx.wait(tx.send(e), 10)
                    assert st.state is TransferState.DONE, st.reason
                    got = await rx.next_completed(5)
                    assert torch.equal(dst.export_pages(got.pages), e.data)
                    dst.free(got.request_id)
                assert await asyncio.wait_for(loop.sock_recv(stranger, 16), 5) == b""  # closed on it
                assert len(rx.link._links) == 1 and tx.links == 1  # the sender's link only
            finally:
                stranger.close()
    run(body())


def test_a_transfer_keeps_to_the_way_its_header_went(tmp_path, monkeypatch):
    """The link comes up while the first transfer waits to write (shm_delay_s): that transfer's
    Commits still go on ZeroMQ, behind its header, so none can pass another; every message of
    the next transfer goes on the link."""
    import msgpack

    import kv_transport.local_link as ll
    import kv_transport.zmq_backend as zb
    from kv_transport import FaultConfig

    sent: list[tuple[str, int, str]] = []  # (way, message type, transfer id) of every sender message

    def record(way, frames):
        body = msgpack.unpackb(bytes(memoryview(frames[0])))
        sent.append((way, body["t"], body.get("transfer_id", "")))

    def zmq_write(self, frames, peer, _orig=zb.ZmqSender._write):
        record("zmq", frames)
        return _orig(self, frames, peer)

    def link_send(self, frames, _orig=ll.LinkClient.send):
        record("link", frames)
        return _orig(self, frames)
    monkeypatch.setattr(zb.ZmqSender, "_write", zmq_write)
    monkeypatch.setattr(ll.LinkClient, "send", link_send)
    src, dst = make_pool(64, seed=13), PagePool(TINY_SPEC, 64, shared=True)
    config = dataclasses.replace(shm_config(tmp_path), faults=FaultConfig(shm_delay_s=0.3))

    async def body():
        async with linked(config, dst) as (tx, rx):
            first = tx.send(make_export(src, "first", 9))
            assert (await tx.wait(first, 10)).state is TransferState.DONE and tx.links == 1
            second = tx.send(make_export(src, "second", 9))
            assert (await tx.wait(second, 10)).state is TransferState.DONE
            ways = {tid: {w for w, _, t in sent if t == tid} for tid in (first, second)}
            assert ways == {first: {"zmq"}, second: {"link"}}, sent
            assert sum(1 for w, t, tid in sent if tid == first and t == 9) >= 2  # its Commits, on ZeroMQ
            for _ in range(2):
                dst.free((await rx.next_completed(5)).request_id)
    run(body())


def test_an_ack_that_came_just_before_the_link_ended_still_counts(tmp_path, monkeypatch):
    """The receiver answers a transfer's last Commit with its Ack on the link and the link ends
    right after (the receiver went away): the sender reads the Ack before it learns of the end,
    so the transfer is DONE, not failed peer_lost. Then control falls back to ZeroMQ."""
    import kv_transport.shm_backend as shm

    src, dst = make_pool(64, seed=14), PagePool(TINY_SPEC, 64, shared=True)
    end_after_ack = {"on": False}

    def write(self, frames, peer, _orig=shm.ShmReceiver._write):
        out = _orig(self, frames, peer)
        if end_after_ack["on"] and b"transfer_ids" in bytes(memoryview(frames[0])) and self.link.linked(peer):
            for c in list(self.link._conns):
                c.transport.close()  # (close, not abort: what was written goes out first)
        return out
    monkeypatch.setattr(shm.ShmReceiver, "_write", write)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            assert (await tx.wait(tx.send(make_export(src, "first", 9)), 10)).state is TransferState.DONE
            await until(lambda: tx.links, 2, "the link connected")
            end_after_ack["on"] = True
            st = await tx.wait(tx.send(make_export(src, "second", 9)), 10)
            assert st.state is TransferState.DONE, st
            end_after_ack["on"] = False
            await until(lambda: tx._link is None, 2, "the sender dropped the ended link")
            assert tx._link is None and tx.links == 1
            st = await tx.wait(tx.send(make_export(src, "third", 9)), 10)  # announced on ZeroMQ again
            assert st.state is TransferState.DONE, st
            for _ in range(3):
                dst.free((await rx.next_completed(5)).request_id)
            dst.check()
    run(body())


def test_pieces_shrink_to_the_end_and_cover_every_row():
    from kv_transport.shm_backend import piece_rows

    chunk, total, sizes = 1024, 16 * 1024, []  # 64 MiB of 4 KiB rows in 4 MiB chunks
    while sum(sizes) < total:
        sizes.append(piece_rows(total - sum(sizes), chunk))
    assert sizes == [4096, 3072, 2304, 1728, 1296, 1024, 1024, 1024, 816] and sum(sizes) == total
    assert piece_rows(10, chunk) == 10 and piece_rows(1, 1) == 1


def test_the_checked_copy_reads_back_what_it_wrote_and_fails_on_a_difference(monkeypatch):
    from pdtb.microbench import shm as bench_shm
    from kv_transport.page_writer import PageWriter

    pool = make_pool(40, seed=1)
    export = make_export(pool, "r", 32)
    assert bench_shm.checked_copy_gbps(export, 4 * PAGE, reps=1) > 0
    real = PageWriter.checksum
    monkeypatch.setattr(PageWriter, "checksum", lambda self, *a: real(self, *a) + 1)
    with pytest.raises(RuntimeError, match="read back"):
        bench_shm.checked_copy_gbps(export, 4 * PAGE, reps=0)

    def broken(self, *a):
        raise OSError("unreadable")
    monkeypatch.setattr(PageWriter, "checksum", broken)
    with pytest.raises(RuntimeError, match="the read-back failed") as e:
        bench_shm.checked_copy_gbps(export, 4 * PAGE, reps=0)
    assert isinstance(e.value.__cause__, OSError)
