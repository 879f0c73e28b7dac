"""Prefix hit rates: the ideal one from the workload's blocks, the achieved one from the nodes'
/cluster counters, and both in the results of `pdtb bench serve`."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from app_thread import app_in_thread
from pdtb.client.serve import main
from pdtb.client.prefix import achieved_hit_rate, counter_increase, ideal_hit_rate, ideal_hit_tokens, prefix_figures
from pdtb.figures.records import RequestSpec
from pdtb.figures.results import format_table
from pdtb.client.load import RunConfig, run
from pdtb.figures.summary import summarize
from pdtb.client.traces import parse_jsonl, trace_specs

PAGE, VOCAB = 16, 1000


def make_spec(prompt_len: int, blocks, block_len: int = 512) -> RequestSpec:
    return RequestSpec(0.0, "t", "trace", prompt_len, 2, blocks=tuple(blocks), block_len=block_len)


def node(role: str, nid: str, queried: int, hit: int, in_extra: bool = False) -> dict:
    counters = {"prefix_query_tokens": queried, "prefix_hit_tokens": hit}
    return {"role": role, "id": nid, **({"extra": counters} if in_extra else counters)}


def test_ideal_hit_rate_by_hand():
    specs = [make_spec(1500, [1, 2, 3]),  # nothing seen yet: 0 of 1500
             make_spec(1200, [1, 2, 4]),  # 1, 2 seen: 1024
             make_spec(400, [1]),  # 400 (capped at its prompt)
             make_spec(2048, [1, 2, 3, 5]),  # 1, 2 and 3 (476 tokens of it were sent): 512 + 512 + 476
             make_spec(300, [])]  # no blocks: 0 of 300
    hit = 1024 + 400 + 1500
    assert ideal_hit_tokens(specs) == (hit, 1500 + 1200 + 400 + 2048 + 300)
    assert ideal_hit_rate(specs) == pytest.approx(hit / 5448)
    assert ideal_hit_rate([make_spec(10, [])]) is None


def test_ideal_hit_rate_of_a_trace_in_scaled_tokens():
    lines = [json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": ids})
             for i, (n, ids) in enumerate([(1024, [7, 8]), (1024, [7, 9]), (512, [10])])]
    specs, _ = trace_specs(parse_jsonl(lines), length_scale=0.25)
    assert ideal_hit_tokens(specs) == (128, 256 + 256 + 128)


def test_achieved_rate_from_two_readings():
    before = [node("prefill", "p0", 100, 10), node("decode", "d0", 500, 500), node("colocated", "c0", 0, 0)]
    after = [node("prefill", "p0", 300, 90), node("decode", "d0", 900, 900), node("colocated", "c0", 100, 20),
             node("prefill", "p1", 50, 0)]  # p1 joined during the run: counted from zero
    assert counter_increase(before, after) == (200 + 100 + 50, 80 + 20)
    assert achieved_hit_rate(before, after) == pytest.approx(100 / 350)


def test_achieved_rate_restart_extra_and_missing_readings():
    before, after = [node("prefill", "p0", 1000, 500)], [node("prefill", "p0", 40, 10)]  # restarted
    assert achieved_hit_rate(before, after) == pytest.approx(10 / 40)
    assert achieved_hit_rate([node("colocated", "c", 10, 0, True)], [node("colocated", "c", 30, 5, True)]) == 0.25
    assert achieved_hit_rate(None, after) is None and achieved_hit_rate(before, None) is None
    assert achieved_hit_rate([{"role": "prefill", "id": "p"}], [{"role": "prefill", "id": "p"}]) is None
    assert achieved_hit_rate([node("decode", "d", 0, 0)], [node("decode", "d", 9, 9)]) is None


def test_the_table_prints_both_rates_side_by_side():
    summary = summarize([], 1.0)
    assert "prefix hit rate" not in format_table(summary)
    summary.update(prefix_hit_rate=0.41, prefix_hit_rate_ideal=0.44)
    assert "prefix hit rate 0.41 (ideal 0.44)" in format_table(summary)
    summary.update(prefix_hit_rate=None)
    assert "prefix hit rate - (ideal 0.44)" in format_table(summary)


def caching_app() -> web.Application:
    """A router stand-in with a prefix cache of full 16-token pages on one prefill node; every
    request streams one token."""
    pages: set[tuple] = set()
    counters = {"q": 0, "h": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        ids = (await request.json())["prompt"]
        full = [tuple(ids[:end]) for end in range(PAGE, len(ids) + 1, PAGE)]
        hit = next((i for i, p in enumerate(full) if p not in pages), len(full)) * PAGE
        counters["q"] += len(ids)
        counters["h"] += hit
        pages.update(full)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x", "token_ids": [5]}]}\n\ndata: [DONE]\n\n')
        return resp

    async def models(_):
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 4096, "vocab_size": VOCAB}]})

    async def cluster(_):
        return web.json_response([node("prefill", "p0", counters["q"], counters["h"]), node("decode", "d0", 7, 7)])

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/cluster", cluster)
    return app


def test_run_reads_the_counters_around_the_requests():
    """Page-aligned blocks sent one at a time: the stand-in's page cache hits exactly the ideal."""
    specs = [make_spec(n, ids, 32) for n, ids in [(96, [1, 2, 3]), (80, [1, 2, 4]), (64, [1, 9]), (32, [])]]

    async def go():
        runner = web.AppRunner(caching_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            cfg = RunConfig(url, None, VOCAB, concurrency=1, progress=False, sample_interval=0, warmup=2)
            return await asyncio.wait_for(run(specs, cfg), 20)
        finally:
            await runner.cleanup()

    res = asyncio.run(go())
    assert [r.status for r in res.records] == ["ok"] * 4
    figures = prefix_figures(specs, res.cluster_before, res.cluster_after)
    assert figures["prefix_tokens_queried"] == 272 and figures["prefix_tokens_hit"] == 64 + 32
    assert figures["prefix_hit_rate"] == figures["prefix_hit_rate_ideal"] == pytest.approx(96 / 272)


def test_serve_writes_both_rates(tmp_path, capsys):
    out = tmp_path / "r.json"
    with app_in_thread(caching_app()) as url:
        rc = main(["--url", url, "--workload", "multi-tenant", "--num-tenants", "2", "--rate", "20",
                   "--duration", "0.5", "--prompt", "48", "--output", "1", "--system-prompt-tokens", "32",
                   "--concurrency", "1", "--quiet", "--out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    n = summary["overall"]["count"]
    assert summary["prefix_hit_rate_ideal"] == pytest.approx(32 * (n - 2) / (48 * n))
    assert summary["prefix_hit_rate"] == pytest.approx(summary["prefix_hit_rate_ideal"])
    assert f"prefix hit rate {summary['prefix_hit_rate']:.2f} (ideal" in capsys.readouterr().out
