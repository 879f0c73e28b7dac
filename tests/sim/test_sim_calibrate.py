"""The calibrated step-cost model: the fit recovers hand-chosen coefficients, `bench steps
--grid` records each composition as a StepShape computed by hand, a hand-written step log
gives the hand-computed shapes and node overhead, and bad inputs are one line."""
from __future__ import annotations

import json

import pytest
import torch

from tests.project.test_cli import run_pdtb

from pdtb.sim.calibrate import CalibratedCost, Coefficients, fit
from pdtb.sim.cost import StepShape
from pdtb.sim.step_samples import SampleError, StepSample, read_step_log

TRUE = Coefficients(c0=2.0, rows=0.5, ctx=0.001, chunks=1.5, tokens=0.03, attn=2e-5)
SHAPES = [StepShape(1, 32), StepShape(4, 2048), StepShape(32, 65536), StepShape(16, 512),
          StepShape(0, 0, 1, 16, 136), StepShape(0, 0, 1, 512, 131328), StepShape(0, 0, 2, 256, 16512),
          StepShape(0, 0, 2, 32, 33040), StepShape(4, 128, 1, 128, 139328), StepShape(1, 2048, 1, 16, 16520)]


def _hand_ms(s: StepShape) -> float:
    return 2.0 + 0.5 * s.decode_rows + 0.001 * s.decode_ctx + 1.5 * s.prefill_chunks \
        + 0.03 * s.prefill_tokens + 2e-5 * s.prefill_attn


def test_fit_recovers_known_coefficients():
    f = fit([StepSample(s, _hand_ms(s)) for s in SHAPES])
    for term in ("c0", "rows", "ctx", "chunks", "tokens", "attn"):
        assert getattr(f.coef, term) == pytest.approx(getattr(TRUE, term), rel=1e-6), term
    assert f.r2 == pytest.approx(1.0, abs=1e-9) and f.max_rel_err < 1e-6 and f.samples == len(SHAPES)


def test_fit_never_goes_negative():
    # steps that get cheaper with more rows: least squares would want a negative slope
    f = fit([StepSample(StepShape(r, r), 10.0 - r) for r in (1, 2, 3, 4)])
    assert min(getattr(f.coef, t) for t in ("c0", "rows", "ctx", "chunks", "tokens", "attn")) >= 0


def test_calibrated_cost_step_and_links(tmp_path):
    from pdtb.sim.cost import LinkModel

    c = CalibratedCost(TRUE, page_bytes=4096, transfer=LinkModel(1e9, 1e-4), tier=LinkModel(2e9),
                       node_overhead_s=0.002)
    s = StepShape(4, 2048, 1, 128, 139328)
    assert c.step_s(s) == pytest.approx((2 + 2 + 2.048 + 1.5 + 3.84 + 2.78656) / 1e3 + 0.002)
    assert c.step_s(StepShape()) == 0.0
    assert c.transfer_s(10**9) == pytest.approx(1.0001) and c.tier_move_s(10**9) == 0.5
    (tmp_path / "c.json").write_text(json.dumps(c.to_json()))
    back = CalibratedCost.load(tmp_path / "c.json")
    assert back == c and back.step_s(s) == c.step_s(s)


def test_bench_steps_grid_records_hand_shapes(llama_dir):
    r = run_pdtb("bench", "steps", "--grid", "--model", llama_dir, "--reps", "1", "--grid-rows", "1,2",
                 "--grid-ctx", "5,40", "--grid-chunks", "4", "--grid-offsets", "0,30", "--grid-chunk-counts", "1,2",
                 "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["kind"], doc["device"], doc["dtype"], doc["page_size"], doc["threads"]) == \
        ("step-samples", "cpu", "float32", 16, 1)
    assert doc["page_bytes"] == 4 * 2 * 16 * 2 * 32 * 4  # layers, K+V, slots, KV heads, head_dim, float32
    assert doc["command"].startswith("pdtb bench steps --grid")
    got = [(s["decode_rows"], s["decode_ctx"], s["prefill_chunks"], s["prefill_tokens"], s["prefill_attn"])
           for s in doc["samples"]]
    # decode: R rows of C tokens read; prefill: K chunks of 4 at offset O (4 * O + 4 * 5 / 2 pairs each);
    # mixed: each decode composition with the next (size, offset) in turn
    want = [(1, 5, 0, 0, 0), (1, 40, 0, 0, 0), (2, 10, 0, 0, 0), (2, 80, 0, 0, 0),
            (0, 0, 1, 4, 10), (0, 0, 1, 4, 130), (0, 0, 2, 8, 20), (0, 0, 2, 8, 260),
            (1, 5, 1, 4, 10), (1, 40, 1, 4, 130), (2, 10, 1, 4, 10), (2, 80, 1, 4, 130)]
    assert got == want
    assert all(s["ms"] > 0 for s in doc["samples"])
    m = doc["machine"]  # where it ran, for the calibration to carry
    assert m["accelerator"] == m["cpu"] and m["cores"] >= 1 and m["versions"]["torch"] == torch.__version__


def test_bench_steps_random_init_from_a_config_alone(llama_dir, tmp_path):
    cfg = json.loads(open(f"{llama_dir}/config.json").read())
    (tmp_path / "shape.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))  # no weights, no tokenizer
    r = run_pdtb("bench", "steps", "--grid", "--random-init", str(tmp_path / "shape.json"), "--reps", "1",
                 "--grid-rows", "1", "--grid-ctx", "5", "--grid-chunks", "4", "--grid-offsets", "0",
                 "--grid-chunk-counts", "1", "--mixed", "none", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"].startswith("random:") and doc["page_bytes"] == 2 * 2 * 16 * 2 * 32 * 4  # 2 layers
    assert [s["decode_ctx"] for s in doc["samples"]] == [5, 0]
    r = run_pdtb("bench", "steps", "--grid", "--random-init", "no-such-shape")
    assert r.returncode == 2 and "llama-3-8b" in r.stderr and "Traceback" not in r.stderr


def _log_lines() -> list[dict]:
    # Three steps back to back (idle 2.0 and 1.5 ms after them), a pause, two more (idle 1.0 ms).
    return [
        {"t": 100.0, "ms": 10.0, "decode": [["a", 2, 30], ["b", 1, 100]], "prefill": [], "moves": [], "unserved": 0},
        {"t": 100.012, "ms": 20.0, "decode": [["a", 1, 31]], "prefill": [["b", "r1", 16, 32]], "moves": [],
         "unserved": 0},
        {"t": 100.0335, "ms": 8.0, "decode": [["a", 1, 32]], "prefill": [], "moves": [["demote", "r2", 4, 3.0]],
         "unserved": 1},
        {"t": 100.5, "ms": 5.0, "decode": [["a", 1, 33]], "prefill": [], "moves": [], "unserved": 0},
        {"t": 100.506, "ms": 5.0, "decode": [], "prefill": [["c", "r3", 8, 0], ["c", "r4", 8, 8]], "moves": [],
         "unserved": 0},
    ]


def test_step_log_gives_hand_shapes_and_overhead(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _log_lines()))
    log = read_step_log(path)
    assert [(s.shape, s.ms) for s in log.samples] == [
        (StepShape(3, 130), 10.0),
        (StepShape(1, 31, 1, 16, 16 * 32 + 16 * 17 // 2), 20.0),
        (StepShape(1, 32), 5.0),  # the demotion's 3 ms is a tier move, not step time
        (StepShape(1, 33), 5.0),
        (StepShape(0, 0, 2, 16, (8 * 0 + 36) + (8 * 8 + 36)), 5.0)]
    assert log.gaps_s == pytest.approx([0.002, 0.0015, 0.001])  # the 458.5 ms pause is not back to back
    out = tmp_path / "cal.json"
    r = run_pdtb("sim", "calibrate", "--step-log", str(path), "--page-bytes", "1024", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "R^2" in r.stdout and "max relative error" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["node_overhead_s"] == pytest.approx(0.0015)  # median of 2.0, 1.5, 1.0 ms
    assert doc["tier_move"]["bytes_per_s"] == pytest.approx(4 * 1024 / 0.003)  # 4 pages in 3 ms
    assert doc["fit"]["samples"] == 5 and doc["command"].startswith("pdtb sim calibrate --step-log")
    assert CalibratedCost.load(out).node_overhead_s == pytest.approx(0.0015)


def test_fit_from_steps_with_overhead_from_a_step_log(tmp_path):
    steps = [{"decode_rows": s.decode_rows, "decode_ctx": s.decode_ctx, "prefill_chunks": s.prefill_chunks,
              "prefill_tokens": s.prefill_tokens, "prefill_attn": s.prefill_attn, "ms": _hand_ms(s)} for s in SHAPES]
    machine = {"accelerator": "NVIDIA H100 80GB HBM3", "cpu": "x", "cores": 26, "memory_gib": 200, "python": "3.11.7",
               "versions": {"torch": "2.13.0", "transformers": "5.24.0", "pyzmq": "27.3.0"}}
    (tmp_path / "steps.json").write_text(json.dumps(
        {"kind": "step-samples", "page_bytes": 2048, "command": "pdtb bench steps --grid --json", "device": "cuda",
         "dtype": "bfloat16", "model": "random:llama-3-8b", "machine": machine, "samples": steps}))
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _log_lines()))
    out = tmp_path / "cal.json"
    r = run_pdtb("sim", "calibrate", "--steps", str(tmp_path / "steps.json"), "--step-log", str(tmp_path / "log.jsonl"),
                 "--fit", "steps", "--note", "log from a test", "--out", str(out))
    assert r.returncode == 0, r.stderr
    c = CalibratedCost.load(out)
    assert c.coef.c0 == pytest.approx(2.0, rel=1e-6) and c.coef.attn == pytest.approx(2e-5, rel=1e-6)
    assert c.node_overhead_s == pytest.approx(0.0015) and c.page_bytes == 2048
    doc = json.loads(out.read_text())
    assert doc["fit"]["samples"] == len(SHAPES) and doc["note"] == "log from a test"
    assert doc["command"].startswith(f"pdtb bench steps --grid --json > {tmp_path / 'steps.json'} && pdtb sim calibrate")
    assert doc["machine"] == machine  # the samples' machine and versions travel with the calibration
    assert c.describe() == ("calibration cal: random:llama-3-8b bfloat16 on cuda, ? thread(s); fit of "
                            f"{len(SHAPES)} steps, R^2 {doc['fit']['r2']}; NVIDIA H100 80GB HBM3, 26 cores; "
                            "torch 2.13.0, transformers 5.24.0, pyzmq 27.3.0")
    # the simulator says which calibration it uses, in its output and its results file
    res = tmp_path / "r.json"
    r = run_pdtb("sim", "--workload", "whale-minnow", "--duration", "1", "--mode", "colocated", "--cost", "calibrated",
                 "--calibration", str(out), "--kv-pages", "4096", "--quiet", "--out", str(res))
    assert r.returncode == 0, r.stderr
    assert f"pdtb sim: {c.describe()}" in r.stderr and json.loads(res.read_text())["meta"]["cost_info"] == c.describe()


def _samples(samples) -> str:
    return json.dumps({"kind": "step-samples", "page_bytes": 1024, "samples": samples})


NEGATIVE = {"decode_rows": -1, "decode_ctx": 0, "prefill_chunks": 0, "prefill_tokens": 0, "prefill_attn": 0, "ms": 1}


@pytest.mark.parametrize("text, needle", [
    ("", "empty file"),
    ("{oops", "not JSON"),
    ('{"kind": "other"}', "not a step-samples file"),
    (_samples([NEGATIVE]), "sample 0: decode_rows must be a non-negative"),
    (_samples([]), "no samples"),
    (None, "No such file"),
])
def test_bad_steps_files_are_one_line(tmp_path, text, needle):
    path = tmp_path / "steps.json"
    if text is not None:
        path.write_text(text)
    r = run_pdtb("sim", "calibrate", "--steps", str(path))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("text, needle", [
    ('{"t": 1, "ms": 2, "decode": [["a", 1, 5]]}\nnot json\n', "line 2: not JSON"),
    ('{"t": 1, "ms": 2, "decode": [["a", -1, 5]]}\n', "line 1: decode rows must be a non-negative"),
    ('{"t": 1, "ms": 2, "decode": [["a"]]}\n', "line 1: not a step-log record"),
    ('{"t": 1, "ms": 2, "decode": [], "prefill": []}\n', "no steps that ran tokens"),
])
def test_bad_step_logs_are_one_line(tmp_path, text, needle):
    (tmp_path / "log.jsonl").write_text(text)
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "log.jsonl"), "--page-bytes", "64")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_calibrate_argument_errors(tmp_path):
    r = run_pdtb("sim", "calibrate")
    assert r.returncode == 2 and "--steps" in r.stderr.splitlines()[-1]
    (tmp_path / "log.jsonl").write_text(json.dumps(_log_lines()[0]) + "\n")
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "log.jsonl"))
    assert r.returncode == 2 and "give --page-bytes" in r.stderr
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "log.jsonl"), "--page-bytes", "-5")
    assert r.returncode == 2 and "positive" in r.stderr


def test_shipped_calibration_is_its_samples_fit():
    from pathlib import Path

    import pdtb.sim.calibrate as cal
    from pdtb.sim.step_samples import read_samples

    c = CalibratedCost.load("cpu-tiny-2core")  # by name, from the package data
    assert c.page_bytes == 4 * 2 * 16 * 2 * 32 * 4 and c.meta["threads"] == 1
    assert c.meta["command"].startswith("pdtb bench steps --grid") and 0 < c.node_overhead_s < 0.01
    samples, head = read_samples(Path(cal.__file__).with_name("calibrations") / "samples" / "cpu-tiny-2core.json")
    refit = fit(samples)
    assert head["page_bytes"] == c.page_bytes and refit.samples == c.meta["fit"]["samples"]
    for term in ("c0", "rows", "ctx", "chunks", "tokens", "attn"):
        assert getattr(refit.coef, term) == pytest.approx(getattr(c.coef, term), rel=1e-9)


def _stamped(send: float, ttft: float, arrival: float, queued: float, first: float, transfer=None) -> dict:
    s = {"router_arrival": arrival, "prefill_queued": queued, "first_token": first}
    t = {"stamps": s}
    if transfer is not None:
        s["transfer_start"], s["transfer_end"] = transfer[0], transfer[1]
        t["kv_bytes"] = {"received": transfer[2]}
    return {"status": "ok", "send_time": send, "first_token_time": send + ttft, "server_timing": t}


def test_the_request_path_is_fitted_to_real_runs_stamps(tmp_path):
    from pdtb.sim.path_fit import fit_path

    # dispatch 3 ms; client TTFT 20 ms of which 12 ms between router arrival and the first token:
    # 8 ms outside, less one rpc (3 ms), halved = 2.5 ms each way; hand-offs landing 10 ms after
    # the first token, carrying 1000 bytes at 1e6 B/s (1 ms), less the header's rpc: 6 ms
    reqs = [_stamped(1.0 * i, 0.020, 100.0 + i, 100.003 + i, 100.012 + i, (100.013 + i, 100.022 + i, 1000))
            for i in range(6)]
    got = fit_path([{"requests": reqs}], 1e6)
    assert got["rpc_latency_s"] == pytest.approx(0.003, abs=1e-6)
    assert got["client_latency_s"] == pytest.approx(0.0025, abs=1e-6)
    assert got["transfer_latency_s"] == pytest.approx(0.006, abs=1e-6) and got["requests"] == got["transfers"] == 6
    assert fit_path([{"requests": reqs[:4]}], 1e6) is None  # too few to say
    # through the command: the calibration carries the path, and the simulator takes it by default
    (tmp_path / "real.json").write_text(json.dumps({"requests": reqs}))
    steps = [{"decode_rows": s.decode_rows, "decode_ctx": s.decode_ctx, "prefill_chunks": s.prefill_chunks,
              "prefill_tokens": s.prefill_tokens, "prefill_attn": s.prefill_attn, "ms": _hand_ms(s)} for s in SHAPES]
    (tmp_path / "steps.json").write_text(json.dumps({"kind": "step-samples", "page_bytes": 2048, "samples": steps}))
    out = tmp_path / "cal.json"
    r = run_pdtb("sim", "calibrate", "--steps", str(tmp_path / "steps.json"), "--results", str(tmp_path / "real.json"),
                 "--transfer-gb-per-s", "0.001", "--out", str(out))
    assert r.returncode == 0, r.stderr
    c = CalibratedCost.load(out)
    assert c.path["rpc_latency_s"] == pytest.approx(0.003, abs=1e-6) and c.transfer.latency_s == pytest.approx(0.006, abs=1e-6)
    from pdtb.sim.flags import cluster_shape
    from pdtb.sim.run import build_parser

    a = build_parser().parse_args(["--mode", "colocated"])
    shape = cluster_shape(a, c)
    assert (shape.rpc_latency_s, shape.client_latency_s) == (c.path["rpc_latency_s"], c.path["client_latency_s"])
    a = build_parser().parse_args(["--mode", "colocated", "--rpc-latency-ms", "1"])
    assert cluster_shape(a, c).rpc_latency_s == 0.001  # a flag wins

def test_the_hand_off_latency_leaves_out_the_decode_steps_and_the_held_transfers_and_is_drawn():
    import statistics

    from pdtb.sim.cost import LinkModel
    from pdtb.sim.path_fit import Cover, fit_path
    from pdtb.sim.step_samples import OVERHEAD_QS

    # each hand-off, 10 ms from the first token to its landing (1 ms of bytes, 3 ms rpc), overlaps
    # the decode node's steps for 4 ms: 3 ms of two spans that overlap each other, 1 ms of a
    # third; 10 - 4 - 1 - 3 = 2 ms
    reqs = [_stamped(1.0 * i, 0.020, 100.0 + i, 100.003 + i, 100.012 + i, (100.013 + i, 100.022 + i, 1000))
            for i in range(6)]
    steps = [s for i in range(6) for s in ((100.0 + i, 100.014 + i), (100.013 + i, 100.015 + i),
                                            (100.021 + i, 100.030 + i))]
    got = fit_path([{"requests": reqs}], 1e6, steps)
    assert got["transfer_latency_s"] == pytest.approx(0.002, abs=1e-6) and got["steps_left_out"]
    # a transfer held at the prefill node is the simulator's to make (deferral, retry): left out
    held = _stamped(9.0, 0.020, 109.0, 109.003, 109.012, (109.013, 111.0, 1000))
    held["server_timing"]["slo"] = {"components": {"held_at_prefill": 1.9}}
    assert fit_path([{"requests": reqs + [held] * 9}], 1e6, steps)["transfer_latency_s"] == \
        pytest.approx(0.002, abs=1e-6)
    assert "transfer_latency_q" not in got  # six hand-offs: too few to draw from
    # 40 hand-offs landing 5, 6, ..., 44 ms after the first token (no steps, no bytes, rpc 3 ms):
    # latencies 2 .. 41 ms, their levels from the smallest to the largest, median 21.5 ms
    many = [_stamped(1.0 * i, 0.020, 100.0 + i, 100.003 + i, 100.012 + i,
                     (100.013 + i, 100.012 + i + (5 + i) / 1000, 0)) for i in range(40)]
    got = fit_path([{"requests": many}], 1e6)
    q = got["transfer_latency_q"]
    assert len(q) == len(OVERHEAD_QS) and q[0] == pytest.approx(0.002) and q[-1] == pytest.approx(0.041)
    assert q == sorted(q) and got["transfer_latency_s"] == pytest.approx(0.0215, abs=1e-6)
    # drawn by key: the draws follow the levels, and depend on the key alone
    c = CalibratedCost(Coefficients(c0=1.0), 1024, LinkModel(1e6, 0.010), handoff_q=tuple(q))
    draws = [c.handoff_s(1000, k) for k in range(4000)]
    assert all(busy == pytest.approx(0.011) for busy, _ in draws)  # the link: its bytes and its own latency
    lands = [land - 0.001 for _, land in draws]
    assert min(lands) >= 0.002 - 1e-9 and max(lands) <= 0.041 + 1e-9
    assert statistics.median(lands) == pytest.approx(0.0215, abs=0.002) and c.handoff_s(1000, 7) == draws[7]
    assert CalibratedCost(Coefficients(c0=1.0), 1024, LinkModel(1e6, 0.010)).handoff_s(1000, 7) == (0.011, 0.011)
    back = CalibratedCost.from_json(json.loads(json.dumps(c.to_json())))
    assert back.handoff_q == c.handoff_q
    with pytest.raises(SampleError, match="handoff_latency_quantiles_s"):
        CalibratedCost.from_json({**c.to_json(), "handoff_latency_quantiles_s": list(reversed(q))})
    # the cover against a brute-force sum over a fine grid
    spans = [(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.2, 3.3), (5.0, 5.0)]
    c = Cover(spans)
    for a, b in [(-1.0, 10.0), (0.2, 0.7), (1.5, 3.1), (3.25, 3.4), (2.0, 3.0), (4.0, 6.0)]:
        grid = [a + (b - a) * (k + 0.5) / 20000 for k in range(20000)]
        brute = (b - a) * sum(any(x <= t < y for x, y in spans) for t in grid) / len(grid)
        assert c.within(a, b) == pytest.approx(brute, abs=(b - a) / 1000)



def test_the_loop_gap_is_drawn_from_its_levels_by_key():
    import dataclasses

    from pdtb.sim.step_samples import OVERHEAD_QS, overhead_quantiles

    gaps = [i / 1000 for i in range(1001)]  # 0 .. 1 s evenly
    levels = overhead_quantiles(gaps)
    assert len(levels) == len(OVERHEAD_QS) and levels[50] == pytest.approx(0.5) and levels[-1] == 1.0
    assert overhead_quantiles(gaps[:99]) is None  # too few to say
    c = dataclasses.replace(CalibratedCost(Coefficients(c0=1.0), 1024, node_overhead_s=0.25), overhead_q=tuple(levels))
    draws = [c.step_overhead_s(k) for k in range(20000)]
    assert draws[:50] == [c.step_overhead_s(k) for k in range(50)]  # a function of the key alone
    assert sum(d <= 0.5 for d in draws) / len(draws) == pytest.approx(0.5, abs=0.02)
    assert sum(d <= 0.9 for d in draws) / len(draws) == pytest.approx(0.9, abs=0.01)
    # the median overhead is no longer added to every step: the draw takes its place
    assert c.step_s(StepShape(1, 10)) == pytest.approx(1e-3)
    back = CalibratedCost.from_json(json.loads(json.dumps(c.to_json())))
    assert back.overhead_q == c.overhead_q
    with pytest.raises(SampleError, match="non-decreasing"):
        CalibratedCost.from_json({**c.to_json(), "node_overhead_quantiles_s": list(reversed(levels))})


def test_a_step_log_gives_the_loop_gaps_between_steps_that_decoded(tmp_path):
    lines = [{"t": 0.0, "ms": 1.0, "decode": [["a", 2, 40]], "prefill": [], "moves": []},
             {"t": 0.0015, "ms": 1.0, "decode": [["a", 2, 42]], "prefill": [], "moves": []},   # 0.5 ms after
             {"t": 0.0525, "ms": 1.0, "decode": [["a", 2, 44]], "prefill": [], "moves": []},   # 50 ms: rows waited
             {"t": 0.5, "ms": 1.0, "decode": [], "prefill": [["a", "r", 16, 0]], "moves": []}]  # no decode: not counted
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = read_step_log(tmp_path / "log.jsonl")
    assert got.busy_gaps_s == pytest.approx([0.0005, 0.05])
    assert got.gaps_s == pytest.approx([0.0005])  # back to back only: under --b2b-ms
    assert [t for w in got.busy_windows for t in w] == pytest.approx([0.001, 0.0015, 0.0025, 0.0525])  # (start, end)


def test_a_hand_off_landing_is_fitted_from_the_gaps_it_falls_in(tmp_path):
    """Twelve gaps between decoding steps: six of 1 ms with nothing landed, five of 6 ms with one
    hand-off landed in each, one of 20 ms with two (not counted): 6 - 1 = 5 ms a landing."""
    from pdtb.sim.landing_fit import fit_landing, landing_stamps

    lines, t, stamps = [], 0.0, []
    for k in range(12):
        lines.append({"t": round(t, 6), "ms": 2.0, "decode": [["a", 1, 10 + k]], "prefill": [], "moves": []})
        gap = 0.001 if k < 6 else 0.006 if k < 11 else 0.020
        t += 0.002
        stamps += [t + gap / 2] * (0 if k < 6 else 1 if k < 11 else 2)
        t += gap
    lines.append({"t": round(t, 6), "ms": 2.0, "decode": [["a", 1, 30]], "prefill": [], "moves": []})
    (tmp_path / "steps-decode-0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    log = read_step_log(tmp_path / "steps-decode-0.jsonl")
    reqs = [_stamped(0.0, 0.01, s - 0.01, s - 0.009, s - 0.005, (s - 0.004, s, 1000)) for s in stamps]
    assert landing_stamps([{"requests": reqs}]) == sorted(stamps)
    got = fit_landing(log.busy_windows, sorted(stamps))
    assert got["land_s"] == pytest.approx(0.005, abs=2e-6) and (got["gaps_one"], got["gaps_none"]) == (5, 6)
    assert fit_landing(log.busy_windows, sorted(stamps)[:4]) is None  # four gaps with one landing: too few
    # through the command: the calibration carries it, and a simulated decode node pays it
    (tmp_path / "real.json").write_text(json.dumps({"requests": reqs}))
    out = tmp_path / "cal.json"
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "steps-decode-0.jsonl"), "--page-bytes", "2048",
                 "--results", str(tmp_path / "real.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "a hand-off landing 5.000 ms of the decode loop" in r.stdout
    c = CalibratedCost.load(out)
    assert c.land_s == pytest.approx(0.005, abs=2e-6) and c.meta["landing"]["gaps_one"] == 5
    assert CalibratedCost.from_json(json.loads(json.dumps(c.to_json()))).land_s == c.land_s
    # the hand-off latency leaves out the decode node's steps: each 4 ms transfer ends 3 ms into a
    # gap of 6 ms (1 ms in the step before it) or 10 ms into the 20 ms one (none): 3 ms median,
    # less the header's rpc (1 ms) and 1000 bytes' time; a prefill node's steps over every
    # transfer are left in (a simulated payload does not wait for them)
    (tmp_path / "steps-prefill-0.jsonl").write_text(json.dumps(
        {"t": 0.0, "ms": 1000.0, "decode": [], "prefill": [["a", "r", 16, 0]], "moves": []}) + "\n")
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "steps-decode-0.jsonl"), "--step-log",
                 str(tmp_path / "steps-prefill-0.jsonl"), "--fit", "all", "--page-bytes", "2048",
                 "--results", str(tmp_path / "real.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    c = CalibratedCost.load(out)
    assert c.transfer.latency_s == pytest.approx(0.002 - 1000 / c.transfer.bytes_per_s, abs=2e-6)
    assert c.path["steps_left_out"] and c.path["transfers"] == 7 and not c.handoff_q
    r = run_pdtb("sim", "calibrate", "--step-log", str(tmp_path / "steps-decode-0.jsonl"), "--page-bytes", "2048",
                 "--results", str(tmp_path / "real.json"), "--draw-handoff")
    assert r.returncode == 2 and "fewer than 20 hand-offs" in r.stderr
    with pytest.raises(SampleError, match="non-negative"):
        CalibratedCost.from_json({**c.to_json(), "land_s": -1})


def test_each_role_s_step_spread_is_fitted_from_its_logs_and_drawn_by_key(tmp_path):
    """Decode steps measured at 1, 2 and 3 times the fitted time (a third each), prefill steps at
    the fitted time: the decode spread's median is 2, its ends 1 and 3; the draws follow it and
    depend on the key alone; a role with no levels keeps the fitted time."""
    import dataclasses

    from pdtb.sim.calibrate import _spread
    from pdtb.sim.step_samples import OVERHEAD_QS, step_log_role, step_spread

    assert [step_log_role(p) for p in ("a/steps-decode-0.jsonl", "steps-prefill-12.jsonl", "colocated-1.jsonl",
                                       "steps.jsonl")] == ["decode", "prefill", "colocated", None]
    coef = Coefficients(c0=2.0, rows=1.0)
    dec = [StepSample(StepShape(k % 4 + 1, 10), (1 + k % 3) * coef.ms(StepShape(k % 4 + 1, 10))) for k in range(300)]
    pre = [StepSample(StepShape(0, 0, 1, 16, 136), coef.ms(StepShape(0, 0, 1, 16, 136)))] * 150
    got = step_spread({"decode": dec, "prefill": pre, "colocated": dec[:50]}, coef.ms)
    assert set(got) == {"decode", "prefill"}  # (50 colocated steps: too few to say)
    q = got["decode"]
    assert len(q) == len(OVERHEAD_QS) and (q[0], q[50], q[-1]) == pytest.approx((1.0, 2.0, 3.0))
    assert set(got["prefill"]) == {1.0}
    c = dataclasses.replace(CalibratedCost(coef, 1024), spread_q=got)
    draws = [c.step_factor("decode", k) for k in range(6000)]
    assert draws[:40] == [c.step_factor("decode", k) for k in range(40)]  # a function of the key alone
    assert sum(d < 1.5 for d in draws) / len(draws) == pytest.approx(1 / 3, abs=0.03)
    assert c.step_factor("prefill", 7) == 1.0 and c.step_factor("colocated", 7) == 1.0
    back = CalibratedCost.from_json(json.loads(json.dumps(c.to_json())))
    assert back.spread_q == c.spread_q
    for bad in ({"robot": list(q)}, {"decode": list(q)[:5]}, {"decode": list(reversed(q))}, {"decode": [0.0] * len(q)},
                {"decode": [float("nan")] * len(q)}, {"decode": [*q[:-1], float("inf")]}, [list(q)]):
        with pytest.raises(SampleError, match="step_spread_quantiles"):
            CalibratedCost.from_json({**c.to_json(), "step_spread_quantiles": bad})
    with pytest.raises(ValueError):
        _spread({"decode": ["x"] * len(q)})
    # asked for with no step log named by its role: one line, no file
    log = tmp_path / "node.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in _log_lines()))
    r = run_pdtb("sim", "calibrate", "--step-log", str(log), "--page-bytes", "2048", "--draw-step-spread",
                 "--out", str(tmp_path / "cal.json"))
    assert r.returncode != 0 and "--draw-step-spread: no role has 100 logged steps" in r.stderr
    assert not (tmp_path / "cal.json").exists()
