"""The simulated client sends as pdtb/client/load.py does: closed loop (N in flight, the next
sent when one ends at the client, send times ignored) and --max-concurrency (open loop, an
arrival past the limit waits for a slot)."""
from __future__ import annotations

import pytest

from pdtb.figures.records import RequestSpec
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import FixedStepCost
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape
from tests.project.test_cli import run_pdtb


def _cluster() -> SimCluster:
    return SimCluster(ClusterShape((NodeShape("colocated", 512),), rpc_latency_s=1e-4, client_latency_s=5e-4),
                      page_spec(64, 16), FixedStepCost(0.01, 64))


def _specs(n: int) -> list[RequestSpec]:
    return [RequestSpec(0.25 * i, f"t{i % 2}", "x", 20 + 3 * i, 5 + i % 4) for i in range(n)]


def _max_in_flight(recs) -> int:
    edges = sorted([(r.send_time, 1) for r in recs] + [(r.end_time, -1) for r in recs])
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


@pytest.mark.parametrize("n", [1, 3])
def test_closed_loop_keeps_n_in_flight_each_sent_when_one_ended(n):
    recs = _cluster().run(_specs(12), concurrency=n)
    assert all(r.status == "ok" and r.output_tokens == r.requested_output_tokens for r in recs)
    assert all(r.scheduled_time == r.send_time for r in recs)  # send times of the specs are ignored
    assert [r.send_time for r in recs[:n]] == [0.0] * n
    ends = sorted(r.end_time for r in recs)
    # request n + k goes out when the k-th of those before it ended, in their order of ending
    assert [r.send_time for r in recs[n:]] == ends[:len(recs) - n]
    assert _max_in_flight(recs) == n


def test_max_concurrency_makes_arrivals_wait_for_a_slot():
    specs = [RequestSpec(0.0, "t", "x", 30, 8) for _ in range(6)]  # a burst
    recs = _cluster().run(specs, max_concurrency=2)
    assert all(r.status == "ok" and r.scheduled_time == 0.0 for r in recs)
    assert [r.send_time for r in recs[:2]] == [0.0, 0.0]
    ends = sorted(r.end_time for r in recs)
    assert [r.send_time for r in recs[2:]] == ends[:4]  # each waited for the next slot
    assert _max_in_flight(recs) == 2
    free = _cluster().run(specs)  # without the limit, all at once
    assert _max_in_flight(free) == 6 and all(r.send_time == 0.0 for r in free)


def test_the_command_runs_a_closed_loop_and_refuses_what_it_cannot(tmp_path):
    out = tmp_path / "r.json"
    base = ["sim", "--workload", "multi-tenant", "--duration", "2", "--rate", "4", "--mode", "colocated",
            "--cost", "roofline", "--gpu", "h100-sxm", "--model-config", "llama-3-8b", "--quiet"]
    r = run_pdtb(*base, "--concurrency", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    import json

    doc = json.loads(out.read_text())
    assert doc["meta"]["arrival"] == "simulated closed-loop x3"
    assert _max_in_flight([_Rec(q) for q in doc["requests"]]) == 3
    for bad, needle in ((["--concurrency", "0"], "above 0"), (["--concurrency", "2", "--rates", "1,2"], "closed-loop"),
                        (["--concurrency-levels", "1,2"], "real client")):
        r = run_pdtb(*base, *bad)
        assert r.returncode == 2 and needle in r.stderr, (bad, r.stderr)


class _Rec:
    def __init__(self, d: dict) -> None:
        self.send_time, self.end_time = d["send_time"], d["end_time"]
