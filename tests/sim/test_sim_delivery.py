"""A token's way to the client drawn token by token (pdtb/sim/delivery.py): fitted from
hand-written results and step logs whose delays are known, drawn by request and position alone,
and applied by the simulator as worked out by hand."""
from __future__ import annotations

import json

import pytest

from tests.project.test_cli import run_pdtb
from tests.sim.test_sim_coast import SHAPES, _figures, _workload

from pdtb.figures.records import RequestSpec
from pdtb.sim import delivery
from pdtb.sim.calibrate import CalibratedCost, Coefficients
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape
from pdtb.sim.step_samples import OVERHEAD_QS

T0 = 1000.0  # the client's time 0 on the wall clock
N = len(OVERHEAD_QS)


def _flat(x: float) -> list[float]:
    return [x] * N


def _run(n_requests: int, skip: int | None = None):
    """A results file and a decode node's step ends: request i (prompt 100 * i tokens) reaches
    the router at 10 + i s, its first token leaves 5 ms later and reaches the client 2 ms + 1 us
    per prompt token after that, its leg up 0.5 ms + 0.1 us a token; its 10 later tokens leave
    at the ends of the next 10 decoding steps (3 ms apart) and arrive 1 ms after (the second 6 ms
    after: read late). Request `skip` sits out one step: not matched, left out."""
    reqs, ends = [], []
    for i in range(n_requests):
        arrival, prompt = 10.0 + i, 100 * i
        first = arrival + 0.005
        steps = [first + 0.003 * (k + 1) for k in range(11)]
        ends += steps
        mine = steps[:10] if i != skip else steps[1:11]
        down, up = 0.002 + 1e-6 * prompt, 0.0005 + 1e-7 * prompt
        send = arrival - up - T0
        times = [first + down - T0] + [t + (0.006 if k == 1 else 0.001) - T0 for k, t in enumerate(mine)]
        reqs.append({"status": "ok", "prompt_tokens": prompt, "send_time": send, "first_token_time": times[0],
                     "token_times": times,
                     "server_timing": {"stamps": {"router_arrival": arrival, "prefill_queued": arrival + 0.001,
                                                  "first_token": first, "last_token": mine[-1]}}})
    return {"meta": {"start_time": T0, "mode": "disagg"}, "requests": reqs}, sorted(ends)


def test_each_position_s_delay_and_the_legs_are_fitted_as_worked_by_hand():
    doc, ends = _run(30, skip=7)
    at, firsts = delivery.delays(doc, [ends])
    assert len(at[0]) == 30 and len(firsts) == 30
    assert [len(x) for x in at[1:]] == [29] * 7 + [29 * 3]  # request 7 sat out a step: left out
    assert at[2] == pytest.approx([0.006] * 29)
    assert at[1] == pytest.approx([0.001] * 29) and at[3] == pytest.approx([0.001] * 29)
    got = delivery.fit_delivery([(doc, [ends])])
    assert got["first_s_per_token"] == pytest.approx(1e-6, rel=1e-3)
    assert got["up_s"] == pytest.approx(0.0005, abs=1e-7) and got["up_s_per_token"] == pytest.approx(1e-7, rel=1e-2)
    assert got["positions"][0] == pytest.approx(_flat(0.002), abs=1e-7)  # less the part per prompt token
    assert got["positions"][2] == pytest.approx(_flat(0.006), abs=1e-7)
    assert got["positions"][1] == got["later"] == pytest.approx(_flat(0.001), abs=1e-7)
    assert got["tokens"] == [30] + [29] * 7 + [87]
    few, few_ends = _run(19)
    assert delivery.fit_delivery([(few, [few_ends])]) is None  # 19 first tokens: too few
    assert delivery.delays({"requests": doc["requests"]}, [ends]) == ([[] for _ in range(9)], [])  # no start_time


def test_draws_depend_on_the_request_and_position_alone():
    levels = {"positions": [[0.001 + 0.002 * q for q in OVERHEAD_QS], _flat(0.004), None],
              "later": _flat(0.0005), "first_s_per_token": 1e-6, "up_s": 0.0003, "up_s_per_token": 1e-8}
    d = delivery.Delivery(levels)
    firsts = [d.delay_s(i, 0, 0) for i in range(400)]
    assert min(firsts) >= 0.001 and max(firsts) <= 0.003 and len(set(firsts)) > 300
    assert d.delay_s(5, 0, 1000) == pytest.approx(d.delay_s(5, 0, 0) + 1e-3)  # the first token's part per prompt token
    assert d.delay_s(5, 1, 1000) == 0.004 and d.delay_s(5, 2, 0) == d.delay_s(5, 30, 0) == 0.0005
    assert d.up(1000) == pytest.approx(0.00031)
    assert [d.delay_s(9, k, 7) for k in range(5)] == [d.delay_s(9, k, 7) for k in range(5)]
    for bad in ({**levels, "later": [0.001] * 3}, {**levels, "positions": [None]}, {**levels, "up_s": -1.0},
                {**levels, "later": list(reversed([0.001 * q for q in OVERHEAD_QS]))}):
        with pytest.raises(ValueError, match="delivery"):
            delivery.Delivery(bad)
        with pytest.raises(ValueError, match="delivery"):
            ClusterShape((NodeShape("colocated", 8),), delivery=bad)


def _one(levels: dict, prompt: int = 16):
    nodes = (NodeShape("colocated", 256),)
    shape = ClusterShape(nodes, rpc_latency_s=0.0, client_latency_s=0.0, delivery=levels)
    c = SimCluster(shape, page_spec(1024, 16), CalibratedCost(Coefficients(c0=10.0), 1024))
    (rec,) = c.run([RequestSpec(0.0, "a", "x", prompt, 4)])
    assert rec.status == "ok"
    return rec


def test_a_token_read_late_is_read_with_the_next_and_the_legs_add_as_worked_by_hand():
    """Every step 10 ms (c0 alone); first token 2 ms + 1 us per prompt token to the client,
    the second 25 ms (after the third and fourth left their node, 1 ms each: the three come in one
    read); the leg up 0.5 ms."""
    levels = {"positions": [_flat(0.002), _flat(0.025), _flat(0.001)], "later": _flat(0.001),
              "first_s_per_token": 1e-6, "up_s": 0.0005}
    rec = _one(levels, prompt=16)
    sent = rec.send_time
    up, first = 0.0005, 0.002 + 16e-6
    assert rec.first_token_time - sent == pytest.approx(up + 0.010 + first, abs=2e-6)
    steps = [sent + up + 0.010 * (k + 1) for k in range(4)]  # the first token's prefill step, then three decoding
    want = [steps[0] + first] + [steps[1] + 0.025] * 3
    assert rec.token_times == pytest.approx(want, abs=2e-6)
    assert rec.end_time == pytest.approx(want[-1], abs=2e-6)
    levels["positions"][1] = _flat(0.001)
    assert _one(levels, prompt=16).token_times == pytest.approx([steps[0] + first] + [t + 0.001 for t in steps[1:]],
                                                                abs=2e-6)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_drawn_deliveries_are_the_same_with_runs_of_steps_taken_at_once(monkeypatch, shape):
    import fairness
    from fairness.config import FairnessConfig
    from tests.sim import test_sim_coast
    from tests.sim.test_sim_coast import COST

    monkeypatch.setattr(test_sim_coast, "Policy", fairness.POLICIES["memfair"], raising=False)

    levels = {"positions": [[0.001 + 0.2 * q ** 6 for q in OVERHEAD_QS]] * 3,
              "later": [0.0006 + 0.2 * q ** 8 for q in OVERHEAD_QS], "first_s_per_token": 2e-7, "up_s": 0.0008}
    specs = _workload(seed=5)
    got = []
    for coast in (False, True):
        c = SimCluster(ClusterShape(SHAPES[shape](FairnessConfig()), coast=coast, delivery=levels),
                       page_spec(COST.page_bytes, 16), COST)
        c.run(specs)
        got.append(c)
    assert sum(n.coasted for n in got[1].nodes.values()) > 0
    assert _figures(got[0]) == _figures(got[1])
    times = [r.token_times for r in got[1].records.values()]
    assert all(b >= a for tt in times for a, b in zip(tt, tt[1:]))
    assert sum(b == a for tt in times for a, b in zip(tt, tt[1:])) > 0  # some tokens came in one read


def test_calibrate_draws_delivery_from_results_and_their_step_logs(tmp_path):
    doc, ends = _run(10)
    results = tmp_path / "disagg-fcfs.json"
    results.write_text(json.dumps(doc))
    run = tmp_path / "run"
    run.mkdir()
    log = run / "steps-decode-0.jsonl"
    log.write_text("".join(json.dumps({"t": round(e - 0.002, 6), "ms": 2.0, "decode": [["t", 1, 40]], "prefill": [],
                                       "moves": []}) + "\n" for e in ends))
    grid = tmp_path / "steps.json"
    grid.write_text(json.dumps({"kind": "step-samples", "page_bytes": 2048, "samples": [
        {"decode_rows": r, "decode_ctx": 10 * r, "prefill_chunks": 0, "prefill_tokens": 0, "prefill_attn": 0,
         "ms": 1.0 + r} for r in (1, 2, 4, 8)]}))
    out = tmp_path / "cal.json"
    args = ["sim", "calibrate", "--steps", str(grid), "--fit", "steps", "--results", str(results), "--out", str(out)]
    r = run_pdtb(*args, "--step-log", str(log), "--draw-delivery")
    assert r.returncode != 0 and "--draw-delivery: the --results runs and their decode-side" in r.stderr  # 10 first
    assert not out.exists()
    for k in range(2):  # two more runs of the same requests: enough first tokens
        doc_k = json.loads(results.read_text())
        (tmp_path / f"r{k}.json").write_text(json.dumps(doc_k))
        args += ["--results", str(tmp_path / f"r{k}.json")]
    r = run_pdtb(*args, "--step-log", str(log), "--draw-delivery")
    assert r.returncode == 0, r.stderr
    path = CalibratedCost.load(out).path
    for got in (path["delivery"], path["modes"]["disagg"]["delivery"]):
        assert got["positions"][1] == pytest.approx(_flat(0.001), abs=1e-6)
        assert got["positions"][2] == pytest.approx(_flat(0.006), abs=1e-6)
    from pdtb.sim.flags import cluster_shape
    from pdtb.sim.run import build_parser

    shape = cluster_shape(build_parser().parse_args(["--mode", "disagg"]), CalibratedCost.load(out))
    assert shape.delivery == path["modes"]["disagg"]["delivery"]
