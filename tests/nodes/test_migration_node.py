"""Live migration of a decoding request between two decode nodes, both ends of the protocol at
once (decode_node/migration.py, decode_node/node.py): two real DecodeNodes in one process over the
ZeroMQ KV transport on loopback, driven tick by tick (poll_io, then one engine step, per node),
with a tap standing in for the router's end of their event sinks.

Every scenario ends with the same checks: the request is held by exactly one node when its
migration is over (or it was aborted, and no node holds it); both pools check after every tick;
once it finished, every page of both pools is free and nothing is staged, reserved or migrating;
and the token stream a router assembles (the source's events up to the switch point the target's
notice names, then the target's) equals the request decoded on one node without migration,
which in turn equals transformers' greedy decoding.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import pytest

from conftest import hf_greedy, make_engine, make_prompts
from decode_node.migration import stage_owner
from decode_node.node import DecodeNode
from kv_transport import ReceivedTransfer, TransferState
from kv_transport.base import TransferStatus
from pdtb.engine.config import EngineConfig
from pdtb.engine.kv_export import KVExport, export_request, import_request
from pdtb.nodes.arrival import to_sampling
from pdtb.nodes.node_base import NodeConfig
from pdtb.nodes.protocol import (HandoffMeta, HandoffNotice, Migrate, MigrationReport, Params, Target,
                                 TokenEvent, to_extra)

from async_case import async_test

ROUTER = "router-0"  # the router identity every planted request reports to
MAX_TOKENS = 32  # output tokens per request: it outlasts a 1 s phase timeout at one step per slow tick (21)
LONG_PROMPT = 40  # two full pages of 16 and a partial one: enough for a precopy
SHORT_PROMPT = 12  # under one page: too short for a precopy
QUICK_TIMEOUT_S = 1.0  # the source's phase timeout where a scenario waits one out
LEASE_TIMEOUT_S = 0.25  # the target's migration timeout there: its stages are leased for twice this
CALM_TIMEOUT_S = 30.0  # where no phase should time out: a slow machine must not turn success into failure
FAST_S = 0.002  # pause after a tick: lets the transport's tasks run
SLOW_S = 0.05  # pause after a tick while a timeout or lease runs out: N ticks last at least N * SLOW_S
CLOSE_TIMEOUT_S = 0.25  # the KV transport's close: flushing what is queued, stopping its tasks
MAX_TICKS = 400  # bound on every wait; at SLOW_S that is over 20 s, ten stage leases


# ---- factories ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prefilled:
    """A request prefilled once on a separate engine: what a prefill node would hand off."""

    prompt: list[int]
    params: Params
    first_token: int  # sampled by the prefill
    export: KVExport  # its pages (the prompt's KV)


def prefill(model_dir: str, prompt: list[int], params: Params) -> Prefilled:
    engine = make_engine(model_dir, num_pages=16)
    seq = engine.make_sequence(prompt, to_sampling(params))
    engine.add(seq)
    for _ in range(4):  # (a short prompt prefills in one step)
        if seq.num_output_tokens:
            break
        engine.step()
    assert seq.num_output_tokens == 1 and seq.num_computed_tokens == len(prompt)
    return Prefilled(prompt, params, seq.output_token_ids[0],
                     export_request(engine.pool, seq.request_id, seq.num_computed_tokens))


def make_node(model_dir: str, node_id: str, timeout_s: float, num_pages: int = 64) -> DecodeNode:
    cfg = NodeConfig("decode", node_id, EngineConfig(model_dir, num_pages=num_pages), migration_timeout_s=timeout_s)
    # closing, a sender waits this long to tell a receiver what it cancelled: a dead one never
    # answers, and loopback needs far less than the default
    transport = cfg.transport_config(endpoint=f"tcp://{cfg.host}:0", close_timeout_s=CLOSE_TIMEOUT_S)
    return DecodeNode(cfg, transport=transport)


def plant(node: DecodeNode, rid: str, req: Prefilled) -> None:
    """Land `req` on `node` as a finished hand-off from a prefill node, through the node's own
    adoption path (its pages imported, as the KV receiver would have committed them)."""
    pages = import_request(node.engine.pool, req.export, owner=rid)
    assert pages is not None
    n = len(req.prompt)
    status = TransferStatus(f"t-{rid}", rid, TransferState.DONE, bytes_total=req.export.header.payload_bytes)
    node._adopt(ReceivedTransfer(f"t-{rid}", rid, "tenant-a", n, pages, list(req.prompt), [req.first_token], n,
                                 to_extra(HandoffMeta(ROUTER, req.params)), status))


def migrate_msg(rid: str, mid: str, target: DecodeNode, **kw) -> Migrate:
    """A Migrate as the router sends it: the target's KV address and page-hash namespace."""
    kw.setdefault("target_prefix_ns", target.engine.scheduler.prefix_ns or "")
    return Migrate(rid, mid, Target(target.config.node_id, target.kv_addr), **kw)


# ---- the router's end --------------------------------------------------------------------------
@dataclass
class Tap:
    """Every token event, hand-off notice and migration report the nodes queued for the router,
    in the order they were queued: (node id, message)."""

    log: list = field(default_factory=list)

    def attach(self, node: DecodeNode) -> None:
        node.sink = _Sink(self, node.config.node_id)

    def of(self, kind: type, node_id: str | None = None) -> list:
        return [m for n, m in self.log if isinstance(m, kind) and node_id in (None, n)]

    def report(self, node_id: str, mid: str) -> MigrationReport | None:
        """The report of migration `mid` from `node_id` (the source's outcome, or the
        target's downtime): at most one each."""
        found = [r for r in self.of(MigrationReport, node_id) if r.migration_id == mid]
        assert len(found) <= 1, found
        return found[0] if found else None

    def finished(self, rid: str) -> list[tuple[str, TokenEvent]]:
        return [(n, m) for n, m in self.log if isinstance(m, TokenEvent) and m.request_id == rid and m.finished]

    def stream(self, rid: str, first_token: int, source: str) -> list[int]:
        """The request's output as a router assembles it: the prefill's first token, then the
        holder's events; a notice of a migration switches the holder at the output token count
        it names (the old holder's events must have brought exactly that many)."""
        holder, out = source, [first_token]
        for node_id, m in self.log:
            if isinstance(m, HandoffNotice) and m.request_id == rid and m.migration_id:
                assert len(out) == m.output_tokens, f"switch to {node_id} at {m.output_tokens}, router has {len(out)}"
                holder = node_id
            elif isinstance(m, TokenEvent) and m.request_id == rid:
                assert m.error is None, m.error
                assert node_id == holder or not m.token_ids, f"{node_id} streamed {rid} while {holder} held it"
                out += m.token_ids if node_id == holder else []
        return out


@dataclass
class _Sink:
    """A node's event sink, recording into the tap (the control socket is never started)."""

    tap: Tap
    node_id: str

    def add(self, router_id: str, event: TokenEvent) -> None:
        assert router_id == ROUTER
        self.tap.log.append((self.node_id, event))

    def notice(self, router_id: str, notice: HandoffNotice) -> None:
        self.add(router_id, notice)

    def migration(self, router_id: str, report: MigrationReport) -> None:
        self.add(router_id, report)

    async def flush(self) -> None:
        pass


# ---- driving -----------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def started_nodes(model_dir: str, *timeouts_s: float, ids=("A", "B")):
    """Decode nodes (migration timeouts in order, the last one for the rest) with their KV
    receivers started and a tap on their sinks; every one closed on the way out, whatever
    happened (a zmq context left open hangs the interpreter at exit)."""
    nodes, tap = [], Tap()
    try:
        for i, node_id in enumerate(ids):
            nodes.append(make_node(model_dir, node_id, timeouts_s[min(i, len(timeouts_s) - 1)]))
            tap.attach(nodes[-1])
            await nodes[-1].start_extra()
        yield (*nodes, tap)
    finally:
        for node in nodes:
            try:
                await node.close_extra()
            finally:
                node.ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def migrating(llama_dir: str, req: Prefilled, *timeouts_s: float, steps: int = 3, **migrate_kw):
    """The shape the scenarios here share: nodes A and B started, `req` planted at A as r1 and
    stepped `steps` times, then A told to move r1 to B (migrate_kw: inject, target_prefix_ns)."""
    async with started_nodes(llama_dir, *timeouts_s) as (a, b, tap):
        plant(a, "r1", req)
        await ticks([a, b], steps)
        a.on_migrate(migrate_msg("r1", "m1", b, **migrate_kw), ROUTER)
        yield a, b, tap


async def tick(nodes, pause_s: float = FAST_S) -> None:
    """What each node's engine loop does once: transfers in and out, one engine step and its
    events. Both pools must add up after every tick, not only at the end."""
    for node in nodes:
        await node.poll_io()
        if node.engine.has_work():
            events = node.engine.step()
            node.acct.on_output(node.engine.last_output, time.time())
            node.on_step_events(events, time.time())
        node.engine.pool.check()
    await asyncio.sleep(pause_s)


async def run_until(nodes, done, what: str, pause_s: float = FAST_S, max_ticks: int = MAX_TICKS) -> None:
    for _ in range(max_ticks):
        if done():
            return
        await tick(nodes, pause_s)
    held = {n.config.node_id: (n.engine.pool.held_counts(), list(n.seqs), list(n.migrations.staged)) for n in nodes}
    pytest.fail(f"{what}: not after {max_ticks} ticks; pages held, requests, stages: {held}")


async def ticks(nodes, n: int) -> None:
    for _ in range(n):
        await tick(nodes)


def held_by(nodes, rid: str) -> list[str]:
    return [n.config.node_id for n in nodes if rid in n.seqs]


def quiet(nodes) -> bool:
    """Nothing of any request is left on the nodes: no request, stage, transfer landing or
    migration, and every page free (a transfer that landed but is not adopted yet holds pages,
    and nothing else shows it)."""
    return all(not n.seqs and not n.migrations.out and not n.migrations.staged and not n.migrations.arrived
               and not n.receiver.num_reserved_pages and n.engine.pool.num_free == n.engine.pool.num_pages
               for n in nodes)


async def finish(nodes, tap: Tap, rid: str) -> None:
    """Tick until the request finished on one node, then until every stage is gone (a lease
    runs out in time, not in steps: slow ticks), then check that nothing is left anywhere."""
    await run_until(nodes, lambda: tap.finished(rid), f"{rid} finished")
    await run_until(nodes, lambda: quiet(nodes), "the nodes quiet", SLOW_S)
    assert len(tap.finished(rid)) == 1, tap.finished(rid)
    assert_empty(nodes)


def assert_empty(nodes) -> None:
    for node in nodes:
        pool = node.engine.pool
        pool.check()
        assert pool.num_free == pool.num_pages, (node.config.node_id, pool.held_counts())
        assert quiet([node]) and node.idle(), node.config.node_id


def outbound(node: DecodeNode, rid: str):
    return node.migrations.out.get(rid)


def paused(node: DecodeNode, rid: str) -> bool:
    o = outbound(node, rid)
    return o is not None and o.phase == "final"


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def handoffs(llama_dir) -> dict[str, Prefilled]:
    long_prompt, short_prompt = make_prompts([LONG_PROMPT, SHORT_PROMPT], seed=11)
    greedy = Params(MAX_TOKENS, ignore_eos=True)
    return {"long": prefill(llama_dir, long_prompt, greedy),
            "short": prefill(llama_dir, short_prompt, greedy),
            "sampled": prefill(llama_dir, long_prompt, Params(MAX_TOKENS, temperature=0.9, seed=7, ignore_eos=True))}


@pytest.fixture(scope="module")
def unmigrated(llama_dir, handoffs) -> dict[str, list[int]]:
    """Each request's output decoded on one node, never migrated: what every migration must give."""
    async def alone(req: Prefilled) -> list[int]:
        async with started_nodes(llama_dir, CALM_TIMEOUT_S, ids=("solo",)) as (node, tap):
            plant(node, "r", req)
            await finish([node], tap, "r")
            return tap.stream("r", req.first_token, "solo")

    return {name: asyncio.run(alone(req)) for name, req in handoffs.items()}


def test_unmigrated_decoding_matches_transformers(llama_dir, handoffs, unmigrated):
    from pdtb.engine.loader import load_model

    model = load_model(llama_dir, attn_implementation="sdpa")[0]
    for name in ("long", "short"):
        req = handoffs[name]
        assert len(unmigrated[name]) == MAX_TOKENS
        assert unmigrated[name] == hf_greedy(model, req.prompt, MAX_TOKENS, ignore_eos=True), name
    # sampling is on: the seeded request is not the greedy one (its check below is not vacuous)
    assert len(unmigrated["sampled"]) == MAX_TOKENS and unmigrated["sampled"] != unmigrated["long"]


# ---- outcomes ----------------------------------------------------------------------------------
async def moved(src: DecodeNode, dst: DecodeNode, tap: Tap, rid: str, mid: str) -> MigrationReport:
    """Wait for the source's report of migration `mid` (already started) and check that it
    moved the request: the source's report."""
    s, d = src.config.node_id, dst.config.node_id
    await run_until([src, dst], lambda: tap.report(s, mid), f"{s}'s report of {mid}")
    rep = tap.report(s, mid)
    assert rep.ok and rep.phase == "final" and not rep.reason, rep
    # the source let go once the target confirmed: the target alone holds it, the source no page
    assert held_by([src, dst], rid) == [d] and src.engine.pool.num_held(rid) == 0
    assert rid not in src.routes and not src.migrations.out
    # the target named the switch point: the output tokens the request had when the source paused it
    notices = [n for n in tap.of(HandoffNotice, d) if n.migration_id == mid]
    assert notices == [HandoffNotice(rid, d, True, mid, rep.output_tokens)]
    return rep


def assert_arrival(tap: Tap, rep: MigrationReport) -> None:
    """The target's report, sent at its first token of the request: the pause it saw."""
    got = tap.report(rep.target, rep.migration_id)
    assert got is not None and got.ok and got.phase == "resumed" and got.downtime_s > 0, got
    at = tap.log.index((rep.target, got))
    notice = next(i for i, (n, m) in enumerate(tap.log) if n == rep.target and isinstance(m, HandoffNotice)
                  and m.migration_id == rep.migration_id)
    tokens = [i for i, (n, m) in enumerate(tap.log) if n == rep.target and isinstance(m, TokenEvent)
              and m.request_id == rep.request_id and m.token_ids and i > notice]
    assert tokens and notice < at < tokens[0], "the report comes with the target's first token after adopting it"
    assert (got.source, got.target, got.request_id) == (rep.source, rep.target, rep.request_id)
    assert (got.precopy_bytes, got.final_bytes) == (rep.precopy_bytes, rep.final_bytes)


async def kept(src: DecodeNode, dst: DecodeNode, tap: Tap, rid: str, mid: str, phase: str,
               pause_s: float = FAST_S) -> MigrationReport:
    """Wait for the source's report of a migration that fails, and check that the request goes
    on at the source, decoding, and nowhere else."""
    s = src.config.node_id
    await run_until([src, dst], lambda: tap.report(s, mid), f"{s}'s report of {mid}", pause_s)
    rep = tap.report(s, mid)
    assert not rep.ok and rep.phase == phase and rep.reason, rep
    assert held_by([src, dst], rid) == [s] and src.seqs[rid] in src.engine.scheduler.running
    assert not src.migrations.out and not [n for n in tap.of(HandoffNotice, dst.config.node_id) if n.migration_id]
    return rep


# ---- scenarios ---------------------------------------------------------------------------------
@async_test
async def test_precopy_then_final_moves_the_request(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, CALM_TIMEOUT_S) as (a, b, tap):
        assert not a.idle()  # a migration out is work: a draining node waits for it
        o = outbound(a, "r1")
        assert o.phase == "precopy" and o.skip_pages == 2  # 43 tokens computed: 2 full pages to stage
        rep = await moved(a, b, tap, "r1", "m1")
        bpp = a.engine.pool.bytes_per_page
        assert rep.pages == -(-(LONG_PROMPT + rep.output_tokens - 1) // 16)  # what its computed tokens fill
        assert (rep.precopy_bytes, rep.final_bytes) == (2 * bpp, (rep.pages - 2) * bpp)
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.finished("r1")[0][0] == "B"
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_request_under_two_full_pages_moves_in_one_final_transfer(llama_dir, handoffs, unmigrated):
    req = handoffs["short"]

    async with migrating(llama_dir, req, CALM_TIMEOUT_S, steps=2) as (a, b, tap):
        assert paused(a, "r1") and outbound(a, "r1").skip_pages == 0  # nothing to stage: it pauses at once
        rep = await moved(a, b, tap, "r1", "m1")
        assert rep.precopy_bytes == 0 and rep.final_bytes == rep.pages * a.engine.pool.bytes_per_page
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["short"]


@async_test
async def test_a_target_of_another_page_hash_namespace_gets_one_stop_and_copy_transfer(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with started_nodes(llama_dir, CALM_TIMEOUT_S) as (a, b, tap):
        plant(a, "r1", req)
        await ticks([a, b], 3)
        # staged pages are found by hash at the target: under another namespace none would be
        a.on_migrate(migrate_msg("r1", "m1", b, target_prefix_ns="another-model-ns"), ROUTER)
        assert paused(a, "r1") and outbound(a, "r1").skip_pages == 0
        rep = await moved(a, b, tap, "r1", "m1")
        assert rep.precopy_bytes == 0 and rep.final_bytes == rep.pages * a.engine.pool.bytes_per_page
        assert not b.migrations.staged
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_lost_precopy_times_out_and_the_request_decodes_on_at_the_source(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, LEASE_TIMEOUT_S, inject="lose_precopy") as (a, b, tap):
        rep = await kept(a, b, tap, "r1", "m1", "precopy", pause_s=SLOW_S)
        assert "precopy not done after" in rep.reason
        assert b.engine.pool.num_free == b.engine.pool.num_pages and not b.migrations.staged  # nothing came
        await finish([a, b], tap, "r1")
        assert tap.finished("r1")[0][0] == "A"
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_lost_final_resumes_the_request_at_the_source_and_the_stage_expires(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, LEASE_TIMEOUT_S, inject="lose_final") as (a, b, tap):
        await run_until([a, b], lambda: stage_owner("r1") in b.migrations.staged, "staged at the target")
        await run_until([a, b], lambda: paused(a, "r1"), "paused for the final")
        assert a.seqs["r1"] not in a.engine.scheduler.running
        logged = len(tap.log)
        rep = await kept(a, b, tap, "r1", "m1", "resumed", pause_s=SLOW_S)
        assert "final not done after" in rep.reason
        # paused: no step ran it until it resumed (the report comes as it resumes)
        assert not [m for m in tap.log[logged:tap.log.index(("A", rep))] if isinstance(m[1], TokenEvent)]
        await finish([a, b], tap, "r1")  # (waits out the stage's lease at B)
        assert tap.finished("r1")[0][0] == "A"
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_refused_final_resumes_the_request_at_the_source(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, 30.0, inject="refuse_final") as (a, b, tap):
        rep = await kept(a, b, tap, "r1", "m1", "resumed")
        assert "fault injected" in rep.reason  # the target's refusal, not a timeout
        # the stage the refused final would have shared lets go at once, not at its lease's end (60 s)
        assert stage_owner("r1") not in b.migrations.staged and not b.engine.pool.num_held(stage_owner("r1"))
        await finish([a, b], tap, "r1")
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_target_gone_mid_final_resumes_the_request_at_the_source(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, LEASE_TIMEOUT_S) as (a, b, tap):
        await run_until([a, b], lambda: stage_owner("r1") in b.migrations.staged, "staged at the target")
        await run_until([a, b], lambda: paused(a, "r1"), "paused for the final")
        assert outbound(a, "r1").to_send  # the final is not sent yet: it goes to a dead endpoint
        await b.receiver.close()
        await kept(a, b, tap, "r1", "m1", "resumed", pause_s=SLOW_S)
        await finish([a, b], tap, "r1")  # (waits out the stage's lease at B)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_stage_taken_back_before_the_final_is_resent_in_full(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, CALM_TIMEOUT_S) as (a, b, tap):
        await run_until([a, b], lambda: b.migrations.staged, "staged at the target")
        # the source sends the final only at a poll after the tick the stage landed in
        o = outbound(a, "r1")
        assert o.phase == "precopy" or o.to_send
        b.migrations.claim("r1")  # the stage lets go ...
        assert b.engine.pool.drop_cache() == 2  # ... and its cached pages are taken for other use
        rep = await moved(a, b, tap, "r1", "m1")
        bpp = a.engine.pool.bytes_per_page
        assert rep.precopy_bytes == 2 * bpp and rep.final_bytes == rep.pages * bpp  # every page, again
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@pytest.mark.parametrize("when", ["precopy", "paused", "final_sent"])
@async_test
async def test_a_client_abort_during_a_migration_leaves_nothing_anywhere(llama_dir, handoffs, when):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, LEASE_TIMEOUT_S) as (a, b, tap):
        if when == "precopy":
            await tick([a, b])
            o = outbound(a, "r1")
            assert o.phase == "precopy" and o.transfer_id  # the precopy is on its way
        else:
            sent = when == "final_sent"
            await run_until([a, b], lambda: paused(a, "r1") and bool(outbound(a, "r1").transfer_id) == sent,
                            f"paused, the final {'sent' if sent else 'not sent yet'}")
        logged = len(tap.log)
        a.on_abort("r1", "client gone")
        if when == "final_sent":  # it may have landed: the router aborts both ends of a move under way
            b.on_abort("r1", "client gone")
        rep = tap.report("A", "m1")
        assert rep is not None and not rep.ok, rep
        assert rep.reason == "the request ended during its migration: client gone"
        assert rep.phase == ("precopy" if when == "precopy" else "final")
        assert held_by([a, b], "r1") == [] and a.engine.pool.num_free == a.engine.pool.num_pages
        await run_until([a, b], lambda: quiet([a, b]), "the nodes quiet", SLOW_S)
        assert_empty([a, b])
        assert tap.log[logged:] == [("A", rep)]  # no token, notice or report after the abort's


@async_test
async def test_a_stale_abort_at_the_target_does_not_drop_a_migration(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with started_nodes(llama_dir, CALM_TIMEOUT_S) as (a, b, tap):
        plant(a, "r1", req)
        await ticks([a, b], 3)
        b.aborted["r1"] = time.monotonic()  # B was once told to drop a copy of it
        a.on_migrate(migrate_msg("r1", "m1", b), ROUTER)
        rep = await moved(a, b, tap, "r1", "m1")
        assert rep.precopy_bytes > 0 and "r1" not in b.aborted  # the precopy's admission forgot it
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_there_and_back_again(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, CALM_TIMEOUT_S) as (a, b, tap):
        there = await moved(a, b, tap, "r1", "m1")
        await run_until([a, b], lambda: tap.report("B", "m1"), "B's first token")
        b.on_migrate(migrate_msg("r1", "m2", a), ROUTER)
        back = await moved(b, a, tap, "r1", "m2")
        assert back.precopy_bytes > 0 and back.output_tokens > there.output_tokens
        await finish([a, b], tap, "r1")
        assert_arrival(tap, there)
        assert_arrival(tap, back)
        assert tap.finished("r1")[0][0] == "A"
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_seeded_sampling_request_samples_the_same_tokens_after_a_migration(llama_dir, handoffs, unmigrated):
    req = handoffs["sampled"]

    async with migrating(llama_dir, req, CALM_TIMEOUT_S) as (a, b, tap):
        rep = await moved(a, b, tap, "r1", "m1")
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["sampled"]


@async_test
async def test_a_second_migrate_and_one_for_an_unknown_request_are_refused(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with started_nodes(llama_dir, CALM_TIMEOUT_S) as (a, b, tap):
        plant(a, "r1", req)
        await ticks([a, b], 3)
        a.on_migrate(migrate_msg("r1", "m0", a), ROUTER)
        a.on_migrate(migrate_msg("r1", "m1", b), ROUTER)
        a.on_migrate(migrate_msg("r1", "m2", b), ROUTER)
        a.on_migrate(migrate_msg("nobody", "m3", b), ROUTER)
        for mid, why in (("m0", "the target is this node, or has no KV address"),
                         ("m2", "a migration of the request is under way"),
                         ("m3", "the request is not on this node")):
            rep = tap.report("A", mid)
            assert rep is not None and not rep.ok and rep.reason == why, rep
        assert outbound(a, "r1").msg.migration_id == "m1"  # the first one goes on
        rep = await moved(a, b, tap, "r1", "m1")
        await finish([a, b], tap, "r1")
        assert_arrival(tap, rep)
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]


@async_test
async def test_a_target_shut_down_with_a_stage_landed_reports_no_request_for_it(llama_dir, handoffs, unmigrated):
    req = handoffs["long"]

    async with migrating(llama_dir, req, QUICK_TIMEOUT_S, LEASE_TIMEOUT_S) as (a, b, tap):
        # B's loop stops polling (it is shutting down) while the precopy lands: A pauses once
        # B committed it, and B closes with the stage landed but never adopted
        await run_until([a], lambda: paused(a, "r1"), "paused for the final")
        await b.close_extra()
        assert b.engine.pool.num_free == b.engine.pool.num_pages  # its pages are freed all the same
        await kept(a, b, tap, "r1", "m1", "resumed", pause_s=SLOW_S)
        await run_until([a], lambda: tap.finished("r1"), "r1 finished")
        assert_empty([a])
        assert tap.stream("r1", req.first_token, "A") == unmigrated["long"]
        # a stage is not a request: nothing may end in its name
        assert tap.of(TokenEvent, "B") == []
