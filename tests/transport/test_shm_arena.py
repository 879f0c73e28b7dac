"""The shm sender's export arena (kv_transport/shm_arena.py) against a brute-force model: a
range is handed out once, comes back only when its last tensor and its last holder are gone,
and free ranges coalesce so that the whole arena can be leased again."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from kv_transport.shm_arena import ALIGN, ExportArena
from pdtb.engine.shared_memory import open_buffer


def _units(nbytes: int) -> int:
    return -(-nbytes // ALIGN)


def test_leases_never_overlap_and_all_come_back_in_a_random_life():
    """Random leases, holds, drops and tensor deaths, checked at every step against a model:
    a byte map of which lease owns each ALIGN unit, and the count of holders of each lease."""
    rng = random.Random(5)
    units = 64
    arena = ExportArena(units * ALIGN)
    owner = [None] * units  # unit -> id of the live lease on it (tensor alive or held)
    live: dict[int, dict] = {}  # lease id -> {"t": tensor or None, "holds": n, "off": offset, "n": units}
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            nbytes = rng.randint(1, 12 * ALIGN)
            t = arena.lease(nbytes)
            need = _units(nbytes)
            fits = any(all(o is None for o in owner[i:i + need]) for i in range(units - need + 1))
            if t is None:
                del t
                assert not fits, f"step {step}: {need} free units in a row, yet no lease"
                continue
            off = arena.offset_of(t)
            assert off is not None and off % ALIGN == 0 and t.numel() == nbytes
            first = off // ALIGN
            assert all(o is None for o in owner[first:first + need]), f"step {step}: a leased range handed out again"
            lid = step
            owner[first:first + need] = [lid] * need
            t.fill_(lid % 251)
            live[lid] = {"t": t, "holds": 0, "off": off, "n": need}
            del t  # (the model's record is its only reference)
        elif op < 0.6 and live:
            lid = rng.choice(list(live))
            arena.hold(live[lid]["off"])
            live[lid]["holds"] += 1
        else:
            if not live:
                continue
            lid = rng.choice(list(live))
            rec = live[lid]
            if rec["t"] is not None and (rec["holds"] == 0 or rng.random() < 0.5):
                rec["t"] = None  # the export (every view of it) dies: freed by its refcount, at once
            elif rec["holds"]:
                arena.drop(rec["off"])
                rec["holds"] -= 1
            if rec["t"] is None and rec["holds"] == 0:
                first = rec["off"] // ALIGN
                owner[first:first + rec["n"]] = [None] * rec["n"]
                del live[lid]
        for lid, rec in live.items():  # nobody wrote into a live lease's bytes
            if rec["t"] is not None:
                assert int(rec["t"].min()) == int(rec["t"].max()) == lid % 251
        assert arena.free_bytes == owner.count(None) * ALIGN
    for rec in live.values():
        for _ in range(rec["holds"]):
            arena.drop(rec["off"])
        rec["t"] = None
    live.clear()
    gc.collect()
    assert arena.free_bytes == units * ALIGN
    whole = arena.lease(units * ALIGN)  # coalesced back into one range
    assert whole is not None and arena.offset_of(whole) == 0
    arena.close()


def test_a_view_of_the_export_keeps_its_range():
    arena = ExportArena(8 * ALIGN)
    t = arena.lease(3 * ALIGN)
    view = t.view(torch.float32).view(3, -1)[1:]  # what export_pages(out=) hands back, and slices of it
    del t
    gc.collect()
    assert arena.free_bytes == 5 * ALIGN
    assert arena.offset_of(view) == ALIGN  # (inside its lease)
    del view
    gc.collect()
    assert arena.free_bytes == 8 * ALIGN
    arena.close()


def test_only_tensors_inside_one_lease_are_in_the_arena():
    arena = ExportArena(8 * ALIGN)
    a = arena.lease(2 * ALIGN)
    assert arena.offset_of(torch.zeros(16)) is None  # elsewhere in memory
    assert arena.offset_of(a[:: 2]) is None  # not contiguous
    assert arena.offset_of(a[ALIGN:]) == ALIGN
    with pytest.raises(KeyError):
        arena.hold(6 * ALIGN)  # no lease there
    arena.close()


def test_a_peer_maps_the_arena_and_reads_a_lease_where_its_offset_says():
    arena = ExportArena(4 * ALIGN)
    t = arena.lease(ALIGN + 8)
    t.copy_(torch.arange(ALIGN + 8, dtype=torch.int64).to(torch.uint8))
    peer = open_buffer(arena.locator)
    from pdtb.engine.shared_memory import HEADER_BYTES
    off = arena.offset_of(t)
    assert bytes(peer.map[HEADER_BYTES + off:HEADER_BYTES + off + ALIGN + 8]) == t.numpy().tobytes()
    peer.close()
    arena.close()


def test_an_arena_too_small_is_refused():
    with pytest.raises(ValueError):
        ExportArena(ALIGN - 1)


def test_an_export_gathered_into_a_buffer_equals_a_fresh_one():
    """export_request(out=...) fills the buffer with exactly the bytes (and block sums) a fresh
    export has; a buffer of the wrong size is not used, and export_pages refuses it outright."""
    from kv_transport.testing import TINY_SPEC, make_pool
    from pdtb.engine.kv_export import export_request
    pool = make_pool(32, seed=3)
    pool.allocate("r", 7)
    plain = export_request(pool, "r", 7 * TINY_SPEC.page_size - 3, skip_pages=2)
    arena = ExportArena(2 * plain.header.payload_bytes)
    buf = arena.lease(plain.header.payload_bytes)
    into = export_request(pool, "r", 7 * TINY_SPEC.page_size - 3, skip_pages=2, out=buf)
    assert into.data.data_ptr() == buf.data_ptr() and torch.equal(into.data, plain.data)
    assert (into.block_sums == plain.block_sums).all() and into.header == plain.header
    small = arena.lease(plain.header.payload_bytes - 8)
    other = export_request(pool, "r", 7 * TINY_SPEC.page_size - 3, skip_pages=2, out=small)
    assert other.data.data_ptr() != small.data_ptr() and torch.equal(other.data, plain.data)
    with pytest.raises(ValueError):
        pool.export_pages(pool.pages_of("r")[2:], out=small)
    arena.close()


def test_a_lease_collected_inside_the_arenas_own_critical_section_does_not_deadlock(monkeypatch):
    """A lease caught in a reference cycle is finalized by the cyclic collector, which may run
    on any allocation, inside the arena's lock included: the finalizer only queues the range,
    and the next call returns it."""
    import threading

    import kv_transport.shm_arena as shm_arena
    arena = ExportArena(8 * ALIGN)
    kept = arena.lease(ALIGN)
    t = arena.lease(ALIGN)
    cycle = [t]
    cycle.append(cycle)
    del t, cycle
    real = shm_arena.bisect.bisect_right

    def collecting(*a, **kw):  # the collector runs here, under the lock (offset_of holds it)
        gc.collect()
        return real(*a, **kw)
    monkeypatch.setattr(shm_arena.bisect, "bisect_right", collecting)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (arena.offset_of(kept), done.set()), daemon=True)
    worker.start()
    worker.join(10)
    assert done.is_set(), "offset_of deadlocked on a finalizer run inside the lock"
    monkeypatch.setattr(shm_arena.bisect, "bisect_right", real)
    assert arena.free_bytes == 7 * ALIGN  # the queued range came back
    del kept
    assert arena.free_bytes == 8 * ALIGN
    arena.close()
