"""memfair's rules one by one (fairness/memfair_rules.py), each against figures worked by hand:
shares and the view, borrowing, reclaim, the growth caps, the prefill split, the chunk bound and
the victim. Pages are 4 tokens throughout."""
from __future__ import annotations

import math

import pytest

from fairness import FairnessConfig
from fairness import memfair_rules as rules
from fairness.memfair_rules import Prompt, StepView, Want
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.step_shape import StepShape
from sched_sim import make_request

PS = 4


def state(free: int, pages: dict, total: int = 60, host_free: int = 0, budget: int = 64, step_s=None) -> SchedState:
    return SchedState(0.0, 1, PS, 64, total, free, host_free, host_free, pages, {}, budget, step_s=step_s)


def prompt(rid: str, tenant: str, tokens: int, computed: int = 0, arrival: float = 0.0):
    seq = make_request(tokens, 8, tenant=tenant, arrival=arrival, rid=rid)
    seq.num_computed_tokens = computed
    return seq


def decoding(rid: str, tenant: str, tokens: int, arrival: float = 0.0):
    """A request past its prompt: `tokens` of prompt computed, one sampled token to feed."""
    seq = prompt(rid, tenant, tokens, tokens, arrival)
    seq.token_ids.append(7)
    return seq


def owner_of(seq) -> str:
    return seq.tenant


# ---- shares and the view ----------------------------------------------------------------------------
def test_over_share_is_use_over_share_and_a_zero_share_is_infinite_only_when_used():
    over = rules.over_share({"a": 30, "c": 5}, {"a": 20.0, "b": 40.0, "c": 0.0, "d": 0.0})
    assert over == {"a": 1.5, "b": 0.0, "c": math.inf, "d": 0.0}


def test_usage_charges_pages_and_counts_the_pages_running_prompts_still_take():
    # r1: a 10-token prompt, 4 computed, 1 page held: its prompt takes ceil(10 / 4) = 3, so 2 more
    r1, r2 = prompt("r1", "a", 10, computed=4), decoding("r2", "b", 8)
    use, ids, growth = rules.usage([r1, r2], {"r1": 1, "r2": 3}, {"r1": 1, "r2": 3}, PS, owner_of)
    assert use == {"a": 1, "b": 3} and ids == {"r1", "r2"} and growth == {"a": 2}


def test_promised_is_what_the_running_prompts_of_owners_within_their_share_still_take():
    # a within its share (10 <= 12): its 5 promised; b beyond (20 > 12): its 7 yield to waiters
    assert rules.promised({"a": 5, "b": 7}, {"a": 10, "b": 20}, {"a": 12.0, "b": 12.0}) == 5


def test_need_now_is_the_first_chunk_of_a_prompt_and_all_the_context_of_a_parked_row():
    assert rules.need_now(prompt("p", "a", 100), 0, 64, PS) == 16  # min(100, 64) tokens: 16 pages
    assert rules.need_now(prompt("p", "a", 10), 0, 64, PS) == 3
    parked = decoding("d", "a", 30)  # 30 computed + its next token: ceil(31 / 4) = 8
    assert rules.need_now(parked, 0, 64, PS) == 8
    assert rules.need_now(parked, 8, 64, PS) == 1  # at least a page


def test_without_a_host_tier_a_prompt_needs_all_of_its_prompt():
    p = prompt("p", "a", 100)
    assert rules.need_on(p, state(30, {})) == 25  # no host tier: ceil(100 / 4)
    assert rules.need_on(p, state(30, {}, host_free=8)) == 16  # its first chunk, as need_now
    assert rules.need_on(prompt("q", "a", 100, computed=64), state(30, {"q": 16})) == 1  # started: its next token


def test_typical_size_is_a_running_mean_of_about_eight_requests():
    assert rules.typical_size(None, 10) == 10.0
    assert rules.typical_size(10.0, 18) == 11.0  # 10 + (18 - 10) / 8


def test_static_window_keeps_owners_seen_within_it():
    known = {"a": 0.0, "b": 5.0}
    assert rules.static_window(known, {"c"}, 31.0, 30.0, by_request=False) == {"b": 5.0, "c": 31.0}
    assert rules.static_window(known, {"c"}, 31.0, 30.0, by_request=True) == {"c": 31.0}  # b's request left
    assert known == {"a": 0.0, "b": 5.0}


def test_owner_shares_are_weighted_shares_of_the_pool():
    cfg = FairnessConfig(tenant_weights={"a": 3.0})
    assert rules.owner_shares({"t:a", "t:b"}, cfg, 100, None) == {"t:a": 75.0, "t:b": 25.0}


def test_within_share_checks_each_waiter_against_its_owners_use_alone():
    # a holds 20 of 40: each of its waiters (10, 15 pages) fits its share on its own
    within, pages = rules.within_share([("a", 10), ("a", 15), ("b", 5), ("c", 9)], {"a": 20, "c": 2},
                                       {"a": 40.0, "b": 10.0, "c": 10.0})
    assert within == {"a": 2, "b": 1} and pages == {"a": 25, "b": 5}


def test_longest_starving_is_the_oldest_past_the_horizon_ties_to_the_smaller_id():
    since = {"x": 1.0, "z": 0.5, "y": 0.5}
    assert rules.longest_starving(since, 0.8) == "y"
    assert rules.longest_starving(since, 0.4) is None


def test_waiting_since_keeps_the_first_wait_and_names_the_prompts_first_seen():
    old, new_prompt, parked = prompt("old", "a", 8), prompt("new", "a", 8), decoding("back", "a", 8)
    since, new = rules.waiting_since([old, new_prompt, parked], {"old": 1.0}, 3.0)
    assert since == {"old": 1.0, "new": 3.0, "back": 3.0} and new == [new_prompt]


def test_build_view_finds_needs_waiters_within_share_and_the_starving():
    w1, w2 = prompt("w1", "a", 16, arrival=0.0), prompt("w2", "b", 40, arrival=1.0)
    st = state(10, {})
    view = rules.build_view({"r"}, [w1, w2], [], {"a": 2, "b": 30}, {"a": 30.0, "b": 30.0}, 3,
                            {"w1": 0.0, "w2": 1.0}, 0.5, st, owner_of)
    # w1 needs 4 pages (2 + 4 <= 30: within); w2 10 (30 + 10 > 30: beyond); w1 waits since 0.0 <= 0.5
    assert view.needs == {"w1": 4, "w2": 10} and view.within == {"a": 1} and view.within_pages == {"a": 4}
    assert (view.starved, view.starved_need, view.starved_owner) == ("w1", 4, "a")
    assert view.over == {"a": 2 / 30, "b": 1.0} and view.growth == 3 and view.running_ids == frozenset({"r"})
    with pytest.raises(AttributeError):
        view.use = {}  # frozen


# ---- borrowing --------------------------------------------------------------------------------------
ENT = {"a": 50.0, "b": 30.0, "c": 20.0}


def test_borrow_reserve_keeps_a_typical_request_of_each_owner_with_unused_share():
    # b: 20 unused, typical 8 -> 8; c: over its share -> 0; plus the 5 pages prompts still take
    assert rules.borrow_reserve("a", ENT, {"b": 10, "c": 25}, {"b": 8.0, "c": 4.0}, 5) == 13.0


@pytest.mark.parametrize("need,free,within,static,prompt_pages,ok", [
    (5, 0, {}, False, 5, True),  # 40 + 5 + 5 <= 50: within its share, whatever is free
    (15, 30, {}, True, 0, False),  # beyond its share: static shares lend nothing
    (15, 30, {"b": 1}, False, 0, False),  # b waits within its share: nobody borrows
    (15, 30, {"a": 2, "b": 0}, False, 0, True),  # only a's own waiters: 30 - 15 >= 8
    (15, 22, {}, False, 0, False),  # 22 - 15 = 7 < 8 (b's typical request)
    (15, 30, {}, False, 8, False),  # its own prompt's 8 pages more: 15 < 8 + 8
])
def test_quota_ok(need, free, within, static, prompt_pages, ok):
    use = {"a": 40, "b": 10, "c": 25}
    assert rules.quota_ok("a", need, ENT, use, free, prompt=prompt_pages, static=static, within=within, growth=0,
                          size={"b": 8.0, "c": 4.0}) is ok


STARVING = StepView(shares={"a": 20.0, "b": 20.0, "c": 20.0}, starved="s", starved_need=6, starved_owner="b")


@pytest.mark.parametrize("rid,owner,need,free,ok", [
    ("x", "a", 10, 20, True),  # 20 - 10 leaves its 6 free
    ("s", "b", 10, 8, True),  # the starving request itself
    ("x", "a", 10, 12, True),  # within a's share, and 6 <= 60 - (20 + 20) kept by a and c
    ("x", "c", 1, 6, False),  # 6 - 1 < 6, and c borrows (25 + 1 > 20): it waits for the starving request
])
def test_keeps_room_for_the_starving(rid, owner, need, free, ok):
    assert rules.keeps_room_for_starved(STARVING, rid, owner, need, {"a": 10, "c": 25}, free, 60) is ok


def test_keeps_room_stops_everyone_when_the_owners_within_share_hold_too_much():
    view = StepView(shares={"a": 20.0, "b": 20.0, "c": 20.0}, starved="s", starved_need=25, starved_owner="b")
    # a and c within their shares keep 20 + 20 of 60: 20 left < 25
    assert not rules.keeps_room_for_starved(view, "x", "a", 10, {"a": 10, "c": 20}, 12, 60)


def test_recently_moved():
    assert rules.recently_moved(9.0, 10.0, 2.0) and not rules.recently_moved(8.0, 10.0, 2.0)
    assert not rules.recently_moved(None, 10.0, 2.0)


def test_with_grants_adds_in_order_and_leaves_the_view_alone():
    use = {"a": 1}
    assert rules.with_grants(use, []) is use
    assert rules.with_grants(use, [("a", 2), ("b", 3), ("a", 1)]) == {"a": 4, "b": 3} and use == {"a": 1}


# ---- reclaim ----------------------------------------------------------------------------------------
def reclaim_case(need: int, free: int = 2, host_free: int = 10, drop: str = "off", extra=()):
    b1, b2, a1 = decoding("b1", "b", 20, 0.0), decoding("b2", "b", 12, 1.0), decoding("a1", "a", 28, 2.0)
    pages = {"b1": 6, "b2": 4, "a1": 8}
    use = {"a": 8, "b": 10}
    for s, n in extra:  # more of b's requests: (request, pages)
        pages[s.request_id] = n
        use["b"] += n
    st = state(free, pages, total=20 + sum(n for _, n in extra), host_free=host_free)
    return rules.reclaim_victims([Want("a", need, True, 3.0)], [b1, b2, a1, *(s for s, _ in extra)], use,
                                 {"a": 12.0, "b": 6.0}, st, 3 + len(extra), owner_of, drop)


def test_reclaim_demotes_the_largest_footprint_of_the_over_share_owner_until_the_waiter_fits():
    # a waits for 4 (8 + 4 <= 12: within its share); with a page per row it needs 7, 2 are free.
    # b holds 10 of 6: b1 (6 pages) goes first, and 2 + 6 = 8 >= 4 + 3 - 1: b2 stays.
    assert [s.request_id for s in reclaim_case(4)] == ["b1"]


def test_reclaim_copies_nobody_down_for_a_waiter_it_cannot_let_in():
    assert reclaim_case(5) == []  # 8 + 5 > 12: beyond a's share, it waits
    # b1's 6 pages do not fit a host tier of 5: demoting b2 could free 4, and 2 + 4 < 4 + 3
    assert reclaim_case(4, host_free=5) == []
    assert [s.request_id for s in reclaim_case(4, free=3, host_free=5)] == ["b2"]  # 3 + 4 >= 4 + 3


def test_without_host_room_reclaim_drops_only_what_was_lent():
    # no host tier: b holds 10 of its 6. Dropping b1 (6) would leave b 4, below its share (b would
    # reclaim in turn); b2 (4) leaves it 6: b2 is dropped, and 2 + 4 >= 4 + 3 - 1
    assert [s.request_id for s in reclaim_case(4, host_free=0, drop="any")] == ["b2"]
    assert reclaim_case(4, host_free=0, drop="off") == []  # the waiter waits for free pages
    assert reclaim_case(4, host_free=0, drop="prompts") == []  # b's requests all stream
    # with host room, demotion as before: the drop setting plays no part
    assert [s.request_id for s in reclaim_case(4, drop="any")] == ["b1"]


def test_reclaim_drops_nobody_when_what_may_be_dropped_would_not_let_the_waiter_in():
    # a waits for 4 with 3 rows: 7 wanted, 2 free. Only b2 (4 pages) may go (b1 would leave b
    # below its share): 2 + 4 < 7 - 1, so dropping b2 would throw its work away for nobody
    assert reclaim_case(4, free=1, host_free=0, drop="any") == []
    assert [s.request_id for s in reclaim_case(4, free=2, host_free=0, drop="any")] == ["b2"]  # 2 + 4 >= 6


def test_a_prompt_that_streamed_nothing_is_dropped_before_a_stream():
    # b also has a prompt with 40 tokens computed (10 pages): more computed than b2, yet it goes
    # first: its drop stalls no stream
    p = prompt("b3", "b", 60, computed=40, arrival=4.0)
    assert [s.request_id for s in reclaim_case(4, host_free=0, drop="any", extra=[(p, 10)])] == ["b3"]
    assert [s.request_id for s in reclaim_case(4, host_free=0, drop="prompts", extra=[(p, 10)])] == ["b3"]
    # two streams of one owner: the least computed goes (the least to redo)
    big, small = decoding("b4", "b", 40, 4.0), decoding("b5", "b", 16, 5.0)
    got = reclaim_case(4, host_free=0, drop="any", extra=[(big, 10), (small, 4)])
    # five rows: 4 + 5 pages wanted, 2 free. b2 (12 tokens computed) then b5 (16) free 8; b4 (40) stays
    assert [s.request_id for s in got] == ["b2", "b5"]


def test_reclaim_wants_serve_the_starving_then_the_owners_furthest_below_their_share():
    c1, c2, c3 = prompt("c1", "a", 8, arrival=0.0), prompt("c2", "b", 8, arrival=1.0), prompt("c3", "b", 8, arrival=2.0)
    view = StepView(over={"a": 0.9, "b": 0.1}, needs={"c1": 2, "c2": 2, "c3": 2})
    wants = rules.reclaim_wants([c1, c2, c3], [], view, state(0, {}), owner_of, lambda c: c.request_id != "c3")
    assert [(w.owner, w.since) for w in wants] == [("b", 2.0), ("b", 1.0), ("a", 0.0)]


# ---- the step ---------------------------------------------------------------------------------------
def growth_case(device_free: int):
    d, p = decoding("d", "b", 8, 0.0), prompt("p", "a", 64, computed=16, arrival=1.0)
    view = StepView(shares={"a": 10.0, "b": 10.0}, within_pages={"b": 6})
    st = state(device_free, {"d": 3, "p": 4})
    return rules.growth_caps([d, p], 6, view, {"a": 14, "b": 3}, st, d, owner_of)


def test_growth_caps_let_a_borrowers_prompt_take_only_what_the_waiters_leave():
    # a is over its share (14 of 10); 10 free less a page per row = 8, less b's waiting 6 = 2 pages:
    # its chunk may fill its 4 pages (16 tokens, all computed) and 2 more: 8 tokens
    rows, caps = growth_case(10)
    assert [s.request_id for s in rows] == ["d", "p"] and caps == {"p": 8}


def test_growth_caps_sit_a_borrowers_prompt_out_when_the_waiters_need_all_that_is_free():
    rows, caps = growth_case(8)
    assert [s.request_id for s in rows] == ["d"] and caps == {}


def test_split_prefill_gives_floors_to_the_oldest_then_the_rest_smallest_first():
    prompts = [Prompt("a", "p1", 0.0, 1000, 1000), Prompt("b", "p2", 1.0, 40, 40), Prompt("b", "p3", 2.0, 100, 100)]
    demand = rules.owner_demand(prompts)
    assert demand == {"a": 1000, "b": 140}
    # max-min shares of 200: 100 each; floors 25 each: p1 25, p2 25; the other 150 smallest first:
    # p2 its last 15, p3 its 100, p1 the 35 left
    assert rules.split_prefill(prompts, demand, {"a": 1.0, "b": 1.0}, 200) == {"p1": 60, "p2": 40, "p3": 100}


def test_plan_prefill_splits_only_between_owners():
    d, p1, p2 = decoding("d", "a", 8), prompt("p1", "a", 30, computed=10), prompt("p2", "a", 8)
    st = state(20, {"d": 3, "p1": 3})
    one = rules.plan_prefill([d, p1], [p2], {"p2": 2}, st, owner_of, lambda o: 1.0)
    assert one.allot == {} and one.prompts == 2 and one.decode == {"a": (1, 9)} and one.decode_total == (1, 9)
    p3 = prompt("p3", "b", 8, arrival=1.0)
    two = rules.plan_prefill([d, p1], [p3], {"p3": 2}, st, owner_of, lambda o: 1.0)
    # 64 tokens less the decode row: 63; the demands (a 20, b 8) both fit: floors 5 and 2 to p1 and p3;
    # the other 56 smallest first: p3 its last 6, p1 its last 15
    assert two.allot == {"p1": 20, "p3": 8}
    # 20 free less 2 rows: 18; with p1's 5 pages still to come promised, p3's 2 fit; with 17, not:
    # p3 takes no part of the step, and p1 (one owner prefilling) has the whole budget
    assert rules.plan_prefill([d, p1], [p3], {"p3": 2}, st, owner_of, lambda o: 1.0, promised=5).allot == two.allot
    held_back = rules.plan_prefill([d, p1], [p3], {"p3": 2}, st, owner_of, lambda o: 1.0, promised=17)
    assert held_back.allot == {} and held_back.prompts == 1


# ---- the chunk bound --------------------------------------------------------------------------------
def price(shape: StepShape) -> float:
    """5 ms a step, 0.1 ms a decode row, 0.1 ms a prompt token, 1 us a query-key pair."""
    return 5e-3 + 1e-4 * shape.decode_rows + 1e-4 * shape.prefill_tokens + 1e-6 * shape.prefill_attn


def test_a_chunk_deep_into_its_prompt_is_cut_to_an_ordinary_steps_price():
    # ordinary: 4 rows beside 508 fresh tokens: 0.1 ms * 508 + 1 us * 508 * 509 / 2 = 180.086 ms
    # a chunk of k from token 1,000: 0.1 ms * k + 1 us * (1,000 k + k (k + 1) / 2): k = 153 is
    # 180.081 ms, k = 154 is 181.335 ms
    assert rules.chunk_within_step_time(price, 512, 1000, 4, 100, (0, 0, 0), 512, 16) == 153
    assert rules.chunk_within_step_time(price, 100, 0, 4, 100, (0, 0, 0), 512, 16) == 100  # cheap: all of it
    assert rules.chunk_within_step_time(price, 512, 10 ** 6, 4, 100, (0, 0, 0), 512, 16) == 16  # a page at least
    assert rules.with_chunk((0, 0, 0), 153, 1000) == (1, 153, 153 * 1000 + 153 * 154 // 2)


# ---- victims ----------------------------------------------------------------------------------------
def test_the_victim_is_the_most_over_share_owners_largest_demotable_else_its_least_computed():
    a1, a2, b1 = decoding("a1", "a", 10, 0.0), decoding("a2", "a", 30, 1.0), decoding("b1", "b", 50, 2.0)
    over = {"a": 2.0, "b": 0.5}
    st = state(0, {"a1": 3, "a2": 8, "b1": 13}, host_free=20)
    never, always = (lambda s, st: False), (lambda s, st: True)
    assert rules.choose_victim([a1, a2, b1], over, owner_of, st, always, lambda: False) is a2  # largest footprint
    assert rules.choose_victim([a1, a2, b1], over, owner_of, st, never, lambda: False) is a1  # least computed
    assert rules.choose_victim([a1, a2, b1], over, owner_of, st, never, lambda: True) is None  # the chunk waits


def test_may_admit_has_no_side_effect_and_admitted_books_the_pages():
    """Asked twice, memfair answers the same and its view of the owner's use is unchanged;
    `admitted` books the pages, so the next ask sees them."""
    from fairness.memfair import MemFairPolicy
    from sched_sim import make_request, make_scheduler

    pol = MemFairPolicy()
    sched = make_scheduler(pol, num_pages=64, budget=64)
    seq = make_request(8, 4, tenant="a", arrival=0.0, rid="a1")
    sched.add(seq)
    st = sched.state()
    pol.reclaim([], [seq], st)
    before = dict(pol._use())
    assert pol.may_admit(seq, 2, st) == pol.may_admit(seq, 2, st) is True
    assert pol._use() == before
    pol.admitted(seq, 2, st)
    owner = pol.owner(seq)
    assert pol._use().get(owner, 0) == before.get(owner, 0) + 2
