"""memfair's quota owners (`--quota-by`: tenant, priority, request, slo-tier) and share modes
(`--quota-shares`: dynamic, static), driven with a fake clock and no model; and the SLO tier's
path from the HTTP body (or the router's tenant default) to the node's Sequence."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fairness import FairnessConfig, Placement, make_policy
from fairness.interface import Arrival
from fairness.memfair import MemFairPolicy
from fairness.memfair_settings import MemFairSettings
from fairness.owners import owner_name, quota_owner
from pdtb.common import CliError
from pdtb.engine.sequence import SeqStatus
from pdtb.nodes.protocol import (GenerateRequest, HandoffMeta, Params, ProtocolError, decode_message, encode_message,
                                 handoff_meta, to_extra)
from sched_sim import FakeClock, apply_step, check_conservation, make_request, make_scheduler, sim_step


# ---- owners -------------------------------------------------------------------------------------
@pytest.mark.parametrize("quota_by, tiered, untiered", [
    ("tenant", "t:alice", "t:bob"),
    ("priority", "p:2", "p:-1"),
    ("request", "r:q1", "r:q2"),
    ("slo-tier", "s:gold", "s:bob"),  # no tier: the tenant is its own tier
])
def test_owner_of_a_sequence_and_of_an_arrival(quota_by, tiered, untiered):
    cfg = FairnessConfig(quota_by=quota_by)
    seqs = (make_request(tenant="alice", priority=2, rid="q1", slo_tier="gold"),
            make_request(tenant="bob", priority=-1, rid="q2"))
    arrivals = (Arrival("q1", "alice", 2, 3, 0.0, 0.0, slo_tier="gold"), Arrival("q2", "bob", -1, 3, 0.0, 0.0))
    for reqs in (seqs, arrivals):
        assert [quota_owner(r, cfg) for r in reqs] == [tiered, untiered]
    assert owner_name(tiered) == tiered[2:]


def test_an_owners_weight_is_the_weights_entry_for_its_name():
    from fairness.quotas import entitlements

    cfg = FairnessConfig(tenant_weights={"a": 3.0, "gold": 2.0, "0": 4.0})
    assert entitlements({"t:a", "t:b"}, cfg, 80) == {"t:a": 60.0, "t:b": 20.0}
    assert entitlements({"s:gold", "s:b"}, cfg, 90) == {"s:gold": 60.0, "s:b": 30.0}
    assert entitlements({"p:0", "p:1"}, cfg, 50) == {"p:0": 40.0, "p:1": 10.0}


# ---- granularity --------------------------------------------------------------------------------
def _running(sched, rid, tenant, pages, priority=0):
    """A decoding request of `pages` pages (its prompt computed), running on the device tier."""
    s = make_request(pages * 4 - 1, 40, tenant=tenant, priority=priority, rid=rid)
    s.num_computed_tokens = s.num_tokens
    s.token_ids.append(7)
    sched.pool.allocate(rid, pages)
    sched.add_running(s)
    return s


@pytest.mark.parametrize("quota_by, admitted", [("tenant", True), ("priority", False)])
def test_by_priority_two_tenants_of_one_class_share_one_entitlement(quota_by, admitted):
    """90 pages; tenants a and b in class 0, c in class 1, c waiting within its share. By
    class, a's 30 pages and b's 20 more would take class 0 past its half (45): b is refused
    while c waits. By tenant, b's third (30) holds its 20 pages."""
    pol = make_policy("memfair", FairnessConfig(quota_by=quota_by))
    sched = make_scheduler(pol, num_pages=90, host_pages=90, budget=512)
    _running(sched, "a1", "a", 30)
    sched.add(make_request(8, 4, tenant="c", priority=1, rid="c1"))
    b = make_request(79, 4, tenant="b", rid="b1")
    sched.add(b)
    st = sched.state()
    pol.reclaim(sched.running, [*sched.parked, *sched.waiting], st)
    if quota_by == "priority":
        assert pol.shares == {"p:0": 45.0, "p:1": 45.0} and pol.ent == {"0": 45.0, "1": 45.0}
    else:
        assert pol.shares == {"t:a": 30.0, "t:b": 30.0, "t:c": 30.0}
    assert pol.may_admit(b, 20, st) is admitted


def test_by_request_every_request_gets_an_equal_share():
    """One tenant, three requests on 30 pages: by tenant the tenant owns the pool and a request
    holding 22 pages keeps them; by request each is entitled to 10, and the one within its
    share that cannot fit gets the over-share request's pages back (demoted, not preempted)."""
    for quota_by in ("tenant", "request"):
        pol = make_policy("memfair", FairnessConfig(quota_by=quota_by))
        sched = make_scheduler(pol, num_pages=30, host_pages=60, budget=512)
        big = _running(sched, "big", "a", 22)
        _running(sched, "small", "a", 4)
        waiting = make_request(23, 4, tenant="a", rid="waiting")  # 6 pages: fits its third, not the free 4
        sched.add(waiting)
        out = sched.schedule()
        if quota_by == "request":
            assert pol.shares == {"r:big": 10.0, "r:small": 10.0, "r:waiting": 10.0}
            assert [(m.request_id, m.kind) for m in out.moves] == [("big", "demote")]
            assert waiting.status == SeqStatus.RUNNING
        else:
            assert pol.shares == {"t:a": 30.0} and not out.moves
            assert waiting.status == SeqStatus.WAITING and big.status == SeqStatus.RUNNING
        apply_step(sched, out)
        check_conservation(sched)


# ---- static shares ------------------------------------------------------------------------------
def _a_after_b_left(shares: str, **settings):
    """memfair on 40 pages: tenant b had work at t=0 and left; at t=1 tenant a runs a 16-page
    request and a second one of 10 pages waits (26 pages: more than half the pool). The step
    budget makes neither a long prompt."""
    clock = FakeClock()
    pol = MemFairPolicy(FairnessConfig(), MemFairSettings(quota_shares=shares, **settings))
    sched = make_scheduler(pol, num_pages=40, budget=512, clock=clock)
    sched.add(make_request(8, 4, tenant="b", rid="b"))
    sim_step(sched)
    sched.abort("b")
    clock.t = 1.0
    sched.add(make_request(60, 30, tenant="a", rid="a1"))  # 23 pages at its longest: it outlives the tests
    sim_step(sched)  # the pool was idle: a1 gets in whatever the quotas (work conservation)
    a2 = make_request(39, 20, tenant="a", rid="a2")
    sched.add(a2)
    sim_step(sched)
    return sched, clock, pol, a2


def test_dynamic_shares_lend_an_idle_owners_share():
    sched, _, pol, a2 = _a_after_b_left("dynamic")
    assert a2.status == SeqStatus.RUNNING and pol.shares == {"t:a": 40.0}


def test_static_shares_keep_an_idle_owners_share_within_the_window():
    """b's half stays b's for `static_window_s` after it was last seen: a's second request
    waits (a holds 16 of its 20), then gets in once b is out of the window."""
    sched, clock, pol, a2 = _a_after_b_left("static", static_window_s=5.0, starve_after_s=100.0)
    for k in range(20):
        clock.t = 1.0 + 0.2 * k  # up to 4.8 s: b was seen at 0
        sim_step(sched)
        check_conservation(sched)
        assert a2.status == SeqStatus.WAITING and pol.shares == {"t:a": 20.0, "t:b": 20.0}
    clock.t = 5.5
    sim_step(sched)
    assert a2.status == SeqStatus.RUNNING and pol.shares == {"t:a": 40.0}


def test_static_shares_still_let_a_starving_request_in():
    sched, clock, pol, a2 = _a_after_b_left("static")  # starve_after_s = 2; a2 waits since t = 1
    clock.t = 2.9
    sim_step(sched)
    assert a2.status == SeqStatus.WAITING
    clock.t = 3.0
    sim_step(sched)
    assert a2.status == SeqStatus.RUNNING and "t:b" in pol.shares


@pytest.mark.parametrize("shares, where", [("dynamic", Placement.DEVICE), ("static", Placement.DEFER)])
def test_static_shares_place_no_arrival_beyond_its_share(shares, where):
    """The decode path: a 10-page arrival of a (holding 16 of 40) while b is idle but seen
    (no host tier: held at the prefill side)."""
    sched, clock, pol, _ = _a_after_b_left(shares)
    sched.abort("a2")
    st = sched.state()
    pol.refresh(sched.running, [], st)
    assert pol.place_arrival(Arrival("a3", "a", 0, 10, st.now, st.now, 40, 8), 0, st) == where


def test_static_shares_place_a_held_arrival_that_starves():
    """Without a host tier an arrival refused its share is held at the prefill side; after
    `starve_after_s` of retries it goes to the device whatever its quota."""
    sched, clock, pol, _ = _a_after_b_left("static")
    sched.abort("a2")
    for t, where in ((1.0, Placement.DEFER), (2.0, Placement.DEFER), (3.1, Placement.DEVICE)):
        clock.t = t
        st = sched.state()
        pol.refresh(sched.running, [], st)
        assert pol.place_arrival(Arrival("a3", "a", 0, 10, st.now, st.now, 40, 8), 0, st) == where, t


def test_static_request_shares_last_while_the_request_is_here():
    """A request never comes back: under request quotas a finished one keeps no share."""
    clock = FakeClock()
    pol = MemFairPolicy(FairnessConfig(quota_by="request"), MemFairSettings(quota_shares="static"))
    sched = make_scheduler(pol, num_pages=40, budget=64, clock=clock)
    sched.add(make_request(8, 1, tenant="a", rid="gone"))
    sched.add(make_request(8, 30, tenant="a", rid="stays"))
    sim_step(sched)
    assert set(pol.shares) == {"r:gone", "r:stays"}
    sim_step(sched)
    assert set(pol.shares) == {"r:stays"}


# ---- configuration and flags --------------------------------------------------------------------
@pytest.mark.parametrize("make, kw, needle", [
    (FairnessConfig, {"quota_by": "user"}, "quota_by must be one of request, tenant, priority, slo-tier"),
    (MemFairSettings, {"quota_shares": "fixed"}, "quota_shares must be one of dynamic, static"),
    (MemFairSettings, {"static_window_s": 0.0}, "static_window_s must be > 0"),
    (MemFairSettings, {"static_window_s": -1.0}, "static_window_s must be > 0"),
    (MemFairSettings, {"static_window_s": float("nan")}, "finite"),
])
def test_config_rejects(make, kw, needle):
    with pytest.raises(ValueError, match=needle):
        make(**kw)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_node_flags(role):
    from fairness import resolve
    from fairness.registry import make_settings
    from pdtb.node_cli import fairness_config, parse, policy_args

    def settings(a):
        return make_settings(resolve(a.policy), policy_args(a))

    a = parse(role, ["--policy", "memfair", "--quota-by", "slo-tier", "--quota-shares", "static",
                     "--static-window", "5"])
    cfg, own = fairness_config(a), settings(a)
    assert (cfg.quota_by, own.quota_shares, own.static_window_s) == ("slo-tier", "static", 5.0)
    a = parse(role, ["--policy", "memfair"])
    default, own = fairness_config(a), settings(a)
    assert (default.quota_by, own.quota_shares, own.static_window_s) == ("tenant", "dynamic", 30.0)
    with pytest.raises(CliError, match="static_window_s must be > 0"):
        policy_args(parse(role, ["--policy", "memfair", "--static-window", "0"]))
    with pytest.raises(SystemExit):
        parse(role, ["--quota-by", "user"])
    with pytest.raises(CliError, match="quota_shares must be one of dynamic, static"):  # refused with the settings
        policy_args(parse(role, ["--policy", "memfair", "--quota-shares", "fixed"]))


# ---- the SLO tier from the HTTP body to the Sequence --------------------------------------------
NAME, VOCAB = "tiny", 512


def _parse(body: dict):
    from pdtb.router.openai_api import parse_completion_request

    return parse_completion_request(json.dumps(body).encode(), NAME, VOCAB)


def _submitted(body: dict, tenant_tiers: dict) -> GenerateRequest:
    """The GenerateRequest the router sends for `body`, as the node decodes it off the wire."""
    from pdtb.router.completions import CompletionRun, RouterState
    from pdtb.router.config import NodeSpec, RouterConfig
    from pdtb.router.metrics import RouterMetrics

    sent = []
    handle = SimpleNamespace(entry=SimpleNamespace(node_id="n0"), prefix_overlap_tokens=0)
    registry = SimpleNamespace(submit=lambda greq: sent.append(greq) or handle)
    config = RouterConfig((NodeSpec("colocated", "tcp://127.0.0.1:1"),), tenant_tiers=tenant_tiers)
    run = CompletionRun(RouterState(config, None, registry, RouterMetrics()), _parse(body), [5, 6, 7], 4)
    run.submit()
    return decode_message(encode_message(sent[0]))


@pytest.mark.parametrize("body, tier", [
    ({"prompt": "x", "user": "alice", "slo_tier": "gold"}, "gold"),  # the request's own
    ({"prompt": "x", "user": "alice"}, "silver"),  # its tenant's default
    ({"prompt": "x", "user": "alice", "slo_tier": None}, "silver"),  # null means absent
    ({"prompt": "x", "user": "bob"}, ""),  # none
    ({"prompt": "x", "slo_tier": "a.B-9_z"}, "a.B-9_z"),
])
def test_the_slo_tier_reaches_the_sequence(body, tier):
    from pdtb.nodes.arrival import make_seq

    greq = _submitted(body, {"alice": "silver"})
    assert greq.slo_tier == tier
    seq = make_seq(greq)  # colocated and prefill nodes
    assert seq.slo_tier == tier
    # the hand-off to the decode node carries it
    meta = handoff_meta(to_extra(HandoffMeta("r", greq.params, greq.priority, slo_tier=greq.slo_tier)))
    assert meta.slo_tier == tier
    owner = quota_owner(seq, FairnessConfig(quota_by="slo-tier"))
    assert owner == "s:" + (tier or seq.tenant)


@pytest.mark.parametrize("tier", ["", "x" * 33, "has space", "gold!", "ü", 5, True, ["gold"], {"t": 1}])
def test_a_bad_slo_tier_is_a_400(tier):
    from pdtb.router.openai_api import ApiError

    with pytest.raises(ApiError) as info:
        _parse({"prompt": "x", "slo_tier": tier})
    err = info.value
    assert err.status == 400 and err.param == "slo_tier" and "slo_tier" in err.message


def test_the_router_flag_and_the_wire_check_tiers():
    from pdtb.router.config import NodeSpec, RouterConfig
    from pdtb.router.main import parse_args, tenant_tiers

    a = parse_args(["--node", "colocated=tcp://h:1", "--tenant-tier", "alice=gold", "--tenant-tier", "bob=b.2"])
    assert tenant_tiers(a.tenant_tier) == {"alice": "gold", "bob": "b.2"}
    for bad in ("alice", "=gold"):
        with pytest.raises(ValueError, match="TENANT=TIER"):
            tenant_tiers([bad])
    nodes = (NodeSpec("colocated", "tcp://h:1"),)
    for tiers in ({"alice": ""}, {"alice": "no spaces"}, {"alice": "x" * 33}):
        with pytest.raises(ValueError, match="tier must be 1-32 characters"):
            RouterConfig(nodes, tenant_tiers=tiers)
    bad = {"type": "GenerateRequest", "v": 1, "request_id": "r", "prompt_token_ids": [5],
           "params": {"max_tokens": 4}, "slo_tier": "no spaces"}
    import msgpack

    with pytest.raises(ProtocolError, match="slo_tier") as info:
        decode_message(msgpack.packb(bad))
    assert info.value.field == "slo_tier"
    with pytest.raises(ProtocolError, match="slo_tier"):
        handoff_meta({"router_id": "r", "params": {"max_tokens": 4}, "slo_tier": 7})
    assert handoff_meta({"router_id": "r", "params": {"max_tokens": 4}}).slo_tier == ""  # an older sender


def test_a_decode_node_places_and_adopts_by_tier(llama_dir):
    """The decode node's header admission gives the policy the tier (its Arrival), the adopted
    Sequence has it, and /cluster's extra counts device pages per quota owner."""
    from decode_node.node import DecodeNode
    from kv_transport.admission import Verdict
    from kv_transport.base import ReceivedTransfer, TransferState, TransferStatus
    from pdtb.engine.config import EngineConfig
    from pdtb.nodes import kv_meta
    from pdtb.nodes.node_base import NodeConfig
    from kv_transport import TransferMeta

    node = DecodeNode(NodeConfig("decode", "d0", EngineConfig(llama_dir, num_pages=32), policy="memfair",
                                 fairness=FairnessConfig(quota_by="slo-tier")))
    try:
        extra = to_extra(HandoffMeta("r-1", Params(max_tokens=4), slo_tier="gold"))
        meta = kv_meta.seal(TransferMeta("t", [5] * 20, [6], 20, extra), "r", 21, 2)
        header = SimpleNamespace(request_id="r", tenant="t", prompt_token_ids=meta.prompt_token_ids,
                                 output_token_ids=meta.output_token_ids, num_computed_tokens=20, num_tokens=21,
                                 num_pages=2, extra=meta.extra, skip_pages=0, page_hashes=[])
        assert node._admit(header).verdict is Verdict.ACCEPT
        assert node.policy.incoming["r"].slo_tier == "gold"
        pages = node.engine.pool.allocate("r", 2)
        node._adopt(ReceivedTransfer("t-r", "r", "t", 21, pages, [5] * 20, [6], 20, meta.extra,
                                     TransferStatus("t-r", "r", TransferState.DONE, bytes_total=1)))
        assert node.seqs["r"].slo_tier == "gold"
        stats = node.acct.tenant_stats()
        assert stats["owner_pages"] == {"s:gold": 2} and stats["tenant_pages"] == {"t": 2}
    finally:
        node.ctx.destroy(linger=0)
