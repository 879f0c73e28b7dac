"""The calibration (pdtb/sim/calibration/): the fit recovers hand-chosen coefficients, `bench steps
--grid` records each composition as a StepShape computed by hand, a hand-written step log gives the
hand-computed shapes and node overhead, the request path is fitted to stamps whose answer is known,
the record is versioned and names its machine, and bad inputs are one line."""
from __future__ import annotations

import json

import pytest
import torch

from tests.project.test_cli import run_pdtb

from pdtb.figures.records import RequestSpec
from pdtb.sim.calibration.fit import Coefficients, fit
from pdtb.sim.calibration.record import Calibration
from pdtb.sim.calibration.samples import SampleError, StepSample, read_step_log
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import StepShape
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape

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

    c = Calibration(TRUE, page_bytes=4096, transfer=LinkModel(1e9, 1e-4), tier=LinkModel(2e9),
                       node_overhead_s=0.002)
    s = StepShape(4, 2048, 1, 128, 139328)
    assert c.step_s(s) == pytest.approx((2 + 2 + 2.048 + 1.5 + 3.84 + 2.78656) / 1e3 + 0.002)
    assert c.step_s(StepShape()) == 0.0
    assert c.transfer_s(10**9) == pytest.approx(1.0001) and c.tier_move_s(10**9) == 0.5
    (tmp_path / "c.json").write_text(json.dumps(c.to_json()))
    back = Calibration.load(tmp_path / "c.json")
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
    assert Calibration.load(out).node_overhead_s == pytest.approx(0.0015)


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
    c = Calibration.load(out)
    assert c.coef.c0 == pytest.approx(2.0, rel=1e-6) and c.coef.attn == pytest.approx(2e-5, rel=1e-6)
    assert c.node_overhead_s == pytest.approx(0.0015) and c.page_bytes == 2048
    doc = json.loads(out.read_text())
    assert doc["fit"]["samples"] == len(SHAPES) and doc["note"] == "log from a test"
    assert doc["command"].startswith(f"pdtb bench steps --grid --json > {tmp_path / 'steps.json'} && pdtb sim calibrate")
    assert doc["machine"] == machine  # the samples' machine and versions travel with the calibration
    assert c.version == 2 and c.describe() == ("calibration cal (v2): random:llama-3-8b bfloat16 on cuda, ? thread(s); fit of "
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
    from pdtb.sim.calibration.record import SHIPPED
    from pdtb.sim.calibration.samples import read_samples

    c = Calibration.load("cpu-tiny-2core")  # by name, from the package data
    assert c.page_bytes == 4 * 2 * 16 * 2 * 32 * 4 and c.source["threads"] == 1
    assert c.source["command"].startswith("pdtb bench steps --grid") and 0 < c.node_overhead_s < 0.01
    samples, head = read_samples(SHIPPED / "samples" / "cpu-tiny-2core.json")
    refit = fit(samples)
    assert head["page_bytes"] == c.page_bytes and refit.samples == c.fit["samples"]
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
    from pdtb.sim.calibration.path import fit_path

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
    c = Calibration.load(out)
    assert c.path["rpc_latency_s"] == pytest.approx(0.003, abs=1e-6) and c.transfer.latency_s == pytest.approx(0.006, abs=1e-6)
    from pdtb.sim.flags import cluster_shape
    from pdtb.sim.run import build_parser

    a = build_parser().parse_args(["--mode", "colocated"])
    shape = cluster_shape(a, c)
    assert (shape.rpc_latency_s, shape.client_latency_s) == (c.path["rpc_latency_s"], c.path["client_latency_s"])
    a = build_parser().parse_args(["--mode", "colocated", "--rpc-latency-ms", "1"])
    assert cluster_shape(a, c).rpc_latency_s == 0.001  # a flag wins


def test_the_hand_off_latency_leaves_out_the_decode_steps_and_the_held_transfers():
    from pdtb.sim.calibration.path import Cover, fit_path

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
    # the cover against a brute-force sum over a fine grid
    spans = [(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.2, 3.3), (5.0, 5.0)]
    c = Cover(spans)
    for a, b in [(-1.0, 10.0), (0.2, 0.7), (1.5, 3.1), (3.25, 3.4), (2.0, 3.0), (4.0, 6.0)]:
        grid = [a + (b - a) * (k + 0.5) / 20000 for k in range(20000)]
        brute = (b - a) * sum(any(x <= t < y for x, y in spans) for t in grid) / len(grid)
        assert c.within(a, b) == pytest.approx(brute, abs=(b - a) / 1000)


def test_the_record_is_versioned_and_refuses_what_the_simulator_does_not_model(tmp_path):
    c = Calibration(TRUE, 4096, machine={"cpu": "x", "cores": 2, "versions": {"torch": "2.13.0"}},
                    source={"model": "m", "dtype": "float32", "device": "cpu", "threads": 1})
    doc = c.to_json()
    assert doc["version"] == 2 and doc["machine"]["cores"] == 2
    assert Calibration.from_json(doc) == c and Calibration.from_json(doc).machine == c.machine
    v1 = {**doc, "version": 1}
    v1.pop("machine")
    old = Calibration.from_json(v1)  # a version 1 file of kept quantities reads as it is
    assert old.version == 1 and old.step_s(StepShape(1, 8)) == c.step_s(StepShape(1, 8))
    assert "machine and versions not recorded" in old.describe()
    for key, flag in (("step_spread_quantiles", "--draw-step-spread"), ("step_contention", "--contention"),
                      ("handoff_latency_quantiles_s", "--draw-handoff"), ("land_s", "landing")):
        with pytest.raises(SampleError, match=f"holds {key}.*{flag}"):
            Calibration.from_json({**v1, key: 0.5})
    with pytest.raises(SampleError, match="path.delivery.*--draw-delivery"):
        Calibration.from_json({**v1, "path": {"rpc_latency_s": 0.001, "delivery": {"first": [0.0]}}})
    with pytest.raises(SampleError, match="version 3"):
        Calibration.from_json({**doc, "version": 3})
    (tmp_path / "bad.json").write_text(json.dumps({**doc, "coef_ms": {**doc["coef_ms"], "c0": -1}}))
    r = run_pdtb("sim", "--workload", "whale-minnow", "--duration", "1", "--cost", "calibrated",
                 "--calibration", str(tmp_path / "bad.json"), "--quiet")
    assert r.returncode == 2 and "bad calibration" in r.stderr and "Traceback" not in r.stderr


def test_every_shipped_calibration_is_version_2_and_names_its_machine():
    from pdtb.sim.calibration.record import SHIPPED

    for p in sorted(SHIPPED.glob("*.json")):
        c = Calibration.load(p.stem)
        assert c.version == 2 and c.machine.get("versions", {}).get("torch"), p.name
        assert "not recorded" not in c.describe(), p.name

COEF = Coefficients(c0=2.0, rows=0.5, chunks=1.5, tokens=0.03)  # ms


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


def _ttfts(cost, specs, **shape):
    nodes = (NodeShape("prefill", 256), NodeShape("decode", 256))
    c = SimCluster(ClusterShape(nodes, rpc_latency_s=0.0, client_latency_s=0.0, **shape), page_spec(1024, 16), cost)
    recs = c.run(specs)
    assert all(r.status == "ok" for r in recs)
    return [r.first_token_time - r.send_time for r in recs]


def test_a_new_request_s_dispatch_grows_with_its_prompt():
    cost = Calibration(Coefficients(c0=10.0), 1024)
    specs = [RequestSpec(0.0, "a", "x", 10, 2), RequestSpec(1.0, "b", "x", 1010, 2)]
    base = _ttfts(cost, specs)
    got = _ttfts(cost, specs, dispatch_s_per_token=1e-5)
    assert [g - b for g, b in zip(got, base)] == pytest.approx([1e-4, 1.01e-2], abs=1e-9)
    with pytest.raises(ValueError, match="latencies"):
        ClusterShape((NodeShape("colocated", 8),), dispatch_s_per_token=-1.0)


def _stamped_mode(mode_ov: float, tokens: int, disp: float, i: int) -> dict:
    send, arrival = 1.0 * i, 100.0 + i
    queued, first = arrival + disp, arrival + disp + 0.005
    return {"status": "ok", "send_time": send, "first_token_time": send + (first - arrival) + mode_ov,
            "prompt_tokens": tokens, "server_timing": {"stamps": {"router_arrival": arrival, "prefill_queued": queued,
                                                                  "first_token": first}}}


def test_the_path_is_a_median_line_in_the_prompt_and_fitted_per_mode():
    from pdtb.sim.calibration.path import fit_path, median_line

    xs = [24, 24, 24, 1024, 1024, 1984, 1984, 1984, 500, 24]
    ys = [0.001 + 2e-6 * x for x in xs]
    ys[0], ys[5] = 0.02, 0.03  # two slow dispatches do not tilt a median line
    a, b = median_line(xs, ys)
    assert a == pytest.approx(0.001, abs=1e-6) and b == pytest.approx(2e-6, rel=1e-3)
    assert median_line([5, 5, 5], [0.001, 0.002, 0.009]) == (0.002, 0.0)  # one prompt size: the median
    assert median_line([1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0]) == (2.5, 0.0)  # never a negative slope
    # dispatch 1 ms + 2 us a token in both modes; outside the stamps 3 ms colocated, 5 ms disaggregated
    col = [_stamped_mode(0.003, t, 0.001 + 2e-6 * t, i) for i, t in enumerate([24, 24, 1024, 1984, 24, 500])]
    dis = [_stamped_mode(0.005, t, 0.001 + 2e-6 * t, i) for i, t in enumerate([24, 1024, 24, 1984, 24, 500])]
    got = fit_path([{"meta": {"mode": "colocated"}, "requests": col}, {"meta": {"mode": "disagg"}, "requests": dis}], 1e6)
    assert got["rpc_latency_s"] == pytest.approx(0.001, abs=1e-6)
    assert got["dispatch_s_per_token"] == pytest.approx(2e-6, rel=1e-3)
    m = got["modes"]
    assert m["colocated"]["client_latency_s"] == pytest.approx((0.003 - 0.001) / 2, abs=1e-6)
    assert m["disagg"]["client_latency_s"] == pytest.approx((0.005 - 0.001) / 2, abs=1e-6)
    # a simulated cluster takes its own mode's path
    from pdtb.sim.flags import cluster_shape
    from pdtb.sim.run import build_parser

    cost = Calibration(COEF, 1024, path=got)
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
        got[bool(flag)] = Calibration.load(out)
    shape = StepShape(0, 0, 1, 64, 2080)  # a prefill chunk: the grid's alone, never logged
    assert got[True].coef.ms(shape) == pytest.approx(COEF.ms(shape), rel=1e-3)
    assert got[False].coef.ms(shape) > 1.2 * COEF.ms(shape)
    (src,) = [s for s in got[True].fit["sources"] if s["kind"] == "step-samples"]
    assert src["scaled"] == pytest.approx(1 / 1.3, rel=1e-4)
    r = run_pdtb("sim", "calibrate", "--steps", str(slow), "--fit", "steps", "--step-log", logs[0], "--scale-grid",
                 "--out", str(tmp_path / "x.json"))
    assert r.returncode != 0 and "--scale-grid: takes --fit all" in r.stderr


def test_step_check_sets_each_run_s_steps_against_the_fit(tmp_path):
    """Two runs' decode logs: fcfs's steps at the fit (2 + 0.5 x rows ms), memfair's at twice it
    with a 3 ms demotion in one step (not step time); memfair's ratio is 2.0 by hand."""
    from pdtb.sim.repro.step_check import check_dir

    cal = Calibration(COEF, 2048)
    for policy, k in (("fcfs", 1.0), ("memfair", 2.0)):
        run = tmp_path / f"run-disagg-{policy}"
        run.mkdir()
        rows = [{"t": 0.01 * i, "ms": k * COEF.ms(StepShape(2, 40)) + (3.0 if i == 1 else 0.0),
                 "decode": [["t", 2, 40]], "prefill": [], "moves": [["demote", "r", 4, 3.0]] if i == 1 else []}
                for i in range(4)]
        (run / "steps-decode-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {r["policy"]: r for r in check_dir(tmp_path, cal)}
    assert got["fcfs"]["ratio"] == 1.0 and got["memfair"]["ratio"] == 2.0
    assert got["memfair"]["moves"] == 1 and got["memfair"]["moves_s"] == 0.003 and got["fcfs"]["steps"] == 4
    assert got["memfair"]["role"] == "decode" and got["memfair"]["mode"] == "disagg"
    (tmp_path / "cal.json").write_text(json.dumps(cal.to_json()))
    r = run_pdtb("sim", "step-check", str(tmp_path), "--calibration", str(tmp_path / "cal.json"), "--sim-args")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["disagg fcfs --step-scale decode=1.0", "disagg memfair --step-scale decode=2.0"]
    r = run_pdtb("sim", "step-check", str(tmp_path / "none"), "--calibration", "cpu-tiny-2core")
    assert r.returncode == 2 and "no run-MODE-POLICY" in r.stderr
    for bad in ("router=2", "decode=x", "decode=0"):
        r = run_pdtb("sim", "--workload", "whale-minnow", "--duration", "1", "--step-scale", bad, "--quiet")
        assert r.returncode == 2 and "--step-scale" in r.stderr and "Traceback" not in r.stderr, r.stderr
