"""A step's stretch beside the host's other nodes (pdtb/sim/contention.py) and the request path's
per-token dispatch and per-mode fit (pdtb/sim/path_fit.py): fitted from hand-written step logs
and stamps whose answer is known, and applied by the simulator as worked out by hand."""
from __future__ import annotations

import json

import pytest

from tests.project.test_cli import run_pdtb

from pdtb.figures.records import RequestSpec
from pdtb.sim import contention
from pdtb.sim.calibrate import CalibratedCost, Coefficients
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import StepShape
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape
from pdtb.sim.path_fit import Cover
from pdtb.sim.step_samples import OVERHEAD_QS, SampleError

COEF = Coefficients(c0=2.0, rows=0.5, chunks=1.5, tokens=0.03)  # ms


def test_spans_cover_windows_and_neighbours_add_up():
    s = Cover([(0.0, 0.010), (0.015, 0.020)])
    assert s.within(0.0, 0.020) == pytest.approx(0.015)
    assert s.within(0.005, 0.016) == pytest.approx(0.006)
    assert s.within(0.030, 0.040) == 0.0
    other = Cover([(0.0, 0.020)])
    assert contention.neighbours_busy([s], 0.020) == pytest.approx(0.75)
    assert contention.neighbours_busy([s, other], 0.020) == pytest.approx(1.75)  # summed over the neighbours
    many = Cover()
    for i in range(200):
        many.add(i * 0.01, i * 0.01 + 0.005)
    many.prune(1.5)
    assert many.within(1.9, 2.0) == pytest.approx(0.05)  # the window kept whole


def test_the_stretch_is_fitted_by_time_and_never_negative():
    pts = [(u, 1.1 + 0.6 * u, w) for u in (0.0, 0.25, 0.5, 1.0) for w in (1.0, 30.0)] * 20
    assert contention.fit_role(pts) == pytest.approx((1.1, 0.6))
    # a long step alone at 1.0 and many short ones alone at 2.0: by time, the long one holds the level
    by_time = [(0.0, 1.0, 100.0)] * 50 + [(0.0, 2.0, 1.0)] * 50 + [(1.0, 1.5, 100.0)] * 50
    a, b = contention.fit_role(by_time)
    assert a == pytest.approx((100 * 1.0 + 2.0) / 101) and b == pytest.approx(1.5 - a)
    faster = [(u, 1.5 - 0.4 * u, 1.0) for u in (0.0, 1.0)] * 60  # a neighbour never speeds a step up
    assert contention.fit_role(faster) == pytest.approx((1.3, 0.0))
    assert contention.fit_role(pts[:99]) is None  # too few to say
    assert contention.fit_role([(0.0, 1.0, 1.0)] * 200) is None  # never beside a neighbour
    assert contention.factor((1.0, 0.5), 2.0) == 2.0 and contention.factor((0.05, 0.0), 0.0) == 0.1
    assert [contention.spread_key("prefill", s, u) for s, u in ((True, 0.5), (True, 0.49), (False, 1.0))] == \
        ["prefill@busy", "prefill", "prefill"]


def _grid(tmp_path):
    shapes = [StepShape(1, 8), StepShape(2, 40), StepShape(8, 300), StepShape(0, 0, 1, 16, 136),
              StepShape(0, 0, 1, 64, 2080), StepShape(0, 0, 2, 32, 900), StepShape(3, 50, 1, 16, 200)]
    samples = [{"decode_rows": s.decode_rows, "decode_ctx": s.decode_ctx, "prefill_chunks": s.prefill_chunks,
                "prefill_tokens": s.prefill_tokens, "prefill_attn": s.prefill_attn, "ms": COEF.ms(s)} for s in shapes]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"kind": "step-samples", "page_bytes": 2048, "samples": samples}))
    return path


def _run_logs(folder):
    """A decode node stepping back to back over [1, 2) s (3 ms steps: 2 rows); a prefill node's
    16-token chunks (3.98 ms by COEF) every 50 ms over [2.1, 7.1) alone, and every 9 ms over
    [1.05, 1.95) beside the decode node, 1.8x as long there."""
    folder.mkdir()
    dec = [{"t": round(1.0 + 0.003 * i, 6), "ms": 3.0, "decode": [["t", 2, 40]], "prefill": [], "moves": []}
           for i in range(333)]
    chunk = COEF.ms(StepShape(0, 0, 1, 16, 136))
    pre = [{"t": round(2.1 + 0.05 * i, 6), "ms": chunk, "decode": [], "prefill": [["t", f"a{i}", 16, 0]], "moves": []}
           for i in range(100)]
    pre += [{"t": round(1.05 + 0.009 * i, 6), "ms": round(1.8 * chunk, 6), "decode": [],
             "prefill": [["t", f"b{i}", 16, 0]], "moves": []} for i in range(100)]
    for name, rows in (("steps-decode-0.jsonl", dec), ("steps-prefill-0.jsonl", pre)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["t"])))
    return [str(folder / "steps-decode-0.jsonl"), str(folder / "steps-prefill-0.jsonl")]


def test_calibrate_fits_each_role_s_stretch_from_one_run_s_logs(tmp_path):
    logs = _run_logs(tmp_path / "run")
    out = tmp_path / "cal.json"
    args = ["sim", "calibrate", "--steps", str(_grid(tmp_path)), "--fit", "steps", "--contention",
            "--draw-step-spread", "--out", str(out)]
    for log in logs:
        args += ["--step-log", log]
    r = run_pdtb(*args)
    assert r.returncode == 0, r.stderr
    c = CalibratedCost.load(out)
    assert c.contention["prefill"] == pytest.approx((1.0, 0.8), abs=1e-5)
    assert c.contention["decode"] == pytest.approx((1.0, 0.0), abs=1e-5)  # prefill steps beside: no stretch
    # what the stretch leaves, alone and beside busy neighbours apart; 16 decode steps alone: too few
    assert set(c.spread_q) == {"prefill", "prefill@busy", "decode@busy"}
    assert all(q == pytest.approx([1.0] * len(OVERHEAD_QS), abs=1e-4) for q in c.spread_q.values())
    assert c.step_factor("prefill", 3, busy=1.0) == pytest.approx(1.8, abs=1e-4)
    assert c.step_factor("prefill", 3, busy=0.0) == pytest.approx(1.0, abs=1e-4)
    back = CalibratedCost.from_json(json.loads(out.read_text()))
    assert back.contention == c.contention and back.spread_q == c.spread_q
    for bad in ({"robot": [1.0, 0.0]}, {"prefill": [0.0, 1.0]}, {"prefill": [1.0, -0.1]}, {"prefill": [1.0]},
                {"prefill": [1.0, float("nan")]}, [[1.0, 0.0]]):
        with pytest.raises(SampleError, match="step_contention"):
            CalibratedCost.from_json({**back.to_json(), "step_contention": bad})
    # a node alone (no other node's log in its folder): nothing to fit, one line, no file
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "steps-prefill-0.jsonl").write_text(open(logs[1]).read())
    out2 = tmp_path / "cal2.json"
    r = run_pdtb("sim", "calibrate", "--steps", str(_grid(tmp_path)), "--fit", "steps", "--contention",
                 "--step-log", str(alone / "steps-prefill-0.jsonl"), "--out", str(out2))
    assert r.returncode != 0 and "--contention: no role has 100 logged steps beside another node" in r.stderr
    assert not out2.exists()


def _ttfts(cost, specs, **shape):
    nodes = (NodeShape("prefill", 256), NodeShape("decode", 256))
    c = SimCluster(ClusterShape(nodes, rpc_latency_s=0.0, client_latency_s=0.0, **shape), page_spec(1024, 16), cost)
    recs = c.run(specs)
    assert all(r.status == "ok" for r in recs)
    return [r.first_token_time - r.send_time for r in recs]


def test_a_prefill_step_beside_a_stepping_decode_node_takes_its_stretch():
    """Every step 10 ms (c0 alone). Request a's prefill runs with the decode node idle; b's, sent
    at 0.5 s while a decodes (1000 tokens: 10 s), beside a decode node stepping throughout its
    last window: 10 ms x (1 + 1.0 x 1.0) = 20 ms. Without the stretch both take 10 ms."""
    import dataclasses

    plain = CalibratedCost(Coefficients(c0=10.0), 1024)
    stretched = dataclasses.replace(plain, contention={"prefill": (1.0, 1.0)})
    specs = [RequestSpec(0.0, "a", "x", 16, 1000), RequestSpec(0.5, "b", "x", 16, 4)]
    base, got = _ttfts(plain, specs), _ttfts(stretched, specs)
    assert base == pytest.approx([0.010, 0.010], abs=1e-9)
    assert got == pytest.approx([0.010, 0.020], abs=1e-9)


def test_a_new_request_s_dispatch_grows_with_its_prompt():
    cost = CalibratedCost(Coefficients(c0=10.0), 1024)
    specs = [RequestSpec(0.0, "a", "x", 10, 2), RequestSpec(1.0, "b", "x", 1010, 2)]
    base = _ttfts(cost, specs)
    got = _ttfts(cost, specs, dispatch_s_per_token=1e-5)
    assert [g - b for g, b in zip(got, base)] == pytest.approx([1e-4, 1.01e-2], abs=1e-9)
    with pytest.raises(ValueError, match="latencies"):
        ClusterShape((NodeShape("colocated", 8),), dispatch_s_per_token=-1.0)


def _stamped(mode_ov: float, tokens: int, disp: float, i: int) -> dict:
    send, arrival = 1.0 * i, 100.0 + i
    queued, first = arrival + disp, arrival + disp + 0.005
    return {"status": "ok", "send_time": send, "first_token_time": send + (first - arrival) + mode_ov,
            "prompt_tokens": tokens, "server_timing": {"stamps": {"router_arrival": arrival, "prefill_queued": queued,
                                                                  "first_token": first}}}


def test_the_path_is_a_median_line_in_the_prompt_and_fitted_per_mode():
    from pdtb.sim.path_fit import fit_path, median_line

    xs = [24, 24, 24, 1024, 1024, 1984, 1984, 1984, 500, 24]
    ys = [0.001 + 2e-6 * x for x in xs]
    ys[0], ys[5] = 0.02, 0.03  # two slow dispatches do not tilt a median line
    a, b = median_line(xs, ys)
    assert a == pytest.approx(0.001, abs=1e-6) and b == pytest.approx(2e-6, rel=1e-3)
    assert median_line([5, 5, 5], [0.001, 0.002, 0.009]) == (0.002, 0.0)  # one prompt size: the median
    assert median_line([1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0]) == (2.5, 0.0)  # never a negative slope
    # dispatch 1 ms + 2 us a token in both modes; outside the stamps 3 ms colocated, 5 ms disaggregated
    col = [_stamped(0.003, t, 0.001 + 2e-6 * t, i) for i, t in enumerate([24, 24, 1024, 1984, 24, 500])]
    dis = [_stamped(0.005, t, 0.001 + 2e-6 * t, i) for i, t in enumerate([24, 1024, 24, 1984, 24, 500])]
    got = fit_path([{"meta": {"mode": "colocated"}, "requests": col}, {"meta": {"mode": "disagg"}, "requests": dis}], 1e6)
    assert got["rpc_latency_s"] == pytest.approx(0.001, abs=1e-6)
    assert got["dispatch_s_per_token"] == pytest.approx(2e-6, rel=1e-3)
    m = got["modes"]
    assert m["colocated"]["client_latency_s"] == pytest.approx((0.003 - 0.001) / 2, abs=1e-6)
    assert m["disagg"]["client_latency_s"] == pytest.approx((0.005 - 0.001) / 2, abs=1e-6)
    # a simulated cluster takes its own mode's path
    from pdtb.sim.flags import cluster_shape
    from pdtb.sim.run import build_parser

    cost = CalibratedCost(COEF, 1024, meta={"path": got})
    for mode in ("colocated", "disagg"):
        shape = cluster_shape(build_parser().parse_args(["--mode", mode]), cost)
        assert shape.client_latency_s == m[mode]["client_latency_s"]
        assert shape.dispatch_s_per_token == m[mode]["dispatch_s_per_token"]
    flagged = cluster_shape(build_parser().parse_args(["--mode", "disagg", "--rpc-latency-ms", "2"]), cost)
    assert (flagged.rpc_latency_s, flagged.dispatch_s_per_token) == (0.002, 0.0)  # the flag is the whole dispatch


def test_a_grid_measured_on_a_slower_host_is_scaled_to_the_logged_runs(tmp_path):
    """The grid 1.3x the logged steps' COEF (the host's speed drifted between the two): with
    --scale-grid the fit takes the grid's shape at the logs' level, COEF itself; without, the
    grid's level pulls the fit off it."""
    grid = json.loads(_grid(tmp_path).read_text())
    for s in grid["samples"]:
        s["ms"] = round(1.3 * s["ms"], 6)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(grid))
    logs = _run_logs(tmp_path / "run")
    got = {}
    for flag in ([], ["--scale-grid"]):
        out = tmp_path / f"cal{len(flag)}.json"
        args = ["sim", "calibrate", "--steps", str(slow), "--fit", "all", "--out", str(out), *flag]
        for log in logs[:1]:  # the decode node's: the logs' steps at COEF
            args += ["--step-log", log]
        r = run_pdtb(*args)
        assert r.returncode == 0, r.stderr
        got[bool(flag)] = CalibratedCost.load(out)
    shape = StepShape(0, 0, 1, 64, 2080)  # a prefill chunk: the grid's alone, never logged
    assert got[True].coef.ms(shape) == pytest.approx(COEF.ms(shape), rel=1e-3)
    assert got[False].coef.ms(shape) > 1.2 * COEF.ms(shape)
    (src,) = [s for s in got[True].meta["fit"]["sources"] if s["kind"] == "step-samples"]
    assert src["scaled"] == pytest.approx(1 / 1.3, rel=1e-4)
    r = run_pdtb("sim", "calibrate", "--steps", str(slow), "--fit", "steps", "--step-log", logs[0], "--scale-grid",
                 "--out", str(tmp_path / "x.json"))
    assert r.returncode != 0 and "--scale-grid: takes --fit all" in r.stderr
