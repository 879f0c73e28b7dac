"""memfair's split of the step among owners' prompts, stepped through the scheduler with a fake
forward pass; and the turn wait of a resident row left out of a step, in SLO attribution."""
from __future__ import annotations

import pytest

from fairness import FairnessConfig, make_policy
from fairness.memfair import MemFairPolicy
from fairness.memfair_settings import MemFairSettings
from fairness.attribution import attribute, components
from pdtb.engine.timeline import Timeline
from sched_sim import apply_step, check_conservation, make_request, make_scheduler


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
    """Another tenant's prompt waiting for room (31 pages, not free) takes no part of the step:
    w's 8 prompts of 40 tokens share the budget with nobody and go at the step's pace, not a
    token a step (177 steps)."""
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
    assert step <= 20, step


def test_a_request_missing_both_slos_keeps_each_miss_cause():
    """A TTFT miss blamed on the queue and a TPOT miss blamed on the host tier: `cause` is the
    larger, `causes` keeps both."""
    tl = Timeline(router_arrival=0.0, prefill_queued=0.0, prefill_start=2.0, first_token=2.1,
                  decode_admit=2.1, last_token=12.1, parked_s=6.0)
    got = attribute(tl, 11, 0, FairnessConfig(slo_ttft_s={"*": 0.5}, slo_tpot_s={"*": 0.1}))
    assert got["missed"] == ["ttft", "tpot"] and got["cause"] == "parked_in_host"
    assert got["causes"] == {"ttft": "queue", "tpot": "parked_in_host"}


def test_small_prompts_of_every_owner_go_before_a_whale_which_keeps_its_floor():
    """By hand, a 256-token step: A's 400-token prompt, then B's three and A's one of 40 tokens
    each. Max-min shares: B wants 120 (under 128), A gets 136; floors a quarter of those: 34
    for A (its oldest, the whale) and 30 for B (B1). The other 192 go to the smallest prompts
    first: B1's last 10, B2, B3 and A's small one 40 each, the whale the 62 left: 96 in all.
    Every small prompt has its first token after one step; fcfs gives the whale the whole step."""
    def first_step(policy):
        sched = make_scheduler(make_policy(policy), num_pages=400, budget=256)
        reqs = [make_request(400, 4, tenant="A", arrival=0, rid="whale")]
        reqs += [make_request(40, 4, tenant="B", arrival=i, rid=f"B{i}") for i in (1, 2, 3)]
        reqs += [make_request(40, 4, tenant="A", arrival=4, rid="A-small")]
        for r in reqs:
            sched.add(r)
        out = sched.schedule()
        got = {c.seq.request_id: c.num_new_tokens for c in out.chunks}
        apply_step(sched, out)
        check_conservation(sched)
        return got
    assert first_step("memfair") == {"whale": 96, "B1": 40, "B2": 40, "B3": 40, "A-small": 40}
    assert first_step("fcfs") == {"whale": 256}
