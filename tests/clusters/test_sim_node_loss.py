"""A decode node lost under load, real and simulated: the chaos run of tests/clusters/
test_recompute.py (40 greedy streams on 1P+2D, the decode nodes' KV reads capped so that the
streams decode for seconds, kill -9 of a decode node once 20 streams have started), then the same
requests through the simulator with that node killed at the same event: once 20 of its streams
have had two tokens. The kill is placed by that event, not by the real run's wall-clock moment, so
a machine slower or busier than the calibrated one does not move it. Both end every request with
all its tokens, and recompute about as many."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from cluster_util import get_json, launched
from fairness.config import FairnessConfig
from pdtb.figures.records import RequestSpec
from pdtb.sim.calibration.record import Calibration
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.faults import Kill
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape

STREAMS, TOKENS, CAP = 40, 48, 4e7


def _recomputes(url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("pdtb_router_recomputes_total "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.slow
def test_a_simulated_decode_node_loss_recomputes_as_the_real_one(llama_dir, tmp_path):
    from chaos_util import http_client, stream, until

    rng = random.Random(3)
    lengths = [rng.choice((8, 24, 40)) for _ in range(STREAMS)]
    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  "--kv-pages", "800", "--decode-args", f"--tenant-bw-cap {CAP:g}") as (url, run_dir):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        prompts = [[rng.randrange(16, vocab) for _ in range(n)] for n in lengths]

        async def go():
            started: list = []
            async with http_client() as s:
                t0 = time.monotonic()
                tasks = [asyncio.ensure_future(stream(s, url, p, TOKENS, started=started)) for p in prompts]
                await until(lambda: len(started) >= STREAMS // 2, 60, "streams to start")
                os.kill(int((run_dir / "decode-0.pid").read_text()), signal.SIGKILL)
                kill_s = time.monotonic() - t0
                return kill_s, await asyncio.wait_for(asyncio.gather(*tasks), 120)

        kill_s, outs = asyncio.run(go())
        real = _recomputes(url)
    assert all(o.ok and len(o.token_ids) == TOKENS for o in outs)

    cost = Calibration.load("cpu-tiny-2core")
    capped = FairnessConfig(tenant_bw_cap=CAP)
    shape = ClusterShape((NodeShape("prefill", 800), NodeShape("decode", 800, fairness=capped),
                          NodeShape("decode", 800, fairness=capped)))
    specs = [RequestSpec(0.0, "default", "x", n, TOKENS) for n in lengths]
    calm = SimCluster(ClusterShape(shape.nodes), page_spec(cost.page_bytes, 16), cost).run(specs)
    at = sorted(r.token_times[1] for r in calm)[STREAMS // 2 - 1]  # the 20th stream's second token
    c = SimCluster(ClusterShape(shape.nodes, kills=(Kill("decode-1", at),)), page_spec(cost.page_bytes, 16), cost)
    recs = c.run(specs)
    assert all(r.status == "ok" and len(r.token_times) == TOKENS for r in recs)
    sim = c.faults.figures()["recomputes"]
    print(f"decode node killed at {kill_s:.2f} s real, {at:.2f} s simulated: recomputed {real:g} real, {sim} simulated")
    assert real > 0 and sim > 0
    assert abs(sim - real) <= max(4, 0.3 * real), (sim, real, kill_s)
