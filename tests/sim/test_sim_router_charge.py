"""The routers' charge (pdtb/sim/routers.py): dispatch and token times worked by hand, a saturated
router, two routers sharing the work, zero costs giving the uncharged run's figures exactly,
runs of decode steps served as one event per step, the calibration's router section and the
plan's router count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdtb.figures.records import RequestSpec
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import FixedStepCost
from pdtb.sim.flags import page_spec, router_cost
from pdtb.sim.node import NodeShape
from pdtb.sim.roofline import RooflineCost
from pdtb.sim.routers import RouterCost, Routers, Waits, pick, router_figures, routers_needed
from pdtb.sim.run import build_parser
from sched_sim import SPEC

STEP_S = 0.01  # every engine step


def _cluster(mode: str = "colocated", cost=None, **shape) -> SimCluster:
    nodes = (NodeShape("colocated", 256),) if mode == "colocated" else \
        (NodeShape("prefill", 256), NodeShape("decode", 256))
    cost = cost or FixedStepCost(STEP_S, SPEC.bytes_per_page)
    sh = ClusterShape(nodes, **{"rpc_latency_s": 0.0, "client_latency_s": 0.0, **shape})
    return SimCluster(sh, page_spec(cost.page_bytes, 16), cost)


def _figures(c: SimCluster, records) -> dict:
    return router_figures(c.routers, c.shape.routers, RouterCost(c.shape.router_request_s, c.shape.router_token_s),
                          records, max(r.end_time for r in records))


def test_a_busy_router_delays_the_second_dispatch_by_its_request_cost():
    """One router, 10 ms a request, two requests arriving together at 0: the first is parsed
    0 to 10 ms and dispatched at 10 ms, the second waits for it, parsed 10 to 20 ms."""
    c = _cluster(router_request_s=0.01)
    recs = c.run([RequestSpec(0.0, "t", "x", 16, 2), RequestSpec(0.0, "t", "x", 16, 2)])
    assert [c.reqs[f"sim-{i}"].arrival_time for i in range(2)] == pytest.approx([0.01, 0.02])
    waits = c.routers.servers[0].dispatch_waits
    assert (waits.zeros, list(waits.rest)) == (1, pytest.approx([0.01]))
    assert all(r.status == "ok" for r in recs)


@pytest.mark.parametrize("coast", [True, False])
def test_a_saturated_router_spaces_the_tokens_and_is_busy_all_along(coast):
    """One request of 20 tokens, a step every 10 ms, 50 ms of router work a token. Token k leaves
    the node at 10k ms; the router takes it at max(10k, the previous one's end), so it ends at
    10 + 50k ms (k = 1..20): the client's tokens are 50 ms apart, the last at 1010 ms, and the
    router was busy 1000 of those 1010 ms."""
    c = _cluster(router_token_s=0.05, coast=coast)
    (rec,) = c.run([RequestSpec(0.0, "t", "x", 16, 20)])
    assert rec.token_times == pytest.approx([0.01 + 0.05 * k for k in range(1, 21)])
    f = _figures(c, [rec])
    (r,) = f["per_router"]
    assert r["busy_share"] == pytest.approx(1.0 / 1.01, abs=1e-4)
    assert r["tokens"] == 20 and r["token_wait_ms"]["max"] == pytest.approx(19 * 40.0)  # the 20th: 760 ms wait
    assert (c.nodes["colocated-0"].coasted > 0) == coast  # (tokens of a run of steps come late, in order)


def _spread(n: int) -> list[RequestSpec]:
    return [RequestSpec(0.05 * i, "t", "x", 32, 10) for i in range(n)]


def test_two_routers_share_the_work_each_by_its_own_requests():
    """The same requests on one router and on two: each of two is busy for its own requests'
    work (crc32 of the id picks it), the two together as long as the one, about half each."""
    specs = _spread(40)
    req_s, tok_s = 0.002, 0.003

    def run(n):
        c = _cluster(routers=n, router_request_s=req_s, router_token_s=tok_s)
        recs = c.run(specs)
        assert all(r.status == "ok" and r.output_tokens == 10 for r in recs)
        return c, _figures(c, recs)

    one, f1 = run(1)
    two, f2 = run(2)
    per = [sum(pick(f"sim-{i}", 2) == j for i in range(len(specs))) for j in range(2)]
    assert [r["requests"] for r in f2["per_router"]] == per and min(per) >= 15
    assert [s.busy_s for s in two.routers.servers] == pytest.approx([p * (req_s + 10 * tok_s) for p in per])
    assert sum(s.busy_s for s in two.routers.servers) == pytest.approx(one.routers.servers[0].busy_s)
    busy1 = f1["per_router"][0]["busy_share"]
    assert max(r["busy_share"] for r in f2["per_router"]) < 0.65 * busy1


def _workload() -> list[RequestSpec]:
    out, t = [], 0.0
    for i in range(30):
        t += 0.07 + 0.05 * (i % 4)
        out.append(RequestSpec(t, f"t{i % 3}", "long" if i % 5 == 0 else "short",
                               1800 if i % 5 == 0 else 64 + 37 * (i % 7), 40 + 23 * (i % 6)))
    return out


COST = RooflineCost.of("h100-sxm", "llama-3-8b")


def _disagg(**shape) -> SimCluster:
    nodes = (NodeShape("prefill", 600, max_num_batched_tokens=1024), NodeShape("decode", 300, 200),
             NodeShape("decode", 300))
    return SimCluster(ClusterShape(nodes, **shape), page_spec(COST.page_bytes, 16), COST)


def _record(c: SimCluster) -> dict:
    recs = {rid: (r.status, r.error, r.token_times, r.end_time, r.server_timing) for rid, r in c.records.items()}
    return {"records": recs, "samples": c.observer.samples,
            "steps": {nid: n.num_steps for nid, n in c.nodes.items()}}


def test_zero_costs_give_the_uncharged_figures_exactly():
    """The charging path forced with zero costs (every token and request through a router's
    queue, runs of decode steps served at each commit) against the path that bypasses it."""
    plain = _disagg()
    plain.run(_workload())
    assert plain.routers is None
    forced = _disagg()
    forced.routers = Routers(RouterCost(), 1, forced.loop)
    forced.run(_workload())
    assert sum(n.coasted for n in forced.nodes.values()) > 0  # runs of steps were taken, and their tokens charged
    assert _record(forced) == _record(plain)
    assert forced.routers.servers[0].token_waits.zeros == sum(len(r.token_times) for r in forced.records.values())


def test_tiny_costs_come_close_to_the_uncharged_run():
    plain = _disagg()
    plain.run(_workload())
    tiny = _disagg(router_request_s=1e-6, router_token_s=1e-6)
    tiny.run(_workload())
    for rid, r in plain.records.items():
        t = tiny.records[rid]
        assert t.status == r.status and len(t.token_times) == len(r.token_times)
        assert max(abs(a - b) for a, b in zip(t.token_times, r.token_times)) < 2e-3


def test_charged_runs_of_decode_steps_match_one_event_per_step():
    """Tokens of a run of steps reach the routers late, stamped with their times; served in
    order at the next commit, they come out as one event per step gives them."""
    shape = dict(router_request_s=4e-4, router_token_s=1.5e-3, routers=2)  # busy enough to queue
    every, runs = _disagg(coast=False, **shape), _disagg(**shape)
    every.run(_workload())
    runs.run(_workload())
    assert sum(n.coasted for n in runs.nodes.values()) > 0 and sum(n.coasted for n in every.nodes.values()) == 0
    assert _record(runs) == _record(every)
    waits = [s.token_waits for s in runs.routers.servers]
    assert sum(len(w.rest) for w in waits) > 0  # some tokens did wait


def test_waits_quantiles_by_nearest_rank():
    w = Waits()
    for x in [0.0] * 97 + [0.001, 0.002, 0.004]:
        w.add(x)
    q = w.quantiles_ms()
    assert (q["p50"], q["p99"], q["max"], q["pieces"]) == (0.0, pytest.approx(2.0), pytest.approx(4.0), 100)


def test_the_plan_counts_ceil_load_over_target_routers():
    cost = RouterCost(0.0004, 0.000154)
    assert cost.load_s(5.0, 1000.0) == pytest.approx(0.156)  # 5 x 0.4 ms + 1000 x 154 us
    assert routers_needed(cost.load_s(5.0, 1000.0), 0.7) == 1
    assert routers_needed(cost.load_s(5.0, 10000.0), 0.7) == 3  # 1.542 / 0.7 = 2.2
    assert routers_needed(1.4, 0.7) == 2 and routers_needed(0.0, 0.7) == 1
    with pytest.raises(ValueError):
        routers_needed(1.0, 0.0)


def test_plan_router_count_takes_the_best_passing_level():
    from pdtb.planner.search import router_count

    def level(load, rps, tok_s, att):
        o = {"offered_rps": rps, "output_tok_s": tok_s, "goodput_rps": rps * att, "attainment": att}
        return {"load": load, "overall": o, "per_class": {}}

    levels = [level(1, 5.0, 2000.0, 1.0), level(2, 10.0, 8000.0, 0.95), level(4, 20.0, 16000.0, 0.5)]
    got = router_count(levels, RouterCost(0.0004, 0.000154), 0.9, "every-class", 0.7)
    # level 2: 10 x 0.4 ms + 8000 x 154 us = 1.236 CPU s a second, / 0.7 = 1.77: two routers
    assert got["load"] == 2 and got["routers"] == 2 and got["cpu_s_per_s"] == pytest.approx(1.236)


def test_a_calibration_router_section_is_the_default_and_flags_win(tmp_path):
    from pdtb.sim.calibration.record import Calibration

    shipped = Calibration.load("h100-llama-3-8b-bf16")
    a = build_parser().parse_args(["--workload", "whale-minnow", "--cost", "calibrated"])
    got = router_cost(a, shipped)
    assert got.request_s > 0 and got.token_s > 0 and "pdtb bench router" in got.measured_by
    assert router_cost(a, COST) == RouterCost()  # a roofline has no calibration: no charge unless told
    b = build_parser().parse_args(["--workload", "w", "--router-calibration", "h100-llama-3-8b-bf16"])
    assert router_cost(b, COST) == got
    c = build_parser().parse_args(["--workload", "w", "--router-token-us", "7"])
    assert router_cost(c, shipped) == RouterCost(got.request_s, 7e-6, got.measured_by +
                                                 "; --router-token-us by flag")
    bare = tmp_path / "bare.json"
    doc = shipped.to_json()
    doc.pop("router")
    bare.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no router section"):
        router_cost(build_parser().parse_args(["--workload", "w", "--router-calibration", str(bare)]), COST)


def test_the_results_file_says_how_busy_the_routers_were(tmp_path, capsys):
    from pdtb.cli import main
    from pdtb.figures.results import load_results

    path = tmp_path / "r.json"
    small = ["--workload", "whale-minnow", "--duration", "4", "--whales", "1", "--whale-prompt", "512",
             "--whale-output", "64", "--minnow-rate", "4", "--minnow-prompt", "24", "--minnow-output", "8"]
    assert main(["sim", *small, "--mode", "disagg", "--cost", "roofline", "--routers", "2",
                 "--router-calibration", "h100-llama-3-8b-bf16", "--out", str(path)]) == 0
    res = load_results(path)
    f = res["meta"]["sim"]["routers"]
    shipped = json.loads((Path(__file__).parents[2] / "pdtb/sim/calibrations/h100-llama-3-8b-bf16.json").read_text())
    want = shipped["router"]
    assert f["routers"] == 2 and f["charged"] and f["token_s"] == want["token_s"]
    assert "pdtb bench router" in f["measured_by"]
    got = sum(len(r["token_times"]) for r in res["requests"])
    assert sum(r["tokens"] for r in f["per_router"]) == got
    assert f["streamed_tok_s_peak_1s"] >= f["streamed_tok_s_mean"] > 0
    for r in f["per_router"]:
        assert 0 < r["busy_share"] < 1 and r["token_wait_ms"]["pieces"] == r["tokens"]
        assert r["dispatch_wait_ms"]["pieces"] == r["requests"]
        assert r["token_wait_ms"]["p50"] <= r["token_wait_ms"]["max"]
    us = f"routers: 2 ({want['request_s'] * 1e6:.0f} us a request, {want['token_s'] * 1e6:.0f} us a token)"
    assert us in capsys.readouterr().out


def test_the_plan_gives_each_candidate_its_routers(capsys):
    from math import ceil

    from pdtb.planner import plan
    from tests.sim.test_sim_plan import TINY, PrefillBound

    args = ["--gpus", "2", *TINY, "--span-s", "2", "--max-levels", "3", "--json", "--routers", "3",
            "--router-request-us", "1000", "--router-token-us", "5000"]
    assert plan.main(args, cost=PrefillBound()) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["router_cost"]["token_s"] == 0.005 and doc["router_target"] == 0.7
    for c in doc["candidates"]:
        r = c["routers"]
        assert r["cpu_s_per_s"] == pytest.approx(r["requests_per_s"] * 0.001 + r["tokens_per_s"] * 0.005)
        assert r["routers"] == ceil(r["cpu_s_per_s"] / 0.7)
    # 1P+1D passes at 5.5 requests and about 150 tokens a second: 0.75 CPU s a second, two routers
    assert {c["label"]: c["routers"]["routers"] for c in doc["candidates"]}["1P+1D"] == 2


def test_waits_with_no_piece_are_zero_not_an_error():
    """A router that carried no piece (every request of a run on other routers) reports zeros."""
    from pdtb.sim.routers import Waits

    assert Waits().quantiles_ms() == {"p50": 0.0, "p99": 0.0, "max": 0.0, "pieces": 0}
    w = Waits()
    w.add(0.0)
    w.add(0.002)
    assert w.quantiles_ms() == {"p50": 0.0, "p99": 2.0, "max": 2.0, "pieces": 2}
