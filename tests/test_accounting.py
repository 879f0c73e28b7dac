"""Node accounting driven by a real scheduler step by step (fake clock, fake forward pass):
the turn wait of rows the read share leaves out, and its place in the SLO breakdown."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.accounting import NodeAccounting
from cluster.node_metrics import NodeMetrics
from fairness import FairnessConfig, make_policy
from sched_sim import apply_step, make_request, make_scheduler

DT = 0.01  # seconds per fake step


def node_for(sched, seqs, cfg):
    eng = SimpleNamespace(pool=sched.pool, host_pool=sched.host_pool, scheduler=sched)
    return SimpleNamespace(engine=eng, seqs={s.request_id: s for s in seqs}, metrics=NodeMetrics("colocated", "t"),
                           config=SimpleNamespace(fairness=cfg), policy=sched.policy)


@pytest.mark.parametrize("read_share", [True, False])
def test_turn_wait_counts_the_steps_a_resident_row_was_left_out(read_share):
    cfg = FairnessConfig(read_share=read_share, read_turn_steps=4, slo_tpot_s={"*": 0.001})
    sched = make_scheduler(make_policy("memfair", cfg), num_pages=200, budget=512)
    whales = [make_request(236, 400, tenant="w", arrival=i) for i in range(3)]
    minnow = make_request(8, 200, tenant="m", arrival=10)
    for w in whales:
        sched.add(w)
    acct = NodeAccounting(node_for(sched, [*whales, minnow], cfg))
    unserved = dict.fromkeys((s.request_id for s in [*whales, minnow]), 0)
    t = 0.0
    for step in range(40):
        if step == 4:
            sched.add(minnow)
        out = sched.schedule()
        acct.on_output(out, t)
        served = {c.seq.request_id for c in out.chunks}
        for s in [*whales, minnow]:
            if s.status.name == "RUNNING" and s.num_output_tokens and s.request_id not in served:
                unserved[s.request_id] += 1
        apply_step(sched, out)
        t += DT
    t_last = t - DT
    for s in [*whales, minnow]:
        tl = s.timeline
        still = t_last - tl["turn_wait_since"] + DT if "turn_wait_since" in tl else 0.0  # an open wait
        assert tl.get("turn_wait_s", 0.0) + still == pytest.approx(unserved[s.request_id] * DT), s.request_id
    if read_share:
        assert all(unserved[w.request_id] > 0 for w in whales) and unserved[minnow.request_id] == 0
        w = max(whales, key=lambda w: w.timeline.get("turn_wait_s", 0.0))
        w.timeline.update(router_arrival=0.0, prefill_queued=0.0, prefill_start=0.0, first_token=0.0, last_token=t)
        slo = acct.final_timing(w)["slo"]
        assert slo["components"]["turn_wait"] == pytest.approx(w.timeline["turn_wait_s"])
        assert slo["cause"] in ("turn_wait", "decode_compute")
    else:
        assert not any(unserved.values())
        assert all("turn_wait_s" not in s.timeline for s in [*whales, minnow])
