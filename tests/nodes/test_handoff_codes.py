"""Every admission verdict through a real ZeroMQ receiver on loopback: the sender's status
carries the code the node's admit() gave, unchanged, and a refused transfer holds no page."""
from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import pytest

from kv_transport import TransferMeta, TransferState, TransportConfig
from kv_transport.admission import REFUSALS, Admission, Verdict
from kv_transport.fail_codes import FailCode
from kv_transport.testing import TINY_SPEC, make_export, make_pool
from kv_transport.wire import WIRE_VERSION, MsgType, WireError, WireLimits, decode
from kv_transport.zmq_backend import ZmqReceiver, ZmqSender


def _answer(code: FailCode) -> Admission:
    return Admission.defer("pool full") if code is FailCode.NO_PAGES else Admission.refuse(code, f"said {code}")


@pytest.mark.parametrize("pages", [1, 9], ids=["inline", "chunked"])
def test_every_refusal_code_reaches_the_sender_unchanged(pages):
    config = TransportConfig(endpoint="tcp://127.0.0.1:0", chunk_bytes=4096, inline_max_bytes=4096,
                             transfer_timeout_s=5.0)
    src, dst = make_pool(64, seed=1), make_pool(64)

    def admit(header) -> Admission:  # the tenant names the verdict wanted
        return Admission.accept() if header.tenant == "ok" else _answer(FailCode(header.tenant))

    async def body():
        rx = ZmqReceiver(config, dst, admit=admit)
        await rx.start()
        tx = ZmqSender(dataclasses.replace(config, endpoint=rx.endpoint), TINY_SPEC)
        await tx.start()
        try:
            seen = {}
            for i, code in enumerate(REFUSALS):
                st = await tx.wait(tx.send(make_export(src, f"r{i}", pages), TransferMeta(tenant=code.value)), 5)
                seen[code] = (st.state, st.code, st.reason)
                assert dst.state_counts()["reserved"] == 0 and dst.num_free == dst.num_pages
            ok = await tx.wait(tx.send(make_export(src, "good", pages), TransferMeta(tenant="ok")), 5)
            got = await rx.next_completed(5)
            return seen, ok, got
        finally:
            await tx.close()
            await rx.close()

    seen, ok, got = asyncio.run(asyncio.wait_for(body(), 30))
    for code in REFUSALS:
        state, got_code, reason = seen[code]
        assert state is TransferState.FAILED and got_code is code, (code, seen[code])
        assert ("pool full" if code is FailCode.NO_PAGES else f"said {code}") in reason
    assert ok.state is TransferState.DONE and ok.code is None and got.request_id == "good"


def test_park_receives_into_the_other_pool_and_a_mismatched_one_defers():
    config = TransportConfig(endpoint="tcp://127.0.0.1:0", transfer_timeout_s=5.0)
    src, dst, host = make_pool(64, seed=2), make_pool(64), make_pool(64)
    wrong = make_pool(64, dataclasses.replace(TINY_SPEC, page_size=TINY_SPEC.page_size * 2))

    async def body():
        rx = ZmqReceiver(config, dst, admit=lambda h: Admission.park(host if h.tenant == "host" else wrong))
        await rx.start()
        tx = ZmqSender(dataclasses.replace(config, endpoint=rx.endpoint), TINY_SPEC)
        await tx.start()
        try:
            parked = await tx.wait(tx.send(make_export(src, "p", 3), TransferMeta(tenant="host")), 5)
            landed = await rx.next_completed(5)
            odd = await tx.wait(tx.send(make_export(src, "q", 3), TransferMeta(tenant="other")), 5)
            return parked, landed, odd
        finally:
            await tx.close()
            await rx.close()

    parked, landed, odd = asyncio.run(asyncio.wait_for(body(), 30))
    assert parked.state is TransferState.DONE and landed.tier == host.tier and host.num_held("p") == 3
    assert odd.state is TransferState.FAILED and odd.code is FailCode.NO_PAGES


def test_verdicts_are_checked():
    assert Admission.accept().verdict is Verdict.ACCEPT
    assert Admission.defer("x").code is FailCode.NO_PAGES
    for code in (FailCode.NO_PAGES, FailCode.CHECKSUM, FailCode.TIMEOUT):
        with pytest.raises(ValueError):
            Admission.refuse(code, "not a refusal for good")


LIMITS = WireLimits.from_config(TransportConfig(), TINY_SPEC)


def test_a_nack_with_an_unknown_code_does_not_decode():
    body = {"t": int(MsgType.NACK), "v": WIRE_VERSION, "transfer_id": "tx-1", "code": "refused", "reason": "x"}
    with pytest.raises(WireError):
        decode([msgpack.packb(body)], LIMITS)
    body["code"] = "no_pages"
    assert decode([msgpack.packb(body)], LIMITS).msg.code is FailCode.NO_PAGES
