"""`pdtb bench router`: its added-latency arithmetic by hand, its prompts, and one short run
of the real router and the relay in front of the scripted nodes."""
from __future__ import annotations

import json

import pytest

from pdtb.microbench.router_load import Shot, added_latency


def test_added_latency_worked_by_hand():
    # client: sent at 10.0, token 1 at 10.5, tokens 2 and 3 in one chunk at 10.6
    # node: got it at 10.1, sent its tokens at 10.3, 10.45, 10.55
    shot = Shot(10.0, "r1", [(10.5, 1), (10.6, 2)])
    lat = added_latency([shot], {"recv": {"r1": 10.1}, "sends": {"r1": [10.3, 10.45, 10.55]}})
    assert lat["requests"] == 1
    assert lat["ttft_p50_ms"] == pytest.approx(300.0)  # (10.5 - 10.0) - (10.3 - 10.1)
    assert lat["delay_p50_ms"] == pytest.approx(150.0)  # delays 200, 150, 50 ms: the middle one
    assert lat["delay_p99_ms"] == pytest.approx(200.0)
    # client gaps 100 and 0 ms, node gaps 150 and 100 ms: p50 (upper middle) 100 - 150
    assert lat["itl_p50_ms"] == pytest.approx(-50.0)
    assert lat["itl_p99_ms"] == pytest.approx(100.0 - 150.0)


def test_failed_and_unknown_requests_are_left_out():
    shots = [Shot(0.0, "r1", [(1.0, 1)], error="HTTP 503"), Shot(0.0, "r2", [(1.0, 1)])]
    assert added_latency(shots, {"recv": {}, "sends": {}})["requests"] == 0


def test_prompts_have_about_the_tokens_asked_for(llama_dir):
    from pdtb.engine.tokenizer import load_tokenizer
    from pdtb.microbench.router import Prompts

    tok = load_tokenizer(llama_dir)
    p = Prompts(tok)
    for n in (24, 2048):
        got = len(tok(p.text(n), add_special_tokens=False)["input_ids"])
        assert abs(got - n) <= 0.1 * n + 2
    words = tok.decode(p.vocab[:5])  # every output token is one word led by a space: one per space
    assert words.count(" ") == 5


@pytest.mark.slow
def test_a_short_bench_run_counts_every_token_and_fits_both_targets(tmp_path):
    from pdtb.microbench.router import main

    out = tmp_path / "bench.json"
    assert main(["--quick", "--only", "cost,saturation", "--nodes", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["target"] for r in rows} == {"router", "relay"}
    for r in rows:
        assert r["failed"] == 0 and r["short"] == 0, r
        assert r["tokens"] == r["requests"] * r["settings"]["max_tokens"]
        assert r["cpu_s"] > 0
    for target in ("router", "relay"):
        assert result["fit"][target]["cpu_us_per_token"] > 0
    assert result["vs_relay"]["tok_per_s_ratio"] > 0
