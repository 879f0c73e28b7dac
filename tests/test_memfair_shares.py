"""memfair's step shares, stepped through the scheduler with a fake forward pass: the read
share (a borrower's decode rows take turns while another tenant decodes) and one long prompt
per tenant at a time; and the turn wait they cost, in SLO attribution."""
from __future__ import annotations

import pytest

from fairness import FairnessConfig, make_policy
from fairness.memfair import MemFairPolicy
from fairness.memfair_settings import MemFairSettings
from fairness.attribution import attribute, components
from pdtb.engine.timeline import Timeline
from pdtb.engine.sequence import SeqStatus
from sched_sim import apply_step, check_conservation, make_request, make_scheduler, sim_step


def whales_and_a_minnow(read_share: bool = True, turn: int = 4):
    """Three whales of tenant w, 60 pages each (one is all the read share of w admits: two
    tenants share a 200-page tier, 100 pages each), decoding; then a minnow of tenant m."""
    pol = MemFairPolicy(FairnessConfig(), MemFairSettings(read_share=read_share, read_turn_steps=turn))
    sched = make_scheduler(pol, num_pages=200, budget=512)
    whales = [make_request(236, 400, tenant="w", arrival=i) for i in range(3)]
    for w in whales:
        sched.add(w)
    for _ in range(4):
        sim_step(sched)
    assert all(w.status == SeqStatus.RUNNING and not w.in_prefill for w in whales)
    minnow = make_request(8, 200, tenant="m", arrival=10)
    sched.add(minnow)
    sim_step(sched)
    assert not minnow.in_prefill
    return sched, whales, minnow


def served_rows(sched, steps):
    rows = []
    for _ in range(steps):
        out = sched.schedule()
        rows.append({c.seq.request_id for c in out.chunks})
        apply_step(sched, out)
        check_conservation(sched)
    return rows


def test_read_share_serves_a_borrower_within_its_share_in_turns():
    sched, whales, minnow = whales_and_a_minnow(turn=4)
    ids = [w.request_id for w in whales]
    rows = served_rows(sched, 24)
    for served in rows:
        assert minnow.request_id in served  # the tenant within its share steps every time
        assert sum(r in served for r in ids) == 1  # 60 pages each: one fits the 100-page share
    # turns of 4 steps rotate through all three, least recently served first
    turns = [next(r for r in ids if r in served) for served in rows]
    assert [turns[i] for i in range(0, 24, 4)] == ids * 2
    assert all(len(set(turns[i:i + 4])) == 1 for i in range(0, 24, 4))


def test_without_the_read_share_every_row_steps():
    sched, whales, minnow = whales_and_a_minnow(read_share=False)
    for served in served_rows(sched, 8):
        assert served == {minnow.request_id, *(w.request_id for w in whales)}


def test_read_share_lapses_when_the_other_tenant_leaves():
    sched, whales, minnow = whales_and_a_minnow()
    sched.abort(minnow.request_id)
    for served in served_rows(sched, 3):
        assert served == {w.request_id for w in whales}


def test_one_long_prompt_per_tenant_while_another_tenant_is_active():
    sched = make_scheduler(make_policy("memfair"), num_pages=400, budget=512)
    minnow = make_request(8, 300, tenant="m")
    sched.add(minnow)
    sim_step(sched)
    first, second = make_request(400, 2, tenant="w", arrival=1.0), make_request(400, 2, tenant="w", arrival=2.0)
    sched.add(first)
    sched.add(second)
    steps = []
    while second.in_prefill:
        first_long = first.in_prefill  # both are long prompts: more than 1/8 of the budget
        out = sched.schedule()
        steps.append(([c.seq for c in out.chunks if c.seq.tenant == "w" and c.seq.in_prefill], first_long))
        assert any(c.seq is minnow for c in out.chunks)
        assert all(c.num_new_tokens <= 16 for c in out.chunks)
        apply_step(sched, out)
        assert len(steps) < 200
    # the second is not admitted while the first is in prefill: it would only hold pages (with
    # both admitted, the second crawls at a token a step)
    assert steps[0][0] == [first]
    for chunks, first_long in steps[1:]:
        assert chunks == ([first] if first_long else [second])  # one long prompt at a time, the older first
    assert sum(f for _, f in steps[1:]) == 400 // 16 - 1


@pytest.mark.parametrize("turn_wait,cause", [(3.0, "turn_wait"), (0.1, "decode_compute")])
def test_turn_wait_is_a_decode_component_and_can_be_the_cause(turn_wait, cause):
    tl = Timeline(router_arrival=0.0, prefill_queued=0.0, prefill_start=0.0, first_token=0.1,
                  decode_admit=0.1, last_token=4.1, turn_wait_s=turn_wait)
    comp = components(tl, num_output=11)
    assert comp["tpot"]["turn_wait"] == turn_wait
    assert comp["tpot"]["decode_compute"] == pytest.approx(4.0 - turn_wait)
    got = attribute(tl, 11, 0, FairnessConfig(slo_tpot_s={"*": 0.1}))
    assert got["missed"] == ["tpot"] and got["cause"] == cause


def test_a_prompt_that_cannot_get_in_does_not_make_long_prompts_crawl():
    """Another tenant's prompt waiting for room (31 pages, not free) must not make every long
    prompt take a token a step instead of its small chunk (8 prompts of 40 tokens would take
    177 steps). They take their 4-token chunks, one prompt at a time: 80 steps."""
    from sched_sim import FakeClock

    clock = FakeClock()
    sched = make_scheduler(make_policy("memfair"), num_pages=48, budget=64, max_num_seqs=64, clock=clock)
    sched.add(make_request(4, 150, tenant="m", rid="m-decoder"))  # another tenant decodes all along
    apply_step(sched, sched.schedule())
    for i in range(8):  # long prompts: more than 64 / 8 tokens
        sched.add(make_request(40, 4, tenant="w", arrival=1.0 + i, rid=f"w{i}"))
    apply_step(sched, sched.schedule())
    sched.add(make_request(120, 4, tenant="b", arrival=1.5, rid="b-big"))  # 31 pages: waits for room
    for step in range(1, 400):
        clock.t = 2 + step * 0.05
        apply_step(sched, sched.schedule())
        check_conservation(sched)
        if all(s.tenant != "w" for s in sched.all_requests()):
            break
    assert step <= 100, step


def test_a_request_missing_both_slos_keeps_each_miss_cause():
    """A TTFT miss blamed on the queue and a TPOT miss blamed on the host tier: `cause` is the
    larger, `causes` keeps both."""
    tl = Timeline(router_arrival=0.0, prefill_queued=0.0, prefill_start=2.0, first_token=2.1,
                  decode_admit=2.1, last_token=12.1, parked_s=6.0)
    got = attribute(tl, 11, 0, FairnessConfig(slo_ttft_s={"*": 0.5}, slo_tpot_s={"*": 0.1}))
    assert got["missed"] == ["ttft", "tpot"] and got["cause"] == "parked_in_host"
    assert got["causes"] == {"ttft": "queue", "tpot": "parked_in_host"}


def test_a_second_long_prompt_held_back_does_not_slow_the_other_tenants_first():
    """Two tenants with two long prompts each: each tenant's second is not admitted while its
    first is in prefill, and must not count as another tenant's prompt waiting for the step
    (counted as one, it makes each first prompt take a token a step: 69 steps to all first
    tokens). With their small chunks: 18."""
    from sched_sim import FakeClock

    clock = FakeClock()
    sched = make_scheduler(MemFairPolicy(FairnessConfig(), MemFairSettings(starve_after_s=1e9)), num_pages=200,
                           budget=256, clock=clock)
    reqs = [make_request(60, 4, tenant=t, arrival=i) for i, t in enumerate("ABAB")]
    for r in reqs:
        sched.add(r)
    for step in range(1, 200):
        clock.t = step * 0.05
        apply_step(sched, sched.schedule())
        if all(r.num_output_tokens >= 1 for r in reqs):
            break
    assert step <= 25, step
