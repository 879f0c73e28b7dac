"""Hand-offs that leave out the pages the receiver caches: the wire fields, the receiver's
sharing and its cache_miss refusal, and the prefill side's belief of what each peer holds."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kv_transport import TransferMeta, TransferState
from kv_transport.fail_codes import FailCode
from kv_transport.fake import FakeNetwork, FakeReceiver, FakeSender
from kv_transport.testing import TINY_SPEC, make_pool
from kv_transport.wire import decode, encode
from kv_transport.wire_check import WireError, WireLimits
from pdtb.engine.kv_export import export_request
from pdtb.nodes.handoff import HandoffEvent
from prefill_node.handoff import Handoff, Outcome, transfer_ended
from prefill_node.peer_pages import PeerPages
from tests.transport.test_transport_fake import TIMEOUT, make_config, run

PS = TINY_SPEC.page_size
HASHES = [11, 12, 13, 14, 15]


class Ends:
    """A started fake sender/receiver pair; the receiver caches prefix pages."""

    def __init__(self, cache: bool = True) -> None:
        self.net = FakeNetwork(hwm=16)
        self.src, self.dst = make_pool(64, seed=1), make_pool(64)
        self.rx = FakeReceiver(make_config(), self.dst, self.net)
        if cache:  # the test's "hash" of page i is HASHES[i]: tokens do not matter
            self.rx.prefix_hashes = lambda tokens, n: HASHES[:n]
        self.tx = FakeSender(make_config(), TINY_SPEC, self.net)

    async def __aenter__(self):
        await self.rx.start()
        await self.tx.start()
        return self

    async def __aexit__(self, *exc):
        await self.tx.close()
        await self.rx.close()

    async def send(self, rid: str, pages: int, skip: int, tail: int = 3):
        if not self.src.num_held(rid):
            self.src.allocate(rid, pages)
        export = export_request(self.src, rid, pages * PS - tail, skip)
        full = (pages * PS - tail) // PS
        meta = TransferMeta(prompt_token_ids=[1] * (pages * PS - tail), num_computed_tokens=pages * PS - tail,
                            page_hashes=HASHES[:full])
        return await self.tx.wait(self.tx.send(export, meta), TIMEOUT + 2.0)


def page_bytes(pool, pages):
    return pool.kv[:, :, pages].clone()


def test_a_second_hand_off_shares_the_cached_pages_and_carries_only_the_rest():
    async def body():
        async with Ends() as e:
            first = await e.send("a", 5, 0)
            assert first.state is TransferState.DONE
            (got_a,) = e.rx.take_completed()
            assert e.dst.num_registered == 4  # the full pages (the last is 3 tokens short)
            e.dst.free("a")  # request a ends: its registered pages stay cached
            assert e.dst.num_cached == 4
            second = await e.send("b", 5, 3)  # the same prefix: three pages left out
            assert second.state is TransferState.DONE and second.bytes_total == 2 * TINY_SPEC.bytes_per_page
            (got_b,) = e.rx.take_completed()
            assert got_b.skip_pages == 3 and got_b.pages[:3] == got_a.pages[:3]
            # the leading pages are a's cached copies (a real sharer's are equal), the rest b's own
            want = e.src.pages_of("a")[:3] + e.src.pages_of("b")[3:]
            assert torch.equal(page_bytes(e.dst, got_b.pages), page_bytes(e.src, want))
            e.dst.check()
    run(body())


@pytest.mark.parametrize("cache", [True, False])
def test_pages_the_receiver_lacks_are_refused_with_cache_miss_and_nothing_leaks(cache):
    """Nothing cached there yet, or no cache at all: refused, every reserved page free again."""
    async def body():
        async with Ends(cache) as e:
            st = await e.send("a", 5, 2)  # nothing cached there yet
            assert st.state is TransferState.FAILED and st.code is FailCode.CACHE_MISS
            assert e.dst.num_free == e.dst.num_pages and not e.dst.owners()
            again = await e.send("a", 5, 0)  # every page: lands
            assert again.state is TransferState.DONE
            e.dst.check()
    run(body())


def test_wire_checks_the_prefix_fields():
    export = export_request(_pool_with("r", 3), "r", 3 * PS, 1)
    tx_limits = _limits()
    base = _header(export, skip=1, hashes=[5, 6, 7])
    decode(encode(base, [b"\0" * base.payload_bytes]), tx_limits)  # well formed
    for bad in (dict(skip_pages=4), dict(skip_pages=2, page_hashes=[5]), dict(page_hashes=[-1, 2, 3]),
                dict(page_hashes=[1.5, 2, 3]), dict(page_hashes=[1, 2, 3, 4]), dict(skip_pages="1"),
                dict(page_hashes="x")):
        h = dataclasses.replace(base, **bad)
        with pytest.raises(WireError):
            decode(encode(h, [b"\0" * h.payload_bytes]), tx_limits)


def _pool_with(rid, n):
    pool = make_pool(8, seed=2)
    pool.allocate(rid, n)
    return pool


def _limits():
    return WireLimits(spec=TINY_SPEC, max_pages=64, max_message_bytes=8 * TINY_SPEC.bytes_per_page)


def _header(export, skip, hashes):
    from kv_transport import checksum
    from kv_transport.wire import KVTransferHeader

    n = export.header.payload_bytes
    return KVTransferHeader(
        transfer_id="t-1", request_id="r", tenant="", num_tokens=export.header.num_tokens,
        prompt_token_ids=[1] * export.header.num_tokens, output_token_ids=[], num_computed_tokens=3 * PS, extra={},
        num_pages=export.header.num_pages, page_size=PS, dtype=TINY_SPEC.dtype, num_layers=TINY_SPEC.num_layers,
        num_kv_heads=TINY_SPEC.num_kv_heads, head_dim=TINY_SPEC.head_dim, payload_bytes=n, mode="inline",
        chunk_bytes=n, num_chunks=1, checksum_algo="sum64", checksum=checksum.of("sum64", b"\0" * n),
        skip_pages=skip, page_hashes=hashes)


def test_cache_miss_resends_every_page_at_once():
    h = Handoff(seq=None, req=None, targets=[None], deadline=10.0)
    h.on(HandoffEvent.SEND)
    h.skip_pages = 2
    assert transfer_ended(h, False, FailCode.CACHE_MISS, 1.0) is Outcome.HELD
    assert h.no_skip and h.retry_at == 1.0 and h.transfer_id is None


def test_peer_pages_belief():
    b = PeerPages(limit=4)
    b.add("d0", [1, 2, 3])
    assert b.leading("d0", [1, 2, 9, 3]) == 2 and b.leading("d1", [1]) == 0
    b.add("d0", [4, 5])  # bounded: the oldest go
    assert b.leading("d0", [1]) == 0 and b.leading("d0", [2, 3, 4, 5]) == 4
    b.forget("d0")
    assert b.leading("d0", [2]) == 0


def test_hashes_that_are_not_the_receivers_own_are_neither_shared_nor_registered():
    """A sender of another namespace (or a faulty one): its hashes do not match the receiver's
    hashes of the tokens, so they plant nothing in its cache and skip nothing."""
    async def body():
        async with Ends() as e:
            e.rx.prefix_hashes = lambda tokens, n: [h + 1 for h in HASHES[:n]]
            assert (await e.send("a", 5, 0)).state is TransferState.DONE
            e.rx.take_completed()
            assert e.dst.num_registered == 0
            st = await e.send("b", 5, 2)
            assert st.state is TransferState.FAILED and st.code is FailCode.CACHE_MISS
            e.dst.check()
    run(body())
