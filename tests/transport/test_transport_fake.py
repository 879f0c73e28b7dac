"""Sender/receiver state machines over the in-process fake, with every injected fault.

After every fault: the transfer ends FAILED with a reason within its timeout (or DONE for the
harmless ones), no page stays RESERVED on either side, the pools' invariants hold, and the
next transfer on the same pair moves bit-identical pages.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import pytest
import torch

from kv_transport import FaultConfig, TransferMeta, TransferState, TransportConfig
from kv_transport.admission import Admission
from kv_transport.fail_codes import FailCode
from kv_transport.fake import FakeNetwork, FakeReceiver, FakeSender
from kv_transport.testing import TINY_SPEC, make_export, make_pool

PAGE = TINY_SPEC.bytes_per_page  # 32 KiB: 1 page is inline, more pages are chunked
TIMEOUT = 1.0


def make_config(faults: FaultConfig = FaultConfig(), **kw) -> TransportConfig:
    base = TransportConfig(backend="fake", endpoint="fake://decode0", chunk_bytes=2 * PAGE,
                           window=2, inline_max_bytes=PAGE, max_batch=8, hwm=16,
                           transfer_timeout_s=TIMEOUT, idle_timeout_s=0.4, send_timeout_s=0.5,
                           tick_s=0.01, close_timeout_s=0.5, faults=faults)
    return dataclasses.replace(base, **kw)


def slow_chunks(delay_s: float) -> FaultConfig:
    """Every chunk delayed by delay_s: a chunked transfer stays under way long enough to act on."""
    return FaultConfig(delay_prob=1, delay_s=delay_s, kinds=("chunk",))


def run(coro, limit: float = 20.0):
    """Every test coroutine runs under a hard bound."""
    return asyncio.run(asyncio.wait_for(coro, limit))


class Pair:
    """A started FakeSender/FakeReceiver pair over one FakeNetwork, with source/dest pools."""

    def __init__(self, tx_faults=FaultConfig(), rx_faults=FaultConfig(), rx_pages=512,
                 admit=None, **kw) -> None:
        self.net = FakeNetwork(hwm=16)
        self.src = make_pool(512, seed=1)
        self.dst = make_pool(rx_pages)
        self.rx = FakeReceiver(make_config(rx_faults, **kw), self.dst, self.net, admit=admit)
        self.tx = FakeSender(make_config(tx_faults, **kw), TINY_SPEC, self.net)
        self._n = 0

    async def __aenter__(self) -> "Pair":
        await self.rx.start()
        await self.tx.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.tx.close()
        await self.rx.close()

    def export(self, num_pages: int, tail: int = 3):
        self._n += 1
        return make_export(self.src, f"req-{self._n}", num_pages, tail)

    async def send_until_reserved(self, num_pages: int) -> int:
        """Send a transfer of num_pages and wait (bounded) until the receiver has reserved them all;
        the transfer's id."""
        tid = self.tx.send(self.export(num_pages))
        await wait_until(lambda: self.dst.state_counts()["reserved"] == num_pages)
        return tid

    async def transfer(self, num_pages: int, meta: TransferMeta | None = None):
        export = self.export(num_pages)
        t0 = time.monotonic()
        status = await self.tx.wait(self.tx.send(export, meta), TIMEOUT + 2.0)
        return status, export, time.monotonic() - t0

    async def settle(self, limit: float = 2.0) -> None:
        """Wait (bounded) until the receiver holds no reserved page."""
        deadline = time.monotonic() + limit
        while self.dst.state_counts()["reserved"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def assert_clean(self) -> None:
        for pool in (self.src, self.dst):
            assert pool.state_counts()["reserved"] == 0
            pool.check()

    async def assert_next_transfer_ok(self, num_pages: int = 5) -> None:
        status, export, _ = await self.transfer(num_pages)
        assert status.state is TransferState.DONE, status.reason
        got = await self.rx.next_completed(2.0)
        while got is not None and got.request_id != export.header.request_id:
            got = await self.rx.next_completed(2.0)
        assert got is not None
        assert torch.equal(self.dst.export_pages(got.pages), export.data)
        self.assert_clean()


# ---- faults that fail the transfer ----------------------------------------------------------
ONE = dict(max_faults=1)
FAILING = [
    # (name, sender faults, receiver faults, pages, substring of the reason)
    ("drop inline header", FaultConfig(drop_prob=1, kinds=("header",), **ONE), None, 1,
     "timeout"),
    ("drop chunked header", FaultConfig(drop_prob=1, kinds=("header",), **ONE), None, 5,
     "timeout"),
    ("drop first chunk", FaultConfig(drop_prob=1, kinds=("chunk",), **ONE), None, 5, "missing"),
    ("drop batch", FaultConfig(drop_prob=1, kinds=("header", "batch"), **ONE), None, 1,
     "timeout"),
    ("delay past timeout", FaultConfig(delay_prob=1, delay_s=TIMEOUT + 0.3, kinds=("chunk",),
                                       **ONE), None, 5, "timeout"),
    ("corrupt chunk", FaultConfig(corrupt_prob=1, kinds=("chunk",), **ONE), None, 5,
     "checksum"),
    ("corrupt inline", FaultConfig(corrupt_prob=1, kinds=("header",), **ONE), None, 1,
     "checksum"),
    ("truncate chunk", FaultConfig(truncate_prob=1, kinds=("chunk",), **ONE), None, 5,
     "payload"),
    ("truncate inline", FaultConfig(truncate_prob=1, kinds=("header",), **ONE), None, 1,
     "payload"),
    ("disconnect", FaultConfig(disconnect_after_chunks=1), None, 5, "disconnected"),
    ("receiver drops credit", None, FaultConfig(drop_prob=1, kinds=("credit",), **ONE), 5,
     "timeout"),
    ("receiver drops ack", None, FaultConfig(drop_prob=1, kinds=("ack",), **ONE), 5,
     "timeout"),
    ("receiver drops nack", FaultConfig(corrupt_prob=1, kinds=("chunk",), **ONE),
     FaultConfig(drop_prob=1, kinds=("nack",), **ONE), 5, "timeout"),
]


@pytest.mark.parametrize("name,tx_faults,rx_faults,pages,reason", FAILING,
                         ids=[f[0] for f in FAILING])
def test_fault_fails_transfer_cleanly(name, tx_faults, rx_faults, pages, reason):
    async def body():
        async with Pair(tx_faults or FaultConfig(), rx_faults or FaultConfig()) as p:
            status, _, elapsed = await p.transfer(pages)
            assert status.state is TransferState.FAILED
            assert reason in f"{status.code}: {status.reason}", status
            assert elapsed < TIMEOUT + 0.5  # failed within its timeout (plus a tick or two)
            injected = p.tx.faults.injected + p.rx.faults.injected
            assert injected, "the fault was never injected"
            await p.settle()
            p.assert_clean()
            await p.assert_next_transfer_ok()
    run(body())


def test_lost_ack_leaves_committed_pages_not_reserved(caplog):
    """Only the ACK is lost: the receiver committed, the sender reports FAILED. Documented."""
    async def body():
        async with Pair(rx_faults=FaultConfig(drop_prob=1, kinds=("ack",), **ONE)) as p:
            status, export, _ = await p.transfer(3)
            assert status.state is TransferState.FAILED
            got = await p.rx.next_completed(1.0)
            assert got is not None and got.request_id == export.header.request_id
            await p.settle()
            p.assert_clean()
            assert p.dst.state_counts()["resident"] == 3
    with caplog.at_level(logging.INFO, logger="kv_transport"):
        run(body())
    assert "late cancel" in caplog.text  # the sender's cancel arrived after the commit


# ---- faults that must not fail the transfer -------------------------------------------------
@pytest.mark.parametrize("faults,pages", [
    (FaultConfig(duplicate_prob=1, kinds=("header", "batch", "chunk")), 5),
    (FaultConfig(duplicate_prob=1, kinds=("header", "batch")), 1),
    (FaultConfig(delay_prob=1, delay_s=0.05, kinds=("header", "chunk")), 5),
], ids=["duplicate chunked", "duplicate inline", "small delay"])
def test_harmless_faults(faults, pages, caplog):
    async def body():
        async with Pair(tx_faults=faults) as p:
            status, export, _ = await p.transfer(pages)
            assert status.state is TransferState.DONE, status.reason
            got = await p.rx.next_completed(1.0)
            assert torch.equal(p.dst.export_pages(got.pages), export.data)
            await asyncio.sleep(0.05)  # let duplicates arrive
            p.assert_clean()
            assert p.dst.state_counts()["resident"] == pages  # duplicates took no pages
            await p.assert_next_transfer_ok()
    with caplog.at_level(logging.INFO, logger="kv_transport"):
        run(body())
    if faults.duplicate_prob:
        assert "duplicate" in caplog.text


def test_receiver_acks_arrive_twice_are_discarded(caplog):
    async def body():
        async with Pair(rx_faults=FaultConfig(duplicate_prob=1, kinds=("ack",))) as p:
            status, _, _ = await p.transfer(3)
            assert status.state is TransferState.DONE
            await asyncio.sleep(0.05)
            await p.assert_next_transfer_ok()
    with caplog.at_level(logging.INFO, logger="kv_transport"):
        run(body())
    assert "duplicate ack" in caplog.text


# ---- refusals, cancels, close ---------------------------------------------------------------
def test_no_pages_is_nacked():
    async def body():
        async with Pair(rx_pages=4) as p:
            status, _, elapsed = await p.transfer(5)
            assert status.state is TransferState.FAILED and status.code is FailCode.NO_PAGES
            assert elapsed < 0.5  # a NACK, not a timeout
            p.assert_clean()
            await p.assert_next_transfer_ok(num_pages=3)
    run(body())


def test_admit_policy_refusal():
    def admit(header):
        return Admission.defer("tenant over quota") if header.tenant == "greedy" else Admission.accept()

    async def body():
        async with Pair(admit=admit) as p:
            status, _, _ = await p.transfer(2, TransferMeta(tenant="greedy"))
            assert status.state is TransferState.FAILED and status.code is FailCode.NO_PAGES
            assert "over quota" in status.reason
            p.assert_clean()
            await p.assert_next_transfer_ok()
    run(body())


def test_sender_cancel_frees_receiver_pages():
    async def body():
        async with Pair(tx_faults=slow_chunks(0.1)) as p:
            tid = await p.send_until_reserved(9)
            p.tx.cancel(tid, "request aborted")
            assert p.tx.poll(tid).state is TransferState.FAILED
            await p.settle()
            p.assert_clean()
            assert p.rx.poll(tid).state is TransferState.FAILED
    run(body())


def test_receiver_cancel_fails_sender():
    async def body():
        async with Pair(tx_faults=slow_chunks(0.1)) as p:
            tid = p.tx.send(p.export(9))
            await wait_until(lambda: p.rx.poll(tid) is not None)
            p.rx.cancel(tid, "decode aborted the request")
            p.assert_clean()
            status = await p.tx.wait(tid, 2.0)
            assert status.state is TransferState.FAILED and "decode aborted" in status.reason
    run(body())


def test_close_mid_transfer_frees_everything():
    async def body():
        p = Pair(tx_faults=slow_chunks(0.1))
        await p.__aenter__()
        tid = await p.send_until_reserved(9)
        await p.rx.close()
        p.assert_clean()
        status = await p.tx.wait(tid, 2.0)
        assert status.state is TransferState.FAILED
        await p.tx.close()
    run(body())


# ---- lifetime and flow control --------------------------------------------------------------
def test_pages_stay_reserved_until_done():
    async def body():
        async with Pair(tx_faults=slow_chunks(0.05), rx_pages=20) as p:
            tid = await p.send_until_reserved(9)
            inflight = set(p.rx.poll(tid) and p.dst.pages_of(p.tx.poll(tid).request_id))
            assert p.dst.allocate("other", 12) is None  # reserved pages are not handed out
            other = p.dst.allocate("other", 11)
            assert not inflight & set(other)
            status = await p.tx.wait(tid, 2.0)
            assert status.state is TransferState.DONE
            assert p.dst.state_counts() == {"free": 0, "reserved": 0, "resident": 20,
                                            "parked": 0, "cached": 0}
    run(body())


def test_sender_never_exceeds_the_credit_window():
    async def body():
        async with Pair(window=2) as p:
            sent, granted = {}, {}
            emit, on_credit = p.tx._emit, p.tx._on_credit

            async def counting_emit(frames, kind, owners, peer=None):
                if kind == "chunk":
                    tid = owners[0].header.transfer_id
                    sent[tid] = sent.get(tid, 0) + 1
                    assert sent[tid] <= granted[tid], "chunk sent without a credit"
                await emit(frames, kind, owners, peer)

            def counting_credit(o, credit):
                granted[credit.transfer_id] = max(granted.get(credit.transfer_id, 0), credit.upto)
                on_credit(o, credit)

            p.tx._emit, p.tx._on_credit = counting_emit, counting_credit
            status, _, _ = await p.transfer(40)  # 20 chunks of 2 pages
            assert status.state is TransferState.DONE
            assert sum(sent.values()) == 20
    run(body())


def test_ragged_requests_and_metadata_arrive_intact():
    async def body():
        async with Pair() as p:
            exports = [p.export(n, tail=n % 7) for n in (1, 3, 17, 200)]
            metas = [TransferMeta(tenant=f"t{i}", prompt_token_ids=list(range(i + 3)),
                                  output_token_ids=[42], num_computed_tokens=i + 3,
                                  extra={"max_tokens": 16, "stop": ["\n"]})
                     for i in range(len(exports))]
            tids = [p.tx.send(e, m) for e, m in zip(exports, metas)]
            for tid in tids:
                assert (await p.tx.wait(tid, 3.0)).state is TransferState.DONE
            assert p.rx.num_landed == len(exports) and p.rx.num_reserved_pages == 0  # landed, not yet taken
            got = {r.request_id: r for r in p.rx.take_completed()}
            assert p.rx.num_landed == 0
            for e, m in zip(exports, metas):
                r = got[e.header.request_id]
                assert torch.equal(p.dst.export_pages(r.pages), e.data)
                assert r.pages == p.dst.pages_of(r.request_id)  # page table = pool order
                assert (r.tenant, r.prompt_token_ids, r.output_token_ids, r.extra) == \
                    (m.tenant, m.prompt_token_ids, m.output_token_ids, m.extra)
                assert r.num_tokens == e.header.num_tokens
            p.assert_clean()
    run(body())


def test_small_requests_are_batched():
    async def body():
        async with Pair(chunk_bytes=8 * PAGE) as p:  # a batch carries up to chunk_bytes
            messages = []
            to_receiver = p.net.to_receiver

            async def counting(endpoint, peer, frames):
                messages.append(len(frames))
                await to_receiver(endpoint, peer, frames)
            p.net.to_receiver = counting
            tids = [p.tx.send(p.export(1)) for _ in range(40)]
            for tid in tids:
                assert (await p.tx.wait(tid, 3.0)).state is TransferState.DONE
            assert len(messages) <= 40 // 8 + 1  # max_batch = 8
            assert len(p.rx.take_completed()) == 40
    run(body())


def test_unstarted_or_closed_sender_refuses():
    async def body():
        net = FakeNetwork()
        tx = FakeSender(make_config(), TINY_SPEC, net)
        export = make_export(make_pool(8, seed=0), "r", 1)
        with pytest.raises(RuntimeError):
            tx.send(export)
        rx = FakeReceiver(make_config(), make_pool(8), net)
        await rx.start()
        await tx.start()
        await tx.close()
        with pytest.raises(RuntimeError):
            tx.send(export)
        await rx.close()
    run(body())


async def wait_until(predicate, limit: float = 2.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("pages", [1, 300])  # inline and chunked
def test_stale_export_sums_fail_the_transfer(pages):
    """The sender folds the export's own block sums into its checksums: bytes changed after
    the export are caught by the receiver, and nothing stays reserved."""
    async def body():
        async with Pair() as p:
            export = p.export(pages)
            assert export.block_sums is not None
            export.data.view(-1)[7] += 1.0
            status = await p.tx.wait(p.tx.send(export), TIMEOUT + 2.0)
            assert status.state is TransferState.FAILED and status.code is FailCode.CHECKSUM
            await p.settle()
            p.assert_clean()
            await p.assert_next_transfer_ok()
    run(body())


def test_a_second_transfer_for_a_request_that_still_holds_pages_is_refused():
    """A request's landed pages are still held (not yet released by the node) when another
    transfer for the same request id comes: it is refused ("busy"), never reserved under the
    same owner, where freeing the first would free the new RESERVED pages too and let the
    transfer write into pages handed to someone else (the late-writer case)."""
    async def body():
        async with Pair() as p:
            first = p.export(4)
            status = await p.tx.wait(p.tx.send(first), 2.0)
            assert status.state is TransferState.DONE
            landed = await p.rx.next_completed(2.0)
            again = make_export(p.src, first.header.request_id, 6)
            status = await p.tx.wait(p.tx.send(again), 2.0)
            assert status.state is TransferState.FAILED and status.code is FailCode.BUSY
            assert p.dst.state_counts()["reserved"] == 0 and p.dst.pages_of(landed.request_id) == landed.pages
            p.dst.free(landed.request_id)  # released: the same id may come again
            status = await p.tx.wait(p.tx.send(again), 2.0)
            assert status.state is TransferState.DONE
            p.assert_clean()
    run(body())


def test_close_refuses_new_transfers_on_both_sides():
    """Headers arriving while the receiver closes are refused, not reserved and forgotten; a
    sender that is closing refuses send() instead of leaving a transfer that never ends."""
    async def body():
        p = Pair(tx_faults=slow_chunks(0.05))
        await p.__aenter__()
        tid = await p.send_until_reserved(9)
        closing = asyncio.ensure_future(p.rx.close())
        await asyncio.sleep(0)
        late = p.tx.send(p.export(3))  # reaches the receiver while it flushes its NACKs
        await closing
        p.assert_clean()
        assert not p.rx._live
        for t in (tid, late):
            assert (await p.tx.wait(t, 2.0)).state is TransferState.FAILED
        closing = asyncio.ensure_future(p.tx.close())
        await asyncio.sleep(0)
        with pytest.raises(Exception, match="closed"):
            p.tx.send(p.export(2))
        await closing
    run(body())


def test_a_truncated_batch_fails_every_transfer_in_it_at_once():
    """A batch of small transfers whose payload frames do not add up is NACKed transfer by
    transfer: each fails now with the reason, none waits out its timeout."""
    async def body():
        async with Pair(tx_faults=FaultConfig(truncate_prob=1, kinds=("batch",), max_faults=1)) as p:
            exports = [p.export(1) for _ in range(6)]
            t0 = time.monotonic()
            tids = [p.tx.send(e) for e in exports]
            states = [await p.tx.wait(t, TIMEOUT + 2) for t in tids]
            failed = [s for s in states if s.state is TransferState.FAILED]
            assert failed and all("payload" in s.reason for s in failed), [s.reason for s in failed]
            assert time.monotonic() - t0 < TIMEOUT  # NACKed, not timed out
            await p.settle()
            p.assert_clean()
            await p.assert_next_transfer_ok()
    run(body())


def test_duplicated_credits_do_not_widen_the_window():
    """Every Credit the receiver sends arrives twice: the sender still never has more than
    `window` chunks of a transfer ahead of what the receiver has taken in."""
    async def body():
        dup = FaultConfig(duplicate_prob=1.0, kinds=("credit",))
        async with Pair(rx_faults=dup, window=2) as p:
            sent, taken, worst = {}, {}, [0]
            emit, on_chunk = p.tx._emit, p.rx._on_chunk

            async def counting_emit(frames, kind, owners, peer=None):
                if kind == "chunk":
                    tid = owners[0].header.transfer_id
                    sent[tid] = sent.get(tid, 0) + 1
                    worst[0] = max(worst[0], sent[tid] - taken.get(tid, 0))
                await emit(frames, kind, owners, peer)

            async def counting_chunk(c, view):
                taken[c.transfer_id] = taken.get(c.transfer_id, 0) + 1
                await on_chunk(c, view)

            p.tx._emit, p.rx._on_chunk = counting_emit, counting_chunk
            status, _, _ = await p.transfer(40)  # 20 chunks of 2 pages
            assert status.state is TransferState.DONE
            assert any(f.value == "duplicate" for _, f in p.rx.faults.injected)
            assert worst[0] <= 2, f"{worst[0]} chunks in flight with a window of 2"
            await p.assert_next_transfer_ok()
        p.assert_clean()
    run(body())

