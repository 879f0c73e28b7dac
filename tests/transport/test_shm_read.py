"""The shm backend's read path (kv_transport/shm_read.py): a payload gathered into the sender's
arena is read by the receiver in one pass, checked against the offered checksum; where the
receiver cannot or will not read, it grants a write and the same bytes land. Every failure
frees the reserved pages and returns the arena range."""
from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch

from chaos_util import until
from kv_transport import TransferState
from kv_transport.admission import Admission, Verdict
from kv_transport.testing import TINY_SPEC, make_export, make_pool, staged
from kv_transport.wire import KVTransferHeader, ReadSource, WireError, WireLimits, decode, encode
from pdtb.engine.kv_export import export_request
from pdtb.engine.page_pool import PagePool
from pdtb.engine.shared_memory import SharedMemoryError
from tests.transport.test_shm_units import linked, run, shm_config

PAGE = TINY_SPEC.bytes_per_page


async def lands(tx, rx, dst: PagePool, export) -> None:
    """`export` sent, DONE, and its bytes in `dst` where the receiver says they landed."""
    st = await tx.wait(tx.send(export), 10)
    assert st.state is TransferState.DONE, st.reason
    got = await rx.next_completed(5)
    assert torch.equal(dst.export_pages(got.pages), export.data)


async def arena_settles(tx) -> None:
    """Every arena range is back once the exports are gone and no offer is pending."""
    gc.collect()
    await until(lambda: tx.offers.num_pending == 0 and tx.offers.arena.free_bytes == tx.offers.arena.nbytes, 5,
                "the arena is whole again")


def test_an_export_gathered_into_the_arena_is_read_by_the_receiver(tmp_path):
    """export_request(out=export_buffer(...)) as the prefill node does it: the receiver reads
    the payload itself (no Grant, nothing written one-sided), the bytes land in its pages, and
    the sender moves its control onto the local link named in the Ack."""
    src, dst = make_pool(64, seed=3), PagePool(TINY_SPEC, 64, shared=True)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            for i, n in enumerate((9, 17)):
                src.allocate(f"r{i}", n)
                e = export_request(src, f"r{i}", n * TINY_SPEC.page_size - 5,
                                   out=tx.export_buffer(n * PAGE))
                assert tx.offers.arena.offset_of(e.data) is not None  # gathered into the arena
                await lands(tx, rx, dst, e)
                del e
            assert (tx.read_by_receiver, rx.reads, tx.one_sided) == (2, 2, 0)
            await until(lambda: tx.links == 1, 5, "linked after the first read's Ack")
            assert dst.state_counts()["reserved"] == 0
            await arena_settles(tx)
    run(body())


def test_a_small_payload_rides_inline_and_takes_no_arena():
    async def body():
        from kv_transport import TransportConfig, make_sender
        tx = make_sender(TransportConfig(backend="shm", endpoint="ipc:///tmp/pdtb-nobody.sock"), TINY_SPEC)
        assert tx.export_buffer(tx.config.inline_max_bytes) is None and tx.offers is None
        assert tx.export_buffer(tx.config.inline_max_bytes + PAGE) is not None
        off = make_sender(TransportConfig(backend="shm", endpoint="ipc:///tmp/pdtb-nobody.sock", shm_arena_bytes=0),
                          TINY_SPEC)
        assert off.export_buffer(1 << 20) is None  # no arena: any tensor will do
    run(body())


@pytest.mark.parametrize("why", ["receiver does not read", "arena cannot be mapped"])
def test_a_receiver_that_does_not_read_grants_a_write_of_the_same_bytes(tmp_path, monkeypatch, why):
    import kv_transport.shm_read as shm_read

    config = shm_config(tmp_path)
    if why == "receiver does not read":
        config = dataclasses.replace(config, shm_read=False)
    else:
        def no_map(locator, writable=True):
            raise SharedMemoryError("not here")
        monkeypatch.setattr(shm_read, "open_buffer", no_map)
    src, dst = make_pool(32, seed=4), PagePool(TINY_SPEC, 32, shared=True)

    async def body():
        async with linked(config, dst) as (tx, rx):
            e = staged(tx, make_export(src, "r", 9))
            await lands(tx, rx, dst, e)
            assert (tx.read_by_receiver, rx.reads, tx.one_sided) == (0, 0, 1)
            del e
            await arena_settles(tx)
    run(body())


@pytest.mark.parametrize("fault", ["checksum", "past the arena"])
def test_an_offer_that_does_not_hold_fails_and_frees_everything(tmp_path, monkeypatch, fault):
    """A checksum that is not the payload's: the receiver reads, finds the difference, fails the
    transfer (checksum). An offset past the arena: refused before reading (bad_message). Either
    way its pages are free and the sender's range comes back."""
    import kv_transport.shm_read as shm_read

    real = shm_read.ReadOffers.offer

    def lying(self, tid, data, checksum):
        s = real(self, tid, data, checksum)
        if s is None:
            return None
        if fault == "checksum":
            return dataclasses.replace(s, checksum=(s.checksum + 1) % (1 << 64))
        return dataclasses.replace(s, offset=self.arena.nbytes - PAGE)
    monkeypatch.setattr(shm_read.ReadOffers, "offer", lying)
    src, dst = make_pool(32, seed=5), PagePool(TINY_SPEC, 32, shared=True)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            e = staged(tx, make_export(src, "r", 9))
            st = await tx.wait(tx.send(e), 10)
            assert st.state is TransferState.FAILED, st
            assert str(st.code) == ("checksum" if fault == "checksum" else "bad_message"), st
            await until(lambda: not rx._reads, 5, "the read ended")
            assert dst.state_counts()["reserved"] == 0 and dst.num_free == 32
            dst.check()
            del e
            await arena_settles(tx)
    run(body())


def test_a_parked_read_lands_in_the_host_tier(tmp_path):
    """The policy's PARK verdict on a read: the receiver copies into its host tier."""
    from kv_transport import make_receiver, make_sender
    src = make_pool(32, seed=6)
    dev, host = PagePool(TINY_SPEC, 32, shared=True), PagePool(TINY_SPEC, 32, tier="host", shared=True)

    async def body():
        config = shm_config(tmp_path)
        rx = make_receiver(config, dev, admit=lambda h: Admission(Verdict.PARK, pool=host))
        await rx.start()
        tx = make_sender(dataclasses.replace(config, endpoint=rx.endpoint), TINY_SPEC)
        await tx.start()
        try:
            e = staged(tx, make_export(src, "r", 9))
            st = await tx.wait(tx.send(e), 10)
            assert st.state is TransferState.DONE, st.reason
            got = await rx.next_completed(5)
            assert got.tier == "host" and torch.equal(host.export_pages(got.pages), e.data)
            assert rx.reads == 1 and dev.num_free == 32
        finally:
            await tx.close()
            await rx.close()
    run(body())


def _header(**kw) -> KVTransferHeader:
    base = dict(transfer_id="t1", request_id="r", tenant="", num_tokens=16, prompt_token_ids=[1],
                output_token_ids=[], num_computed_tokens=16, extra={}, num_pages=1, page_size=16, dtype="float32",
                num_layers=TINY_SPEC.num_layers, num_kv_heads=TINY_SPEC.num_kv_heads, head_dim=TINY_SPEC.head_dim,
                payload_bytes=PAGE, mode="shm", chunk_bytes=PAGE, num_chunks=1, checksum_algo="sum64", checksum=None)
    return KVTransferHeader(**{**base, **kw})


def test_a_read_source_round_trips_and_bad_ones_are_refused_under_their_transfer():
    limits = WireLimits.from_config(shm_config("/tmp"), TINY_SPEC)
    src = ReadSource("boot", "/proc/1/fd/3", "ab" * 16, "/proc/1/fd/4", "cd" * 16, 7, 9, 4096, (1 << 64) - 1)
    got = decode(encode(_header(source=src)), limits).msg
    assert got.source == src
    assert decode(encode(_header()), limits).msg.source is None  # absent: no key on the wire
    inline = _header(mode="inline", checksum=0)
    bad = [encode(dataclasses.replace(inline, source=src), [b"\0" * PAGE])]
    for field, value in (("slot", -1), ("gen", 0), ("offset", "0"), ("host", 5)):
        bad.append(encode(_header(source=dataclasses.replace(src, **{field: value}))))
    import msgpack
    frames = encode(_header(source=src))
    body = msgpack.unpackb(frames[0])
    for broken in ({**body, "source": [1, 2]}, {**body, "source": {**body["source"], "extra": 1}}):
        bad.append([msgpack.packb(broken)])
    for frames in bad:
        with pytest.raises(WireError) as e:
            decode(frames, limits)
        assert e.value.transfer_id == "t1"


def test_a_receiver_keeps_a_bounded_number_of_senders_arenas_mapped():
    """Arenas of senders come and go (restarts): the least recently used one nobody reads from
    is unmapped past the limit; one being read from, or the one just opened, stays."""
    from kv_transport.shm_read import ReadOffers, Sources
    offers = [ReadOffers(1 << 16, num_slots=4) for _ in range(4)]
    sources = Sources(max_open=2)
    try:
        def source(o: ReadOffers):
            t = o.lease(4096)
            return t, o.offer("t", t, 0)
        held = [source(o) for o in offers]
        a = sources.open(held[0][1])
        a.readers += 1  # being read from
        sources.open(held[1][1])
        sources.open(held[2][1])  # past the limit: the idle least recently used (held[1]'s) goes
        assert sources.num_open == 2
        c = sources.open(held[3][1])
        assert sources.num_open == 2 and sources.open(held[0][1]) is a and sources.open(held[3][1]) is c
        a.readers -= 1
    finally:
        sources.close()
        for o in offers:
            o.close()


def test_paths_a_receiver_would_open_are_checked_on_the_wire():
    limits = WireLimits.from_config(shm_config("/tmp"), TINY_SPEC)
    src = ReadSource("boot", "/proc/1/fd/3", "ab" * 16, "/proc/1/fd/4", "cd" * 16, 7, 9, 4096, 0)
    for bad in (dataclasses.replace(src, buffer="/proc/1/fd/3\0x"), dataclasses.replace(src, slots="/etc/passwd")):
        with pytest.raises(WireError) as e:
            decode(encode(_header(source=bad)), limits)
        assert e.value.transfer_id == "t1"
    from pdtb.engine.shared_memory import Locator, boot_id, open_buffer
    with pytest.raises(SharedMemoryError):  # (never a ValueError out of os.open)
        open_buffer(Locator("/proc/1/fd/3\0", "00", boot_id()))


def test_a_send_that_raises_withdraws_its_offer(tmp_path):
    from kv_transport import TransferMeta, make_sender
    src = make_pool(32, seed=9)

    async def body():
        tx = make_sender(shm_config(tmp_path), TINY_SPEC)
        await tx.start()
        try:
            e = staged(tx, make_export(src, "r", 9))
            with pytest.raises(TypeError):
                tx.send(e, TransferMeta(page_hashes=None))  # not a list: the header cannot be made
            with pytest.raises(TypeError):
                tx.send(e, TransferMeta(extra={"x": object()}))  # not msgpack-safe: the header cannot be encoded
            assert not tx.offers._offered and tx.offers.slots.num_free == tx.offers.slots.num_slots
            del e
            await arena_settles(tx)
        finally:
            await tx.close()
    run(body())


def test_an_offer_streamed_as_chunks_is_not_counted_as_read(tmp_path):
    """A receiver whose pool is not shared, and that does not read: it answers a Credit and the
    chunks come from the arena's bytes."""
    src, dst = make_pool(32, seed=10), make_pool(32)

    async def body():
        async with linked(dataclasses.replace(shm_config(tmp_path), shm_read=False), dst) as (tx, rx):
            await lands(tx, rx, dst, staged(tx, make_export(src, "r", 9)))
            assert (tx.read_by_receiver, tx.one_sided, rx.reads) == (0, 0, 0)
    run(body())


def test_a_senders_arena_nobody_reads_from_is_unmapped(tmp_path, monkeypatch):
    import kv_transport.shm_receiver as shm_receiver
    monkeypatch.setattr(shm_receiver, "SOURCE_IDLE_S", 0.2)
    src, dst = make_pool(32, seed=11), PagePool(TINY_SPEC, 32, shared=True)

    async def body():
        async with linked(shm_config(tmp_path), dst) as (tx, rx):
            e = staged(tx, make_export(src, "r", 9))
            assert (await tx.wait(tx.send(e), 10)).state is TransferState.DONE
            assert rx._sources.num_open == 1
            await until(lambda: rx._sources.num_open == 0, 5, "the idle arena unmapped")
            dst.free("r")
            e2 = staged(tx, make_export(src, "r2", 9))
            assert (await tx.wait(tx.send(e2), 10)).state is TransferState.DONE  # mapped again
            assert rx.reads == 2
    run(body())


def test_an_arena_size_that_cannot_hold_a_page_is_refused():
    from kv_transport import TransportConfig
    with pytest.raises(ValueError):
        TransportConfig(backend="shm", shm_arena_bytes=100)


def test_an_ack_names_a_link_only_for_a_transfer_offered_for_reading(tmp_path):
    """A sender connects to the link an Ack names only when the Ack is for a transfer the
    receiver read from its arena (and so is on its host); any other Ack's link is ignored."""
    from kv_transport import make_sender
    from kv_transport.wire import Ack

    async def body():
        tx = make_sender(shm_config(tmp_path), TINY_SPEC)
        await tx.start()
        try:
            tx._on_control(Ack(["not-offered"], "pdtb-some-link", "00" * 16))
            assert tx._linking is None
            tx._offered.add("offered")
            tx._on_control(Ack(["offered"], "pdtb-no-such-link", "00" * 16))
            assert tx._linking is not None  # it tries (and fails: nobody listens there)
        finally:
            await tx.close()
    run(body())


def test_reads_are_offered_only_with_sum64():
    """crc32 has no whole-payload value without a pass over the bytes: no arena, no offer."""
    async def body():
        from kv_transport import TransportConfig, make_sender
        tx = make_sender(TransportConfig(backend="shm", endpoint="ipc:///tmp/pdtb-nobody.sock", checksum="crc32"),
                         TINY_SPEC)
        assert tx.export_buffer(1 << 20) is None
    run(body())
