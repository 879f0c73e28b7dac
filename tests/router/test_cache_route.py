"""Cache-aware routing (`--route cache`): the scoring function, the router's per-node prefix views,
and a router over fake nodes that report prefix summaries."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pdtb.engine.prefix_hash import page_hashes
from pdtb.nodes.protocol import GenerateRequest, NodeStats, Params, encode_message
from pdtb.router import cache_route
from pdtb.router.cache_route import PREFILL_WEIGHT, CacheCandidate, PrefixView, choose_by_cache, overlap_pages
from pdtb.router.config import NodeSpec, RouterConfig, load_served_model
from pdtb.router.registry import NodeRegistry

NS, PAGE = "tiny/fp32", 16
PREFIX = list(range(1, 1 + 8 * PAGE))  # 8 full pages shared by the requests below


def make_candidate(queued=0, tie=(0,), view=(), page_size=PAGE, ns=NS) -> CacheCandidate:
    return CacheCandidate(queued, tie, page_size, ns, set(view))


def make_stats(node_id, role, summary=(), ns=NS, **kw) -> NodeStats:
    return NodeStats(node_id, role, 0, 1000, 1000, kv_addr="tcp://kv" if role == "decode" else "",
                     page_size=PAGE, prefix_ns=ns, prefix_summary=list(summary), **kw)


def make_registry(roles, route, sent=None) -> NodeRegistry:
    """A registry whose nodes have all just answered (no sockets): `submit` records where it sends."""
    reg = NodeRegistry([NodeSpec(r, f"tcp://127.0.0.1:{i + 1}") for i, r in enumerate(roles)], route=route)
    now = time.monotonic()
    for i, n in enumerate(reg.nodes):
        n.stats, n.last_seen = make_stats(f"n{i}", n.spec.role), now
    reg.node_set.send = lambda node, msg: sent.append(node) is None if sent is not None else True
    return reg


def make_request(i, prompt) -> GenerateRequest:
    return GenerateRequest(f"r{i}", list(prompt), Params(4))


# -- the scoring function -------------------------------------------------------------------------
def test_overlap_wins_when_load_is_equal():
    hashes = page_hashes(PREFIX + [7] * 5, PAGE, NS)
    nodes = [make_candidate(view=hashes[:2]), make_candidate(view=hashes[:6]), make_candidate()]
    choice = choose_by_cache(nodes, PREFIX + [7] * 5)
    assert choice.index == 1 and choice.overlap_pages == 6 and choice.overlap_tokens == 96
    assert choice.cost == PREFILL_WEIGHT * (len(PREFIX) + 5 - 96) and choice.hashes == hashes


def test_heavy_load_beats_a_small_overlap_and_a_light_one_does_not():
    hashes = page_hashes(PREFIX, PAGE, NS)
    cached_busy, idle = make_candidate(queued=500, view=hashes[:2]), make_candidate(queued=0)
    assert choose_by_cache([cached_busy, idle], PREFIX).index == 1  # 500 + 2 x 96 > 2 x 128
    cached_light = make_candidate(queued=20, view=hashes[:2])
    assert choose_by_cache([cached_light, idle], PREFIX).index == 0  # 20 + 2 x 96 < 2 x 128


def test_without_a_prefix_cache_the_choice_is_the_load_choice():
    hashes = page_hashes(PREFIX, PAGE, NS)
    # node 0's view holds the prompt, but it reports no namespace: its hashes mean nothing
    nodes = [make_candidate(queued=10, view=hashes, ns=""), make_candidate(queued=10, tie=(-1,), ns=""),
             make_candidate(queued=30, tie=(-5,), ns="")]
    choice = choose_by_cache(nodes, PREFIX)
    assert choice.index == 1 and choice.overlap_pages == 0 and choice.hashes == []
    assert choose_by_cache([make_candidate(view=hashes, page_size=0)], PREFIX).overlap_pages == 0
    assert choose_by_cache([], PREFIX) is None


def test_the_overlap_is_the_leading_chain_and_hashes_are_computed_once_per_page_size(monkeypatch):
    hashes = page_hashes(PREFIX, PAGE, NS)
    assert overlap_pages(hashes, {hashes[0], hashes[1], hashes[3]}) == 2  # page 2 missing ends the prefix
    calls = []
    monkeypatch.setattr(cache_route, "page_hashes", lambda *a: calls.append(a[1:]) or page_hashes(*a))
    choose_by_cache([make_candidate(), make_candidate(), make_candidate(page_size=32)], PREFIX)
    assert calls == [(PAGE, NS), (32, NS)]


# -- the router's view of a node ------------------------------------------------------------------
def test_a_summary_replaces_the_view_but_recent_inserts_stay():
    view = PrefixView()
    view.update([1, 2, 3], now=0.0)
    view.insert([10, 11], now=5.0)
    view.update([3, 4], now=5.5)  # sent before requests 10/11 arrived: they stay
    assert {h for h in (1, 2, 3, 4, 10, 11) if h in view} == {3, 4, 10, 11}
    view.update([4], now=7.0)  # a second later they are the summary's business
    assert {h for h in (3, 4, 10, 11) if h in view} == {4}


def test_a_view_is_bounded_and_garbage_in_a_summary_is_ignored():
    view = PrefixView(max_hashes=4)
    view.update(list(range(10)), now=0.0)
    view.insert(list(range(100, 110)), now=0.0)
    assert len(view) == 8 and 0 in view and 4 not in view and 109 in view and 100 not in view
    view = PrefixView()
    view.update([1, "x", None, [2], 2.0, True, 5], now=0.0)
    assert view.summary == {1, 5}
    view.update("not a list", now=0.0)
    assert view.summary == frozenset()


def test_a_new_stats_message_refreshes_the_view_and_a_bad_summary_cannot_break_routing():
    reg = make_registry(["colocated", "colocated"], "cache")
    a, b = reg.nodes
    hashes = page_hashes(PREFIX, PAGE, NS)
    reg.node_set.on_frame(b, encode_message(make_stats("n1", "colocated", hashes[:4])))
    assert reg.submit(make_request(1, PREFIX)).entry is b
    reg.node_set.on_frame(a, encode_message(make_stats("n0", "colocated", [2 ** 64 - 1, 0])))  # matches nothing
    reg.node_set.on_frame(b, encode_message(make_stats("n1", "colocated", hashes[:4])))  # b's next report: r1 prefilled
    handle = reg.submit(make_request(2, PREFIX))
    assert handle.entry is b and handle.prefix_overlap_tokens == len(PREFIX)  # r1's insert: all 8 pages


# -- optimistic inserts: a burst between two stats reports ----------------------------------------
@pytest.mark.parametrize("roles", [["colocated", "colocated"], ["prefill", "prefill", "decode"]])
def test_back_to_back_requests_with_one_prefix_go_to_one_node_under_cache(roles):
    sent = []
    reg = make_registry(roles, "cache", sent)
    first = reg.submit(make_request(1, PREFIX + [3] * 7))
    second = reg.submit(make_request(2, PREFIX + [4] * 9))
    assert second.entry is first.entry and sent == [first.entry, first.entry]
    assert first.prefix_overlap_tokens == 0 and second.prefix_overlap_tokens == len(PREFIX)
    other = reg.submit(make_request(3, [9] * len(PREFIX)))  # another prefix: load decides
    assert other.prefix_overlap_tokens == 0


def test_back_to_back_colocated_requests_spread_under_load():
    reg = make_registry(["colocated", "colocated"], "load")
    first = reg.submit(make_request(1, PREFIX + [3] * 7))
    second = reg.submit(make_request(2, PREFIX + [4] * 9))
    assert second.entry is not first.entry  # the pages sent to the first count against it
    assert first.prefix_overlap_tokens == second.prefix_overlap_tokens == 0
    assert all(len(n.prefix_view) == 0 for n in reg.nodes)


# -- configuration --------------------------------------------------------------------------------
def test_the_route_flag():
    from pdtb.router.main import parse_args

    assert parse_args([]).route == "load"
    assert parse_args(["--route", "cache"]).route == "cache"
    with pytest.raises(SystemExit):
        parse_args(["--route", "random"])
    spec = (NodeSpec("colocated", "tcp://127.0.0.1:1"),)
    assert RouterConfig(spec).route == "load" and RouterConfig(spec, route="cache").route == "cache"
    with pytest.raises(ValueError):
        RouterConfig(spec, route="random")
    with pytest.raises(ValueError):
        NodeRegistry(list(spec), route="random")


# -- a router over fake nodes that report their prefix caches -------------------------------------
async def _route_one(served, route: str) -> tuple[str, str]:
    """Two idle colocated fake nodes; the second holds PREFIX. Returns the node that serves a
    request starting with PREFIX, and the router's metrics text."""
    from pdtb.router.completions import STATE
    from pdtb.router.fake_node import FakeNode, FakeNodeConfig
    from pdtb.router.main import start_router

    nodes = [FakeNode(FakeNodeConfig("colocated", f"c{i}", [5, 6, 7], prefix_ns=NS, page_size=PAGE))
             for i in range(2)]
    nodes[1].remember(PREFIX)
    runner = None
    try:
        specs = tuple([NodeSpec("colocated", await n.start()) for n in nodes])
        runner, url = await start_router(RouterConfig(specs, port=0, ping_interval=0.05, health_timeout=0.5,
                                                      route=route), served)
        registry = runner.app[STATE].registry
        held = page_hashes(PREFIX, PAGE, NS)[-1]
        while not (all(registry.is_healthy(n) for n in registry.nodes) and all(n.stats.prefix_summary
                                                                               for n in registry.nodes[1:])):
            await asyncio.sleep(0.02)
        assert (held in registry.nodes[1].prefix_view) == (route == "cache")
        body = {"model": "tiny", "prompt": PREFIX + [9, 9, 9], "max_tokens": 2}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        return next(n.cfg.node_id for n in nodes if n.requests), metrics
    finally:
        if runner is not None:
            await asyncio.wait_for(runner.cleanup(), 10)
        for n in nodes:
            await n.close()


@pytest.fixture(scope="module")
def served(llama_dir):
    return load_served_model(llama_dir, "tiny")


def test_a_router_over_fake_nodes_sends_a_cached_prefix_to_its_node(served):
    node, metrics = asyncio.run(asyncio.wait_for(_route_one(served, "cache"), 30))
    assert node == "c1"
    assert f'pdtb_router_prefix_hit_requests_total{{node="c1"}} 1.0' in metrics
    assert f'pdtb_router_prefix_overlap_tokens_total{{node="c1"}} {float(len(PREFIX))}' in metrics
    node, metrics = asyncio.run(asyncio.wait_for(_route_one(served, "load"), 30))
    assert node == "c0"  # equal load: the first node, whatever it holds
    assert "pdtb_router_prefix_hit_requests_total{" not in metrics
