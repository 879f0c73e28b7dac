"""Prefix sharing in the simulator: prompts built from their blocks as the client builds them,
prefill and colocated nodes reusing cached pages by the scheduler's own rule (whole pages, a
prompt's last token always computed). Hit tokens against figures worked by hand."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pdtb.figures.records import RequestSpec
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.flags import page_spec
from pdtb.sim.node import NodeShape
from pdtb.sim.roofline import RooflineCost
from pdtb.sim.run import build_parser, simulate

COST = RooflineCost.of("h100-sxm", "llama-3-8b")  # 16-token pages

# blocks of 32 tokens (two pages); each request ends before the next is sent
SPECS = [
    RequestSpec(0.0, "a", "x", 100, 4, blocks=(1, 2, 3), block_len=32),
    # blocks 1 and 2 were sent: 64 tokens, four whole pages
    RequestSpec(1.0, "b", "x", 100, 4, blocks=(1, 2, 4), block_len=32),
    # blocks 1, 2, 3 were sent (96 tokens), but the last token is computed: (96 - 1) // 16 = 5 pages
    RequestSpec(2.0, "a", "x", 96, 4, blocks=(1, 2, 3), block_len=32),
    # nothing of its own block 9 was sent: no hit, whatever its tail
    RequestSpec(3.0, "c", "x", 80, 4, blocks=(9,), block_len=32),
]
HIT, QUERY = 64 + 80, 100 + 100 + 96 + 80


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_hit_tokens_are_the_whole_pages_sent_before(mode):
    nodes = (NodeShape("colocated", 256),) if mode == "colocated" else \
        (NodeShape("prefill", 256), NodeShape("decode", 256))
    c = SimCluster(ClusterShape(nodes, prefix_cache=True), page_spec(COST.page_bytes, COST.page_size), COST)
    recs = c.run(SPECS)
    assert all(r.status == "ok" and r.output_tokens == 4 for r in recs)
    assert c.prefix_figures() == {"query_tokens": QUERY, "hit_tokens": HIT, "hit_rate": HIT / QUERY}
    # a prompt that found pages cached prefills less: its first token comes sooner than an
    # equal prompt's without the cache
    off = SimCluster(ClusterShape(nodes), page_spec(COST.page_bytes, COST.page_size), COST)
    recs_off = off.run(SPECS)
    assert off.prefix_figures() is None
    ttft = [r.first_token_time - r.send_time for r in recs]
    ttft_off = [r.first_token_time - r.send_time for r in recs_off]
    assert ttft[0] == pytest.approx(ttft_off[0]) and ttft[3] == pytest.approx(ttft_off[3])
    assert ttft[1] < ttft_off[1] and ttft[2] < ttft_off[2]
    for n in c.nodes.values():  # every page back (cached pages are free pages)
        assert n.pool.num_free == n.pool.num_pages


def test_unshared_prompts_share_nothing_and_decide_as_without_the_cache():
    specs = [dataclasses.replace(s, blocks=(), block_len=0) for s in SPECS]
    nodes = (NodeShape("prefill", 256), NodeShape("decode", 256))
    on = SimCluster(ClusterShape(nodes, prefix_cache=True), page_spec(COST.page_bytes, COST.page_size), COST)
    off = SimCluster(ClusterShape(nodes), page_spec(COST.page_bytes, COST.page_size), COST)
    a, b = on.run(specs), off.run(specs)
    assert on.prefix_figures()["hit_tokens"] == 0
    assert [r.token_times for r in a] == [r.token_times for r in b]


def test_the_command_turns_the_cache_on_for_shared_blocks_only(tmp_path):
    base = ["--mode", "disagg", "--cost", "roofline", "--gpu", "h100-sxm", "--model-config", "llama-3-8b"]
    a = build_parser().parse_args(base)
    _, figures, cluster = simulate(a, SPECS)
    assert cluster.shape.prefix_cache and figures["prefix"]["hit_tokens"] == HIT
    assert figures["prefix"]["ideal_hit_rate"] == pytest.approx((64 + 96) / QUERY)  # by block, not by page
    a = build_parser().parse_args([*base, "--prefix-cache", "off"])
    _, figures, cluster = simulate(a, SPECS)
    assert not cluster.shape.prefix_cache and "prefix" not in figures


def test_a_simulated_results_file_has_the_prefix_keys_of_a_real_one(tmp_path):
    from pdtb.sim.run import main

    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 1000, "output_length": 4, "hash_ids": [1, 2, 3 + i]}
            for i in range(4)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert main(["--workload", f"trace:{trace}", "--mode", "colocated", "--cost", "roofline", "--gpu", "h100-sxm",
                 "--model-config", "llama-3-8b", "--quiet", "--out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    # 512-token blocks: blocks 1 and 2 (1024 tokens, all but the prompt's last) hit from the second request on
    assert s["prefix_tokens_queried"] == 4000 and s["prefix_tokens_hit"] == 3 * 992
    assert s["prefix_hit_rate"] == pytest.approx(3 * 992 / 4000) and s["prefix_hit_rate_ideal"] == pytest.approx(3 * 1000 / 4000)
