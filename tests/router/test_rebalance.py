"""The live migration policy (pdtb/router/rebalance.py): drain, pressure and fair moves, the rate
limits, and a simulated cluster whose plans are applied step by step under a fake clock.
Expected moves are worked out by hand from the rules in the module docstring."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.router.rebalance import MODES, DecodeView, Move, Rebalancer, ReqView


def req(rid: str, pages: int, tenant: str = "t") -> ReqView:
    return ReqView(rid, tenant, pages)


def node(nid: str, *reqs: ReqView, total: int = 100, free: int | None = None, draining: bool = False,
         waiting: dict | None = None, migrating: int = 0) -> DecodeView:
    """A decode node view; free pages default to what its listed requests leave."""
    free = total - sum(r.pages for r in reqs) if free is None else free
    return DecodeView(nid, total, free, draining, tuple(reqs), dict(waiting or {}), migrating)


# -- construction -------------------------------------------------------------------------------

def test_unknown_mode_raises():
    with pytest.raises(ValueError):
        Rebalancer("greedy")


@pytest.mark.parametrize("kw", [dict(interval_s=-1), dict(settle_s=float("nan")), dict(max_in_flight=0),
                                dict(drain_in_flight=0), dict(drain_in_flight=1.5), dict(gap_frac=1.0),
                                dict(gap_frac=-0.1), dict(headroom_frac=1.5), dict(interval_s=float("inf"))])
def test_nonsensical_numbers_raise(kw):
    with pytest.raises(ValueError):
        Rebalancer("pressure", **kw)


def test_duplicate_node_ids_raise():
    with pytest.raises(ValueError):
        Rebalancer("off").plan([node("a"), node("a")], 0.0)


# -- drain --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_drain_moves_every_fitting_request_in_every_mode(mode):
    a = node("a", req("r1", 30), req("r2", 20), req("r3", 10), draining=True)
    b, c = node("b"), node("c", free=60)
    # Largest first, each to the most free after the moves before it: b 100 -> 70 -> 50, then c (60) wins.
    want = [Move("r1", "a", "b", "drain"), Move("r2", "a", "b", "drain"), Move("r3", "a", "c", "drain")]
    assert Rebalancer(mode).plan([a, b, c], 0.0) == want


def test_drain_respects_drain_in_flight():
    a = node("a", *(req(f"r{i}", 10 + i) for i in range(5)), draining=True, migrating=1)
    moves = Rebalancer("off", drain_in_flight=3).plan([a, node("b", total=1000)], 0.0)
    assert [m.request_id for m in moves] == ["r4", "r3"]  # 1 already in flight + 2 planned = 3


def test_drain_respects_headroom_and_never_targets_a_draining_node():
    a = node("a", req("r1", 31), req("r2", 30), draining=True)
    b = node("b", free=40)  # headroom 10: fits 30 pages at most
    c = node("c", draining=True)  # the most free, but draining
    moves = Rebalancer("off", headroom_frac=0.1).plan([a, b, c], 0.0)
    assert moves == [Move("r2", "a", "b", "drain")]  # r1 fits nowhere: it finishes on a


def test_drain_ignores_interval_settle_and_ping_pong():
    rb = Rebalancer("pressure")
    rb.started(Move("r1", "a", "b", "pressure"), 0.0)
    a, b = node("a"), node("b", req("r1", 20), draining=True)
    assert rb.plan([a, b], 0.5) == [Move("r1", "b", "a", "drain")]


def test_drain_does_not_plan_a_move_already_on_its_way():
    rb = Rebalancer("off", settle_s=10.0)
    rb.started(Move("r1", "a", "b", "drain"), 0.0)
    views = [node("a", req("r1", 20), req("r2", 10), draining=True), node("b")]  # a's snapshot still lists r1
    assert [m.request_id for m in rb.plan(views, 1.0)] == ["r2"]
    assert [m.request_id for m in rb.plan(views, 10.0)] == ["r1", "r2"]  # the start is forgotten: retried


# -- off and pressure ---------------------------------------------------------------------------

def test_off_makes_no_balancing_moves():
    a = node("a", req("w", 80, "big"), free=5, waiting={"small": 3})
    assert Rebalancer("off").plan([a, node("b"), node("c")], 0.0) == []


def fullest_a() -> DecodeView:
    # free 10 of 100; b below has 90 free: half the difference is 40 pages.
    return node("a", req("a1", 50), req("a2", 30), req("a3", 5), free=10)


def test_pressure_moves_the_evening_request_from_fullest_to_emptiest():
    c = node("c", free=50)
    moves = Rebalancer("pressure").plan([fullest_a(), node("b", free=90), c], 0.0)
    assert moves == [Move("a2", "a", "b", "pressure")]  # a1 (50) > 40 would swap the imbalance


def test_pressure_moves_only_beyond_gap_frac():
    a = node("a", req("a1", 10), free=50)
    assert Rebalancer("pressure", gap_frac=0.25).plan([a, node("b", free=74)], 0.0) == []
    assert Rebalancer("pressure", gap_frac=0.25).plan([a, node("b", free=76)], 0.0) == [
        Move("a1", "a", "b", "pressure")]


def test_pressure_compares_fractions_and_keeps_headroom():
    big = node("big", req("x", 20), req("y", 8), total=1000, free=200)  # 0.2 free
    small = node("small", total=40, free=38)  # 0.95 free but 38 pages; headroom ceil(0.05 * 40) = 2
    # half the difference is -81 pages: nothing evens them by moving to small, so nothing moves.
    assert Rebalancer("pressure").plan([big, small], 0.0) == []
    a = node("a", req("x", 34), req("y", 20), free=0)
    b = node("b", free=72)  # half = 36 pages; headroom 50 leaves room for 22: x evens better but does not fit
    assert Rebalancer("pressure", headroom_frac=0.5).plan([a, b], 0.0) == [Move("y", "a", "b", "pressure")]


def test_one_pressure_move_per_call_and_ties_by_id():
    a = node("a", req("a2", 10), req("a1", 10), free=10)
    b = node("b", req("b1", 10), free=10)
    c, d = node("c", free=90), node("d", free=90)
    assert Rebalancer("pressure").plan([d, c, b, a], 0.0) == [Move("a1", "a", "c", "pressure")]


# -- fair ---------------------------------------------------------------------------------------

def victim_a(**kw) -> DecodeView:
    # "small" waits at a; its own request s is the largest but moving it helps no one else.
    return node("a", req("s", 50, "small"), req("w", 40, "big"), req("m", 5, "other"), free=5,
                waiting={"small": 2}, **kw)


def test_fair_moves_the_whale_not_a_waiting_tenants_request():
    moves = Rebalancer("fair").plan([victim_a(), node("b", free=90)], 0.0)
    assert moves == [Move("w", "a", "b", "fair")]


def test_fair_never_targets_another_tenants_waiting_minnows():
    c = node("c", waiting={"small": 1})  # more free than b, but a tenant other than "big" waits there
    moves = Rebalancer("fair").plan([victim_a(), node("b", free=90), c], 0.0)
    assert moves == [Move("w", "a", "b", "fair")]
    d = node("d", waiting={"big": 3})  # the whale's own tenant waiting is no reason to stay away
    assert Rebalancer("fair").plan([victim_a(), node("b", free=90), d], 0.0) == [Move("w", "a", "d", "fair")]


def test_fair_serves_the_most_waited_on_victim_first():
    a = node("a", req("wa", 30, "big"), waiting={"x": 1})
    z = node("z", req("wz", 30, "big"), waiting={"x": 2, "y": 1})
    assert Rebalancer("fair").plan([a, z, node("b")], 0.0) == [Move("wz", "z", "b", "fair")]


def test_fair_falls_back_to_pressure():
    # No one waits: the pressure move.
    assert Rebalancer("fair").plan([fullest_a(), node("b", free=90)], 0.0) == [Move("a2", "a", "b", "pressure")]
    # Someone waits, but every candidate target has other tenants' minnows: the pressure move.
    a = node("a", req("a1", 30, "big"), free=10, waiting={"x": 1})
    b = node("b", free=90, waiting={"y": 1})
    assert Rebalancer("fair").plan([a, b], 0.0) == [Move("a1", "a", "b", "pressure")]


# -- rate limits --------------------------------------------------------------------------------

def test_interval_keeps_recent_nodes_out():
    rb = Rebalancer("pressure", interval_s=2.0)
    rb.started(Move("x", "c", "b", "drain"), 0.0)
    views = [fullest_a(), node("b", free=90)]
    assert rb.plan(views, 1.9) == []
    assert rb.plan(views, 2.0) == [Move("a2", "a", "b", "pressure")]


def test_max_in_flight_keeps_busy_nodes_out():
    views = [fullest_a(), node("b", free=90, migrating=1)]
    assert Rebalancer("pressure", max_in_flight=1).plan(views, 0.0) == []
    assert Rebalancer("pressure", max_in_flight=2).plan(views, 0.0) == [Move("a2", "a", "b", "pressure")]


def test_drain_moves_planned_now_count_toward_max_in_flight():
    c = node("c", req("r", 5), draining=True)
    assert Rebalancer("pressure").plan([fullest_a(), node("b", free=90), c], 0.0) == [Move("r", "c", "b", "drain")]


def test_settled_request_stays():
    rb = Rebalancer("pressure", interval_s=2.0, settle_s=10.0)
    rb.started(Move("a2", "c", "a", "pressure"), 0.0)
    views = [fullest_a(), node("b", free=90)]
    assert rb.plan(views, 5.0) == [Move("a3", "a", "b", "pressure")]
    assert rb.plan(views, 10.0) == [Move("a2", "a", "b", "pressure")]


def test_no_ping_pong():
    rb = Rebalancer("fair", interval_s=2.0, settle_s=10.0)
    rb.started(Move("x", "b", "a", "pressure"), 0.0)
    views = [fullest_a(), node("b", free=90)]
    assert rb.plan(views, 3.0) == []
    assert rb.plan(views, 10.0) == [Move("a2", "a", "b", "pressure")]


def test_old_records_are_forgotten():
    rb = Rebalancer("pressure", interval_s=2.0, settle_s=10.0)
    for i in range(100):
        rb.started(Move(f"r{i}", "a", "b", "pressure"), float(i))
    assert rb.num_records == 10  # starts at 90..99, the others are over settle_s old at t=99
    rb.plan([], 200.0)
    assert rb.num_records == 0


# -- a simulated cluster ------------------------------------------------------------------------

TENANTS = ("a", "b", "c")
HEADROOM = 0.125  # exact in binary: the check below computes the same headroom with no rounding doubt


def make_cluster(rng: random.Random) -> dict:
    """node_id -> {"total", "other" (pages held outside the listed requests), "draining", "reqs"}."""
    cluster, n = {}, 0
    for i in range(rng.randint(2, 5)):
        total = rng.randint(40, 200)
        reqs, used = {}, rng.randint(0, total // 5)
        while rng.random() < 0.8:
            pages = rng.randint(1, 40)
            if used + pages > total:
                break
            reqs[f"r{n}"], used, n = (rng.choice(TENANTS), pages), used + pages, n + 1
        cluster[f"n{i}"] = {"total": total, "other": used - sum(p for _, p in reqs.values()),
                            "draining": rng.random() < 0.25, "reqs": reqs}
    return cluster


def views_of(cluster: dict, rng: random.Random) -> list[DecodeView]:
    out = []
    for nid, c in cluster.items():
        used = c["other"] + sum(p for _, p in c["reqs"].values())
        listed = sorted(c["reqs"].items(), key=lambda kv: -kv[1][1])[:6]  # truncated, as nodes report it
        waiting = {t: rng.choice((0, 0, 1, 3)) for t in TENANTS}
        out.append(DecodeView(nid, c["total"], c["total"] - used, c["draining"],
                              tuple(ReqView(r, t, p) for r, (t, p) in listed), waiting, rng.choice((0, 0, 0, 1))))
    return out


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(MODES), seed=st.integers(0, 2 ** 32 - 1),
       settle_s=st.sampled_from((0.0, 3.0, 10.0)), interval_s=st.sampled_from((0.0, 1.0, 2.0)))
def test_simulated_cluster_keeps_the_invariants(mode, seed, settle_s, interval_s):
    rng = random.Random(seed)
    rb = Rebalancer(mode, settle_s=settle_s, interval_s=interval_s, headroom_frac=HEADROOM, drain_in_flight=2)
    cluster, now = make_cluster(rng), 0.0
    moved_at: dict[str, float] = {}  # request -> last start
    pair_at: dict[tuple[str, str, str], float] = {}  # (source, target, reason) -> last start
    node_at: dict[str, float] = {}  # node -> last start it took part in
    for _ in range(25):
        now += rng.uniform(0.0, 4.0)
        for c in cluster.values():  # some requests finish
            for r in [r for r in c["reqs"] if rng.random() < 0.05]:
                del c["reqs"][r]
        views = views_of(cluster, rng)
        by_id = {v.node_id: v for v in views}
        free = {v.node_id: v.pages_free for v in views}
        moves = rb.plan(views, now)
        assert sum(m.reason != "drain" for m in moves) <= 1
        if mode == "off":
            assert all(m.reason == "drain" for m in moves)
        for src in cluster:
            drained = sum(m.reason == "drain" and m.source == src for m in moves)
            assert drained <= max(0, rb.drain_in_flight - by_id[src].migrating)
        for m in moves:
            tenant, pages = cluster[m.source]["reqs"][m.request_id]
            target = cluster[m.target]
            assert m.source != m.target and not target["draining"]
            assert pages <= free[m.target] - math.ceil(HEADROOM * target["total"])
            assert m.request_id not in moved_at or now - moved_at[m.request_id] >= settle_s
            back = (m.target, m.source, m.reason)
            assert back not in pair_at or now - pair_at[back] >= settle_s
            if m.reason != "drain":
                assert all(n not in node_at or now - node_at[n] >= interval_s for n in (m.source, m.target))
                assert not cluster[m.source]["draining"]
            free[m.source], free[m.target] = free[m.source] + pages, free[m.target] - pages
            rb.started(m, now)
            del cluster[m.source]["reqs"][m.request_id]
            target["reqs"][m.request_id] = (tenant, pages)
            moved_at[m.request_id] = pair_at[(m.source, m.target, m.reason)] = node_at[m.source] = node_at[m.target] = now


def test_fair_moves_the_heaviest_tenants_whale_even_when_its_own_requests_wait_too():
    # a preempted whale of "big" waits at a along with minnows of "small": big's running whale still goes
    a = node("a", req("w1", 40, "big"), req("w2", 30, "big"), req("s", 4, "small"), free=5,
             waiting={"big": 1, "small": 3})
    assert Rebalancer("fair").plan([a, node("b", free=90)], 0.0) == [Move("w1", "a", "b", "fair")]


def test_a_fair_move_may_go_against_a_recent_pressure_move():
    rb = Rebalancer("fair", interval_s=2.0, settle_s=10.0)
    rb.started(Move("x", "b", "a", "pressure"), 0.0)  # pressure sent a request to a...
    # ...where minnows now wait behind a whale: the fair move back to b is no ping-pong
    assert rb.plan([victim_a(), node("b", free=90)], 3.0) == [Move("w", "a", "b", "fair")]
    rb2 = Rebalancer("fair", interval_s=2.0, settle_s=10.0)
    rb2.started(Move("x", "b", "a", "fair"), 0.0)
    assert [m.reason for m in rb2.plan([victim_a(), node("b", free=90)], 3.0)] != ["fair"]  # (pressure may)
