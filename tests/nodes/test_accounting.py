"""Node accounting driven by a real scheduler step by step (fake clock, fake forward pass):
the turn wait of rows the bandwidth cap leaves out, and its place in the SLO breakdown."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pdtb.nodes.accounting import NodeAccounting
from pdtb.nodes.node_metrics import NodeMetrics
from fairness import FairnessConfig, make_policy
from sched_sim import apply_step, make_request, make_scheduler

DT = 0.01  # seconds per fake step


def node_for(sched, seqs, cfg):
    eng = SimpleNamespace(pool=sched.pool, host_pool=sched.host_pool, scheduler=sched)
    return SimpleNamespace(engine=eng, seqs={s.request_id: s for s in seqs}, metrics=NodeMetrics("colocated", "t"),
                           config=SimpleNamespace(fairness=cfg), policy=sched.policy)


@pytest.mark.parametrize("capped", [True, False])
def test_turn_wait_counts_the_steps_a_resident_row_was_left_out(capped):
    from sched_sim import SPEC, FakeClock

    cap = 400 * SPEC.bytes_per_page if capped else None  # 4 pages a step: a whale's 60 take turns
    cfg = FairnessConfig(slo_tpot_s={"*": 0.001}, tenant_bw_cap=cap)
    clock = FakeClock()
    sched = make_scheduler(make_policy("memfair", cfg), num_pages=200, budget=512, clock=clock)
    whales = [make_request(236, 400, tenant="w", arrival=i) for i in range(3)]
    minnow = make_request(8, 200, tenant="m", arrival=10)
    for w in whales:
        sched.add(w)
    acct = NodeAccounting(node_for(sched, [*whales, minnow], cfg))
    unserved = dict.fromkeys((s.request_id for s in [*whales, minnow]), 0)
    t = 0.0
    for step in range(40):
        clock.t = t
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
        still = t_last - tl.turn_wait_since + DT if tl.turn_wait_since is not None else 0.0  # an open wait
        assert tl.turn_wait_s + still == pytest.approx(unserved[s.request_id] * DT), s.request_id
    if capped:
        assert all(unserved[w.request_id] > 0 for w in whales)
        w = max(whales, key=lambda w: w.timeline.turn_wait_s)
        w.timeline = dataclasses.replace(w.timeline, router_arrival=0.0, prefill_queued=0.0, prefill_start=0.0,
                                         first_token=0.0, last_token=t)
        slo = acct.final_timing(w)["slo"]
        assert slo["components"]["turn_wait"] == pytest.approx(w.timeline.turn_wait_s) and w.timeline.turn_wait_s > 0
        assert slo["cause"] in ("turn_wait", "decode_compute")
    else:
        assert not any(unserved.values())
        assert all(s.timeline.turn_wait_s == 0 and "turn_wait_s" not in s.timeline.to_dict() for s in [*whales, minnow])


def test_attention_reads_are_metered_through_the_last_step_and_forgotten_on_abort():
    """The engine frees a request's pages in the step that finishes it, before accounting
    sees the step: the read is counted from the tokens computed, not the pages still held.
    An aborted request's meters are dropped, not kept forever."""
    cfg = FairnessConfig()
    sched = make_scheduler(make_policy("fcfs", cfg), num_pages=64, budget=64)
    one, three = make_request(40, 1, rid="one"), make_request(40, 3, rid="three")
    acct = NodeAccounting(node_for(sched, [one, three], cfg))
    page_bytes, ps = sched.pool.bytes_per_page, sched.pool.spec.page_size
    want = {"one": 0, "three": 0}
    for s in (one, three):
        sched.add(s)
    finals = {}
    for i in range(5):
        out = sched.schedule()
        done = apply_step(sched, out)  # the fake forward pass; finishing frees the pages, as engine.step does
        for c in out.chunks:  # by hand: pages covering the tokens attended this step
            want[c.seq.request_id] += -(-c.seq.num_computed_tokens // ps) * page_bytes
        acct.on_output(out, i * DT)
        for s in done:
            finals[s.request_id] = acct.final_timing(s)["kv_bytes"]["attn_read"]
    assert finals == want and want["one"] == 10 * page_bytes
    for k in range(50):
        s = make_request(8, 50, rid=f"ab{k}")
        sched.add(s)
        out = sched.schedule()
        apply_step(sched, out)
        acct.on_output(out, 1.0)
        sched.abort(s.request_id)
        acct.forget(s.request_id)  # what the node does when a request ends without a final event
    assert not acct.meter.per_request and not acct.meter.tenant_of


def move(kind: str) -> SimpleNamespace:
    """A tier move of the request "long" as a scheduler step reports it."""
    return SimpleNamespace(request_id="long", kind=kind, num_pages=0, num_bytes=0, seconds=0.0)


def attributed_run(cfg, steps: int, at_step, host_pages: int = 0):
    """A 40-token request "long" through `steps` scheduler steps of DT seconds with node
    accounting, `at_step(step, sched, seq, out)` changing each step's output first; its SLO
    attribution and timeline at the end."""
    from fairness.attribution import attribute

    sched = make_scheduler(make_policy("fcfs", cfg), num_pages=64, host_pages=host_pages, budget=8)
    seq = make_request(40, 4, rid="long")
    acct = NodeAccounting(node_for(sched, [seq], cfg))
    sched.add(seq)
    t = 0.0
    seq.timeline.router_arrival = seq.timeline.prefill_queued = seq.timeline.prefill_start = t
    for step in range(steps):
        out = sched.schedule()
        at_step(step, sched, seq, out)
        apply_step(sched, out)
        acct.on_output(out, t)
        if any(c.wants_logits for c in out.chunks):
            seq.timeline.stamp_once("first_token", t)
        t += DT
    seq.timeline.last_token = t
    return attribute(seq.timeline, seq.num_output_tokens, 0, cfg), seq.timeline


def test_recompute_before_the_first_token_is_part_of_ttft():
    """A request preempted before its first token waits for recompute inside its TTFT, not in
    its decode phase (not blamed on 'prefill', with a negative decode)."""
    def preempt_mid_prefill(step, sched, seq, out):
        if step == 2:  # mid-prefill: preempted (as a victim would be), recomputed from scratch
            sched.preempt(seq)
            out.moves.append(move("preempt"))
            out.chunks = []

    slo, tl = attributed_run(FairnessConfig(slo_ttft_s={"*": 0.001}), 20, preempt_mid_prefill)
    comp = slo["components"]
    assert comp["recompute_before_first_token"] > 0 and comp["recompute"] == 0.0
    assert comp["prefill"] + comp["recompute_before_first_token"] == pytest.approx(tl.first_token)
    assert slo["cause"] in ("prefill", "recompute_before_first_token")


def test_parked_before_the_first_token_is_part_of_ttft_and_counted_once():
    """A request demoted mid-prefill and promoted back: the time in the host tier is part of its
    TTFT (parked_before_first_token), not also its decode phase's parked_in_host (which left
    decode_compute at 0 and the components summing past the request's span)."""
    def park_mid_prefill(step, sched, seq, out):
        if 2 <= step < 7:  # mid-prefill: demoted to the host tier for five steps
            out.chunks = []
        if step in (2, 7):
            out.moves.append(move("demote" if step == 2 else "promote"))

    slo, tl = attributed_run(FairnessConfig(), 30, park_mid_prefill, host_pages=64)
    comp = slo["components"]
    assert comp["parked_before_first_token"] == pytest.approx(5 * DT) and comp["parked_in_host"] == 0.0
    assert comp["prefill"] + comp["parked_before_first_token"] == pytest.approx(tl.first_token)
    assert comp["decode_compute"] == pytest.approx(tl.last_token - tl.first_token)


def test_per_tenant_figures_are_kept_for_a_bounded_number_of_tenants(monkeypatch):
    """Tenant names come from clients: uncapped, 2,000 distinct ones grow every node's /metrics
    by 1.5 MB and its stats reply to each ping alike, without limit. Past the cap, later
    tenants count under "_other"."""
    import pdtb.nodes.accounting as accounting

    monkeypatch.setattr(accounting, "MAX_TENANT_LABELS", 3)
    cfg = FairnessConfig()
    sched = make_scheduler(make_policy("fcfs", cfg), num_pages=400, budget=4096)
    seqs = [make_request(20, 2, tenant=f"t{i}", rid=f"r{i}") for i in range(10)]
    for s in seqs:
        sched.add(s)
    acct = NodeAccounting(node_for(sched, seqs, cfg))
    acct.on_output(sched.schedule(), 0.0)
    for s in seqs:
        acct.add_received(s, 100)
    stats = acct.tenant_stats()
    assert set(stats["kv_bytes"]) == set(stats["tenant_pages"]) == {"t0", "t1", "t2", "_other"}
    assert stats["kv_bytes"]["_other"]["received"] == 700
    assert stats["tenant_pages"]["_other"] == sum(len(sched.pool.pages_of(s.request_id)) for s in seqs[3:]) > 0
    text = acct.node.metrics.render().decode()
    assert 'tenant="t2"' in text and 'tenant="_other"' in text and 'tenant="t9"' not in text
