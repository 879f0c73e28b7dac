"""Placement (pdtb/router/placement.py) on snapshots built by hand: each expected node, cost and
credit worked out by hand from the rule, with no registry, clock or socket."""
from __future__ import annotations

import pytest

from pdtb.engine.prefix_hash import page_hashes
from pdtb.router.fair_route import D2lpmRouter
from pdtb.router.node_state import RequestFailed
from pdtb.router.placement import FALLBACKS, Ask, NodeView, place

NS = "ns"


def make_view(index, role, *, free=100, total=100, queued=0, busy=0, page=4, available=True, kv="tcp://kv",
              view=frozenset()) -> NodeView:
    return NodeView(index, f"{role[0]}{index}", role, available, total, page, free, queued, busy,
                    kv if role == "decode" else "", NS, page, view)


def test_load_takes_the_least_queued_prefill_node_and_the_decode_node_with_most_free_pages():
    nodes = [make_view(0, "prefill", queued=30), make_view(1, "prefill", queued=10, busy=3),
             make_view(2, "prefill", queued=10, busy=1), make_view(3, "decode", free=40),
             make_view(4, "decode", free=70), make_view(5, "decode", free=90, available=False)]
    where = place(nodes, Ask([1] * 12, 4))
    assert (where.entry, where.decode) == (2, 4)  # 10 queued ties, 1 busy < 3; 70 free > 40 (5 is down)
    assert where.fallbacks == (3,) and where.cached is None and where.credit == {}


def test_fallbacks_are_the_other_decode_nodes_that_fit_most_free_first_at_most_three():
    nodes = [make_view(0, "prefill"), make_view(1, "decode", free=90)]
    nodes += [make_view(2 + i, "decode", free=f) for i, f in enumerate((10, 50, 30, 20, 60))]
    nodes += [make_view(7, "decode", free=80, kv=""), make_view(8, "decode", free=85, total=4)]
    where = place(nodes, Ask([1] * 12, 8))  # 20 tokens: 5 pages; node 8's pool holds 4, node 7 takes no KV
    assert where.decode == 1 and where.fallbacks == (6, 3, 4) and len(where.fallbacks) == FALLBACKS


def test_without_a_prefill_and_decode_pair_the_colocated_node_with_most_free_pages_takes_it():
    nodes = [make_view(0, "prefill"), make_view(1, "decode", available=False),
             make_view(2, "colocated", free=20), make_view(3, "colocated", free=50)]
    where = place(nodes, Ask([1] * 12, 4))
    assert (where.entry, where.decode, where.fallbacks) == (3, None, ())


def test_cache_weighs_queued_tokens_against_twice_the_tokens_not_cached():
    prompt = list(range(12))  # three pages of 4
    hashes = page_hashes(prompt, 4, NS)
    nodes = [make_view(0, "prefill", queued=0, view=frozenset(hashes[:2])),  # 0 + 2 * (12 - 8) = 8
             make_view(1, "prefill", queued=5, view=frozenset(hashes)),  # 5 + 2 * 0 = 5
             make_view(2, "prefill", queued=0), make_view(3, "decode")]  # 0 + 2 * 12 = 24
    where = place(nodes, Ask(prompt, 4), "cache")
    assert where.entry == 1 and where.cached.cost == 5 and where.cached.overlap_tokens == 12
    assert where.cached.hashes == hashes
    nodes[1] = make_view(1, "prefill", queued=10, view=frozenset(hashes))  # 10 > 8
    where = place(nodes, Ask(prompt, 4), "cache")
    assert where.entry == 0 and where.cached.cost == 8 and where.cached.overlap_pages == 2


def test_d2lpm_returns_the_credit_it_charges_and_writes_none():
    d2lpm = D2lpmRouter(quantum=100)
    d2lpm.credit = {("t", "p0"): 10.0, ("t", "p1"): -5.0}
    nodes = [make_view(0, "prefill", queued=9), make_view(1, "prefill", queued=1), make_view(2, "decode")]
    where = place(nodes, Ask([1] * 12, 4, "t"), "d2lpm", d2lpm)
    assert where.entry == 0 and where.credit == {("t", "p0"): 10 - 12}  # the only one with credit
    assert d2lpm.credit == {("t", "p0"): 10.0, ("t", "p1"): -5.0}
    d2lpm.credit.update(where.credit)  # both <= 0: one round of 100 each, then the less queued p1
    where = place(nodes, Ask([1] * 12, 4, "t"), "d2lpm", d2lpm)
    assert where.entry == 1 and where.credit == {("t", "p0"): 98, ("t", "p1"): 95 - 12}


def test_a_request_no_pool_could_hold_is_a_400_and_no_node_a_503():
    nodes = [make_view(0, "prefill", total=50), make_view(1, "decode", total=8), make_view(2, "decode", total=6)]
    with pytest.raises(RequestFailed) as info:
        place(nodes, Ask([1] * 12, 24))  # 36 tokens: 9 pages
    assert info.value.status == 400 and info.value.param == "max_tokens"
    assert "needs up to 9 KV pages for prompt + max_tokens; the largest decode node's pool has 8" in str(info.value)
    with pytest.raises(RequestFailed) as info:
        place([make_view(0, "prefill"), make_view(1, "decode", available=False)], Ask([1] * 12, 4))
    assert info.value.status == 503 and str(info.value) == "no healthy decode node available"
    with pytest.raises(RequestFailed) as info:
        place([make_view(0, "colocated", available=False)], Ask([1] * 12, 4))
    assert str(info.value) == "no healthy colocated node available"
