"""Small pieces of the transport: page scatter, checksums, config validation, fault decisions."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transport import checksum
from kv_transport.config import FaultConfig, TransportConfig
from kv_transport.faults import Fault, FaultInjector
from kv_transport.page_writer import PageWriter, find_runs
from kv_transport.testing import TINY_SPEC, make_pool
from pdtb.engine.kv_export import SUM_BLOCK_BYTES, block_sums
from pdtb.engine.kv_spec import KVSpec

ROW = TINY_SPEC.bytes_per_page // (2 * TINY_SPEC.num_layers)  # bytes of one (layer, kv, page)


def scatter_and_check(pages: list[int], cuts: list[int], spec: KVSpec = TINY_SPEC,
                      device: str = "cpu", accel_path: bool = False, fused: bool = False,
                      read_once: bool = False) -> None:
    """Write a random payload into `pages` in pieces cut at payload rows `cuts`, each piece a
    read-only buffer like a zmq frame; compare with PagePool.import_pages (an independent
    reference). `accel_path` sends a CPU pool through the accelerator code path (staging
    buffers, torch scatter), so that path is checked where no accelerator is. `fused` writes
    through the C landing copy and checks its running sum against checksum.of (`read_once`: its
    variant for a source read once, prefetched around the cache)."""
    dst, ref = make_pool(64, spec, device=device), make_pool(64, spec, device=device)
    payload = torch.randn(spec.page_shape(len(pages))).to(spec.torch_dtype)
    ref.import_pages(pages, payload)
    raw = payload.reshape(-1).view(torch.uint8).numpy().tobytes()
    writer = PageWriter(dst)
    if accel_path:
        writer.cpu, writer.np_rows = False, None
    plan = writer.plan(pages)
    row_bytes = writer.row_bytes
    bounds = [0, *sorted(set(cuts)), len(raw) // row_bytes]
    running = 0
    for r0, r1 in zip(bounds, bounds[1:]):
        if r1 > r0:
            piece = memoryview(raw[r0 * row_bytes:r1 * row_bytes])
            if fused:
                running = writer.write_bytes_sum64(plan, r0, piece, running, read_once)
                assert running is not None
            else:
                writer.write_bytes(plan, r0, piece)
    assert torch.equal(dst.kv, ref.kv)
    if fused:
        assert running == checksum.of("sum64", raw)


@pytest.mark.parametrize("pages", [
    list(range(40)),  # one ascending run
    list(range(63, 23, -1)),  # one descending run (PagePool hands freed pages back reversed)
    [5, 9, 2, 40, 41, 7],  # scattered
    list(range(10, 50)) + list(range(60, 55, -1)),  # long run plus short descending run
])
@pytest.mark.parametrize("fused", ["numpy", "c", "c-read-once"])
def test_page_writer_matches_import_pages(pages, fused):
    if fused != "numpy" and PageWriter(make_pool(4)).copier is None:
        pytest.skip("no C compiler: the C landing copy cannot be built here")
    n_rows = 2 * TINY_SPEC.num_layers * len(pages)
    how = dict(fused=fused != "numpy", read_once=fused == "c-read-once")
    scatter_and_check(pages, [], **how)
    scatter_and_check(pages, [1, n_rows // 3, n_rows // 2 + 1, n_rows - 1], **how)


def test_c_landing_copy_odd_row_sizes_and_its_fallback():
    """Rows of 24 bytes (no 64-byte vectors fit: the word-by-word tail) and of 4 bytes (not a
    multiple of 8: the caller is told to write and sum separately, nothing written)."""
    if PageWriter(make_pool(4)).copier is None:
        pytest.skip("no C compiler: the C landing copy cannot be built here")
    for read_once in (False, True):
        scatter_and_check([7, 3, 30, 31, 32], [2, 5], KVSpec(1, 1, 6, 1, "float32"), fused=True, read_once=read_once)
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=1, dtype="bfloat16")
    dst = make_pool(8, spec)
    writer = PageWriter(dst)
    assert writer.write_bytes_sum64(writer.plan([1, 2]), 0, memoryview(b"\1" * 16), 0) is None
    assert not dst.kv.any()
    assert PageWriter(dst, use_c_copy=False).copier is None


@pytest.mark.parametrize("pages", [list(range(48)), [5, 9, 2, 40, 41, 7], list(range(63, 15, -1))])
def test_page_writer_accelerator_path(pages):
    """Staging buffers alternate and grow (48 pages uncut: 1.5 MiB, over the first buffer's
    1 MiB); every piece lands where import_pages puts it."""
    n_rows = 2 * TINY_SPEC.num_layers * len(pages)
    scatter_and_check(pages, [], accel_path=True)
    scatter_and_check(pages, [1, n_rows // 3, n_rows // 2 + 1, n_rows - 1], accel_path=True)


def test_page_writer_bfloat16_and_tensor_path():
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="bfloat16")
    scatter_and_check(list(range(20, 60)), [3, 17], spec)
    dst = make_pool(8, spec)
    payload = torch.randn(spec.page_shape(3)).to(torch.bfloat16)
    writer = PageWriter(dst)
    writer.write(writer.plan([6, 1, 3]), 0, payload.reshape(-1, writer.row_elems))
    assert torch.equal(dst.export_pages([6, 1, 3]), payload)


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(64))).map(lambda p: p[:40]), st.lists(st.integers(0, 320)), st.booleans(),
       st.booleans())
def test_page_writer_any_pages_any_cuts(pages, cuts, fused, read_once):
    scatter_and_check(pages, cuts, fused=fused and PageWriter(make_pool(4)).copier is not None, read_once=read_once)


def test_find_runs():
    assert find_runs([3, 4, 5, 9, 8, 7, 1]) == [(0, 3, 3, 1), (3, 9, 3, -1), (6, 1, 1, 1)]
    assert find_runs([]) == []


@pytest.mark.parametrize("algo", ["sum64", "crc32"])
def test_checksum_incremental_equals_whole(algo):
    data = np.random.default_rng(0).integers(0, 256, 10_000 * 8 + 5, dtype=np.uint8).tobytes()
    whole = checksum.of(algo, data)
    running = 0
    for i in range(0, len(data), 8 * 1000):
        running = checksum.update(algo, running, memoryview(data)[i:i + 8 * 1000])
    assert running == whole
    assert checksum.of(algo, torch.frombuffer(bytearray(data), dtype=torch.uint8)) == whole
    flipped = bytearray(data)
    flipped[1234] ^= 0x01
    assert checksum.of(algo, bytes(flipped)) != whole


def test_checksum_reference_values():
    words = np.array([1, 2, (1 << 64) - 1], dtype="<u8").tobytes()
    assert checksum.of("sum64", words) == 2  # wraps modulo 2**64
    assert checksum.of("sum64", b"\x01") == 1  # a short tail is zero-padded
    assert checksum.of("crc32", b"hello") == zlib.crc32(b"hello")


@pytest.mark.parametrize("change,field", [
    (dict(backend="carrier"), "backend"), (dict(chunk_bytes=0), "chunk_bytes"),
    (dict(window=0), "window"), (dict(transfer_timeout_s=0), "transfer_timeout_s"),
    (dict(endpoint="http://x"), "endpoint"), (dict(endpoint="ipc://*"), "endpoint"),
    (dict(checksum="md5"), "checksum"),
    (dict(chunk_bytes=16 << 20), "chunk_bytes"), (dict(inline_max_bytes=8 << 20),
                                                  "inline_max_bytes"),
    (dict(hwm=2), "hwm"), (dict(tick_s=60.0), "tick_s"),
])
def test_config_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        TransportConfig(**change)


def test_fault_config_validation():
    with pytest.raises(ValueError, match="drop_prob"):
        FaultConfig(drop_prob=1.5)
    with pytest.raises(ValueError, match="kinds"):
        FaultConfig(kinds=("teleport",))


def test_fault_injector_is_seeded_and_capped():
    cfg = FaultConfig(drop_prob=0.5, seed=7, kinds=("chunk",))
    inj1, inj2 = FaultInjector(cfg), FaultInjector(cfg)
    seq1 = [inj1.decide("chunk") for _ in range(50)]
    assert seq1 == [inj2.decide("chunk") for _ in range(50)]
    assert Fault.DROP in seq1 and None in seq1
    assert FaultInjector(cfg).decide("header") is None  # kind not targeted
    capped = FaultInjector(FaultConfig(drop_prob=1, max_faults=2))
    assert [capped.decide("header") for _ in range(4)] == [Fault.DROP, Fault.DROP, None, None]
    disc = FaultInjector(FaultConfig(disconnect_after_chunks=2))
    assert [disc.decide("chunk") for _ in range(5)] == [None, None, Fault.DISCONNECT, None, None]
    # the disconnect is scheduled: random faults that spent max_faults before it do not cancel it
    both = FaultInjector(FaultConfig(drop_prob=1, disconnect_after_chunks=3, max_faults=2))
    got = [both.decide("chunk") for _ in range(6)]
    assert got == [Fault.DROP, Fault.DROP, None, Fault.DISCONNECT, None, None]


def test_fault_decisions_depend_on_the_message_index_alone():
    """Corrupting a frame draws its byte position from its own stream: frames of other sizes
    (transfers interleaving differently) must not shift the faults of later messages."""
    cfg = FaultConfig(corrupt_prob=0.3, truncate_prob=0.1, drop_prob=0.1, seed=5)

    def run(frame_len):
        inj, out = FaultInjector(cfg), []
        for _ in range(60):
            f = inj.decide("chunk")
            if f in (Fault.CORRUPT, Fault.TRUNCATE):
                inj.mangle(f, [b"hdr", bytes(frame_len)])
            out.append(f)
        return out

    small = run(3)
    assert Fault.CORRUPT in small and small == run(1 << 20) == run(777)


def test_fault_mangle_never_touches_the_original():
    original = bytearray(b"abcdefgh")
    inj = FaultInjector(FaultConfig(seed=1))
    corrupt = inj.mangle(Fault.CORRUPT, [b"hdr", memoryview(original)])
    assert original == bytearray(b"abcdefgh") and corrupt[-1] != bytes(original)
    assert inj.mangle(Fault.TRUNCATE, [b"hdr", bytes(original)])[-1] == b"abcd"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 5 * 65536 + 100).map(lambda n: n // 8 * 8 + (n % 3 == 0) * 5),
       st.sampled_from([65536, 2 * 65536, 4 << 20]))
def test_export_block_sums_give_the_same_running_checksums(nbytes, chunk):
    """The sums an export takes during its gather fold into exactly the chunk checksums the
    transport would compute by reading the payload itself."""
    data = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes, np.uint8))
    blocks = block_sums(data)
    view = memoryview(data.numpy())
    expect, running = [], 0
    for off in range(0, max(nbytes, 1), chunk):
        running = checksum.update("sum64", running, view[off:off + chunk])
        expect.append(running)
    assert checksum.running_from_blocks(blocks, SUM_BLOCK_BYTES, chunk, nbytes) == expect
    assert checksum.running_from_blocks(blocks, SUM_BLOCK_BYTES, nbytes, nbytes, whole=True) \
        == [checksum.of("sum64", view)]
    if nbytes:  # chunks that cut blocks, or blocks that miss bytes, cannot be used
        assert checksum.running_from_blocks(blocks, SUM_BLOCK_BYTES, 65536 + 8, nbytes) is None
        assert checksum.running_from_blocks(blocks[:-1], SUM_BLOCK_BYTES, chunk, nbytes) is None


def _result_lands_with_the_timeout(wait):
    """The loop ordering that loses a result in asyncio.wait_for on Python >= 3.12: the loop is
    busy past the deadline, then in one pass the awaited future gets its result (an I/O
    callback: pyzmq has already taken the message off the socket) and the timeout fires."""
    import asyncio
    import time

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        task = asyncio.create_task(wait(fut, 0.01))
        await asyncio.sleep(0)  # the task now waits on fut, its deadline armed
        time.sleep(0.05)  # busy past the deadline (a first CUDA launch, an engine step)
        loop.call_soon(fut.set_result, "message")  # runs before the expired timer in one pass
        try:
            return await task
        except asyncio.TimeoutError:
            return "lost" if fut.done() and not fut.cancelled() else "timed out"

    return asyncio.run(main())


def test_bounded_never_drops_a_result_that_arrived():
    from pdtb.aio import bounded

    assert _result_lands_with_the_timeout(bounded) == "message"


def test_bounded_times_out_and_cancels_what_is_still_pending():
    import asyncio

    from pdtb.aio import bounded

    async def main():
        fut = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await bounded(fut, 0.01)
        return fut.cancelled()

    assert asyncio.run(main())


def test_every_backend_name_registers_a_sender_and_a_receiver():
    import kv_transport
    from kv_transport.config import BACKENDS

    assert set(kv_transport.BACKEND_CLASSES) == set(BACKENDS)
    for name in BACKENDS:
        sender, receiver = kv_transport._backend_class(name, 0), kv_transport._backend_class(name, 1)
        assert sender.__name__.endswith("Sender") and callable(getattr(sender, "send", None)), name
        assert receiver.__name__.endswith("Receiver") and callable(getattr(receiver, "close", None)), name
    with pytest.raises(ValueError, match="unknown KV transport backend 'carrier-pigeon'"):
        kv_transport._backend_class("carrier-pigeon", 0)
