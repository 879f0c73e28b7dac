"""Node-level checks without processes: a request larger than the whole device pool is refused
at once (decode: at the transfer header; colocated: at acceptance), the hand-off metadata seal
survives the wire and catches tampering, and the `--transport-fault` flag."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import pytest

from pdtb.nodes import kv_meta
from pdtb.node_cli import fault_config
from pdtb.nodes.protocol import GenerateRequest, Params
from pdtb.nodes.arrival import validate_prompt
from conftest import make_engine
from decode_node.placement import Inherited, never_fits
from kv_transport import FaultConfig, TransferMeta, TransferState, TransportConfig
from kv_transport.admission import Admission
from kv_transport.fail_codes import FailCode
from kv_transport.fake import FakeNetwork, FakeReceiver, FakeSender
from kv_transport.testing import TINY_SPEC, make_export, make_pool
from pdtb.common import CliError
from pdtb.engine.sequence import SamplingParams, Sequence

from async_case import async_test


def header(prompt_len: int, max_tokens: int) -> Inherited:
    """What a transfer header of a `prompt_len`-token request tells (page size 16)."""
    return Inherited("r", "t", 0, "", -(-prompt_len // 16), prompt_len, prompt_len, 0, max_tokens)


def test_decode_refuses_only_what_can_never_fit_the_pool(llama_dir):
    engine = make_engine(llama_dir, num_pages=8)  # 128 tokens
    assert never_fits(header(100, 28), engine.scheduler) is None  # 128 tokens at its longest: exactly the pool
    assert never_fits(header(100, 29), engine.scheduler) == "needs 9 pages, the decode pool has 8"
    assert never_fits(header(200, 1), engine.scheduler) == "needs 13 pages, the decode pool has 8"
    capped = make_engine(llama_dir, num_pages=8, max_model_len=128)  # a request stops at 128 tokens
    assert never_fits(header(100, 1000), capped.scheduler) is None


def test_colocated_refuses_a_request_larger_than_its_pool(llama_dir):
    engine = make_engine(llama_dir, num_pages=8)
    fits, too_big = (GenerateRequest(f"r{n}", [5] * 100, Params(max_tokens=n)) for n in (28, 29))
    assert validate_prompt(engine, fits) is None
    assert validate_prompt(engine, too_big) == "request needs up to 9 KV pages; the pool has 8"


def test_a_recomputed_request_with_figures_no_router_could_measure_is_refused(llama_dir):
    from pdtb.engine.timeline import Earlier

    engine = make_engine(llama_dir, num_pages=8)
    good, bad = (GenerateRequest("r.r1", [5] * 20, Params(max_tokens=4, first_index=2), earlier=e)
                 for e in (Earlier(3.0, 2, 0.5, 0.9), Earlier(3.0, 2, 0.9, 0.5)))
    assert validate_prompt(engine, good) is None
    assert validate_prompt(engine, bad).startswith("earlier attempts' figures out of order or not finite")


def test_handoff_seal_survives_the_wire_and_catches_tampering():
    seen = []

    def admit(h):
        seen.append(h)
        bad = kv_meta.check(h)
        return Admission.accept() if bad is None else Admission.refuse(FailCode.BAD_METADATA, bad)

    async def go():
        net, cfg = FakeNetwork(), TransportConfig(backend="fake", endpoint="fake://d0")
        rx = FakeReceiver(cfg, make_pool(64), net, admit=admit)
        tx = FakeSender(cfg, TINY_SPEC, net)
        await rx.start()
        await tx.start()
        try:
            sent = []
            for i, pages in enumerate((1, 9)):  # inline and chunked
                export = make_export(make_pool(16, seed=i), f"req-{i}", pages)
                extra = {"router_id": "r-1", "timeline": {"first_token": 1.25e9 / 7},
                         "params": {"max_tokens": 8, "top_p": 0.9, "seed": None}}
                meta = TransferMeta("t", [3, 4, 5], [7], 3, extra)
                meta = kv_meta.seal(meta, f"req-{i}", export.header.num_tokens, export.header.num_pages)
                sent.append(await tx.wait(tx.send(export, meta), 5))
            unsealed = await tx.wait(tx.send(make_export(make_pool(16), "req-x", 1), TransferMeta("t", [3], [7], 1)), 5)
            return sent, unsealed
        finally:
            await tx.close()
            await rx.close()

    sent, unsealed = asyncio.run(asyncio.wait_for(go(), 20))
    assert all(st.state is TransferState.DONE for st in sent), sent
    assert unsealed.state is TransferState.FAILED and unsealed.code is FailCode.BAD_METADATA
    h = seen[0]
    for change in ({"extra": {**h.extra, "router_id": "r-2"}}, {"output_token_ids": [8]}, {"num_computed_tokens": 2},
                   {"extra": {**h.extra, "params": {**h.extra["params"], "max_tokens": 9}}}):
        assert "does not match" in kv_meta.check(dataclasses.replace(h, **change)), change


def test_transport_fault_flag():
    assert fault_config(["drop=0.1", "delay=0.2", "delay_s=0.05", "kinds=header,chunk", "disconnect=3",
                         "seed=4", "max_faults=2"]) == FaultConfig(
        drop_prob=0.1, delay_prob=0.2, delay_s=0.05, kinds=("header", "chunk"), disconnect_after_chunks=3, seed=4,
        max_faults=2)
    assert fault_config([]) == FaultConfig()
    for bad, needle in (("drop", "NAME=VALUE"), ("drop=2", "drop_prob"), ("nope=1", "unknown name"),
                        ("kinds=header,bogus", "unknown kinds"), ("seed=x", "seed=x")):
        with pytest.raises(CliError, match=needle):
            fault_config([bad])


def test_a_parked_arrival_aborted_before_adoption_frees_its_host_pages(llama_dir):
    """A transfer that landed in the host tier (parked) for a request the client had already
    aborted: its host pages must be freed, not only device pages (else each such race leaks
    host pages until a restart: 30 of 256 pages in one run)."""
    import time

    from pdtb.nodes.node_base import NodeConfig
    from decode_node.node import DecodeNode
    from kv_transport.base import ReceivedTransfer, TransferStatus
    from pdtb.engine.config import EngineConfig

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32, host_kv_pages=32)))
    try:
        host = node.engine.host_pool
        for rid, extra in (("gone", {"params": {"max_tokens": 4}}), ("bad", {})):
            pages = host.allocate(rid, 3)
            t = ReceivedTransfer(f"t-{rid}", rid, "a", 40, pages, [5] * 40, [6], 40, extra,
                                 TransferStatus(f"t-{rid}", rid, TransferState.DONE, bytes_total=1), tier="host")
            if rid == "gone":
                node.aborted[rid] = time.monotonic()
                node._adopt(t)
            else:
                node._free_landed(t)  # the bad-metadata path frees the same way
            assert host.pages_of(rid) == [] and host.num_free == host.num_pages
        assert node.engine.pool.num_free == node.engine.pool.num_pages
        host.check()
    finally:
        node.ctx.destroy(linger=0)


@async_test
async def test_a_router_whose_connection_dropped_learns_why_its_requests_ended(llama_dir):
    """Events to a router that is not connected are lost: the node ends that router's requests
    (pages freed) and, if the router was only reconnecting, fails them there on its next
    message with the reason, instead of leaving it to wait out its request timeout (a reset
    connection would hang a stream for the full 20 s timeout)."""
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import Ping
    from decode_node.node import DecodeNode
    from kv_transport.base import ReceivedTransfer, TransferStatus
    from pdtb.engine.config import EngineConfig

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32)))
    try:
        pool = node.engine.pool
        for rid, router in (("a", "r1"), ("b", "r1"), ("c", "r2")):
            pages = pool.allocate(rid, 3)
            extra = {"params": {"max_tokens": 8}, "router_id": router}
            node._adopt(ReceivedTransfer(f"t-{rid}", rid, "t", 40, pages, [5] * 40, [6], 40, extra,
                                         TransferStatus(f"t-{rid}", rid, TransferState.DONE, bytes_total=1)))
        node.sink._pending.clear()  # the adoption events
        node._router_gone("r1")
        assert sorted(node.seqs) == ["c"] and pool.pages_of("a") == pool.pages_of("b") == []
        node._on_message(b"r2", Ping(1, "r2"))  # another router: nothing to tell it
        assert b"r2" not in node.sink._pending
        node._on_message(b"r1", Ping(2, "r1"))  # r1 is back
        events = node.sink._pending[b"r1"].events
        assert sorted(e.request_id for e in events) == ["a", "b"]
        assert all(e.finished and e.finish_reason == "error" and "lost its connection" in e.error for e in events)
        node.sink._pending.clear()
        node._on_message(b"r1", Ping(3, "r1"))  # told once
        assert not node.sink._pending
        await asyncio.sleep(0)  # the Ping replies' tasks
    finally:
        node.ctx.destroy(linger=0)


@async_test
async def test_a_silent_router_s_requests_end_after_its_lease(llama_dir):
    """A router that dies while its requests here send no events (nothing to flush, so no lost
    batch tells) is taken for dead once silent for router_lease_s: its requests end and their
    pages are freed. A router that keeps pinging keeps its requests."""
    import time

    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import Ping
    from decode_node.node import DecodeNode
    from kv_transport.base import ReceivedTransfer, TransferStatus
    from pdtb.engine.config import EngineConfig

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32), router_lease_s=5.0))
    try:
        pool = node.engine.pool
        for rid, router in (("a", "r1"), ("b", "r1"), ("c", "r2")):
            node._on_message(router.encode(), Ping(1, router))
            pages = pool.allocate(rid, 3)
            extra = {"params": {"max_tokens": 8}, "router_id": router}
            node._adopt(ReceivedTransfer(f"t-{rid}", rid, "t", 40, pages, [5] * 40, [6], 40, extra,
                                         TransferStatus(f"t-{rid}", rid, TransferState.DONE, bytes_total=1)))
        t0 = time.monotonic()
        node._heard.update(r1=t0, r2=t0)  # (heard at t0: the checks below are relative to it)
        node._expire_routers(t0 + 4.9)  # within the lease: nothing ends
        assert sorted(node.seqs) == ["a", "b", "c"]
        node._heard["r2"] = t0 + 5.5  # r2 pinged since; r1 did not
        node._expire_routers(t0 + 5.6)
        assert sorted(node.seqs) == ["c"] and pool.pages_of("a") == pool.pages_of("b") == []
        assert len(pool.pages_of("c")) == 3 and sorted(node.routes) == ["c"]
        node._expire_routers(t0 + 6.2)  # told once: r1 has no request left here
        assert sorted(node._lost["r1"][1]) == ["a", "b"]
        await asyncio.sleep(0)  # the Ping replies' tasks
    finally:
        node.ctx.destroy(linger=0)


def test_a_loopback_node_keeps_gloo_on_the_loopback_interface(monkeypatch):
    """gloo listens where the hostname resolves (a LAN address on most machines) unless told;
    a node on the default --host 127.0.0.1 points it at the loopback interface (else, under a
    LAN hostname, the torch transport's listeners bind a LAN address such as 192.0.2.2)."""
    import psutil

    from pdtb.nodes.node_base import keep_gloo_on_loopback

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    keep_gloo_on_loopback("10.0.0.5")  # several hosts: gloo's own choice
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    keep_gloo_on_loopback("127.0.0.1")
    name = os.environ["GLOO_SOCKET_IFNAME"]
    assert any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[name])
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    keep_gloo_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


@async_test
async def test_odd_control_messages_do_not_take_the_node_down(llama_dir):
    """A GenerateRequest from a peer whose identity is not UTF-8 (and no router_id) raises in
    the handler; that, like any handler error, drops just that message, not the node. A second
    request with a live request's id is dropped (its events would mix with the first's)."""
    from pdtb.nodes.control import ControlServer
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import encode_message
    from pdtb.colocated.node import ColocatedNode
    from pdtb.engine.config import EngineConfig

    node = ColocatedNode(NodeConfig("colocated", "c0", EngineConfig(llama_dir, num_pages=64)))
    try:
        req = GenerateRequest("x1", [5] * 20, Params(max_tokens=4))
        node.ctrl._dispatch([b"\xff\xfe-peer", encode_message(req)])
        assert "x1" in node.seqs and node.routes["x1"].endswith("-peer")
        node.ctrl._dispatch([b"other", encode_message(GenerateRequest("x1", [6] * 30, Params(max_tokens=9)))])
        assert node.seqs["x1"].num_prompt_tokens == 20 and node.routes["x1"].endswith("-peer")

        def broken(ident, msg):
            raise RuntimeError("a case no check foresaw")

        bad_before = node.ctrl.bad_frames
        node.ctrl.handler = broken
        node.ctrl._dispatch([b"r", encode_message(req)])  # logged and dropped, not raised
        assert node.ctrl.bad_frames == bad_before + 1
    finally:
        node.ctx.destroy(linger=0)


def test_a_prefill_node_needs_pages_for_the_prompt_only(llama_dir):
    """The prefill computes the prompt and samples the first token; the decode side computes
    the rest. It takes a prompt that fits its pool even when prompt + max_tokens does not
    (8 pages: a 100-token prompt with max_tokens 100), and the router asks for no page more
    than the prompt's."""
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.engine.config import EngineConfig
    from prefill_node.node import PrefillNode

    node = PrefillNode(NodeConfig("prefill", "p0", EngineConfig(llama_dir, num_pages=8)))  # 128 tokens
    try:
        for n, max_tokens in ((100, 100), (128, 1), (128, 3000)):
            assert validate_prompt(node.engine, GenerateRequest("r", [5] * n, Params(max_tokens=max_tokens))) is None
        assert "needs up to 9 KV pages" in validate_prompt(node.engine, GenerateRequest("r", [5] * 129, Params(max_tokens=1)))
        seq = Sequence.from_prompt("s", [5] * 100, SamplingParams(max_tokens=100))
        node.engine.scheduler.check_fits(seq)  # raised: needs up to 13 pages, the pool has 8
    finally:
        node.ctx.destroy(linger=0)
    colocated = make_engine(llama_dir, num_pages=8)  # a colocated engine still needs the output's pages
    assert validate_prompt(colocated, GenerateRequest("r", [5] * 100, Params(max_tokens=100))) is not None


@async_test
async def test_a_prefill_node_accounts_for_its_held_hand_offs_and_forgets_them(llama_dir):
    """Pages a prefill node holds for a hand-off are its tenants' pages (in the per-tenant
    figures after the request left the scheduler too), and a released hand-off's meters are
    dropped, not kept forever; an abort is counted as a finished request."""
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import AbortRequest
    from prefill_node.node import PrefillNode
    from pdtb.engine.config import EngineConfig

    node = PrefillNode(NodeConfig("prefill", "p0", EngineConfig(llama_dir, num_pages=64)))
    try:
        for i, tenant in enumerate(("a", "a", "b")):
            req = GenerateRequest(f"h{i}", [5] * 40, Params(max_tokens=8), tenant=tenant,
                                  decode_kv_addr="tcp://127.0.0.1:9")
            node._on_message(b"r1", req)
        while node.engine.has_work():  # as the node's engine loop does
            events = node.engine.step()
            node.acct.on_output(node.engine.last_output, 0.0)
            node.on_step_events(events, 0.0)
        assert sorted(node.handoffs) == ["h0", "h1", "h2"]
        assert node.acct.tenant_stats()["tenant_pages"] == {"a": 6, "b": 3}  # 40 tokens: 3 pages each
        node._release("h0")
        assert "h0" not in node.acct.meter.per_request and "h1" in node.acct.meter.per_request
        node._on_message(b"r1", AbortRequest("h1", "client disconnected"))
        text = node.metrics.render().decode()
        assert 'reason="abort"' in text and node.acct.tenant_stats()["tenant_pages"] == {"b": 3}
    finally:
        node.ctx.destroy(linger=0)


def test_decode_admission_refuses_sealed_metadata_that_does_not_validate(llama_dir):
    """The hand-off metadata is a typed message (protocol.HandoffMeta): a header whose seal
    matches but whose metadata does not validate is refused BAD_METADATA at the header, and a
    valid one is placed; the same header's timeline reaches the adopted request unchanged."""
    from pdtb.nodes.node_base import NodeConfig
    from pdtb.nodes.protocol import HandoffMeta, Target, handoff_meta, to_extra
    from decode_node.node import DecodeNode
    from kv_transport.admission import Verdict
    from pdtb.engine.config import EngineConfig
    from pdtb.engine.timeline import Timeline

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32)))

    def header(extra):
        meta = kv_meta.seal(TransferMeta("t", [5] * 20, [6], 20, extra), "r", 21, 2)
        return SimpleNamespace(request_id="r", tenant="t", prompt_token_ids=meta.prompt_token_ids,
                               output_token_ids=meta.output_token_ids, num_computed_tokens=20, num_tokens=21,
                               num_pages=2, extra=meta.extra, skip_pages=0, page_hashes=[])

    try:
        good = to_extra(HandoffMeta("r-1", Params(max_tokens=4), 1, Timeline(first_token=12.5), 0,
                                    [Target("d1", "tcp://x")]))
        assert handoff_meta(good).timeline == Timeline(first_token=12.5)
        assert node._admit(header(good)).verdict is Verdict.ACCEPT
        for bad in ({**good, "params": {"max_tokens": "4"}}, {**good, "timeline": {"first_token": "soon"}},
                    {k: v for k, v in good.items() if k != "router_id"}, {**good, "fallbacks": [{"node_id": "d1"}]}):
            got = node._admit(header(bad))
            assert got.verdict is Verdict.REFUSE and got.code is FailCode.BAD_METADATA, (bad, got)
    finally:
        node.ctx.destroy(linger=0)
