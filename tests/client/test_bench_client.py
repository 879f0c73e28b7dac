"""The load-test client against an in-process slow OpenAI-style SSE server with known delays."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from app_thread import app_in_thread, start
from pdtb.client.serve import main
from pdtb.figures.records import RequestRecord, RequestSpec
from pdtb.client.load import RunConfig, request_body, run
from pdtb.client.sse import SSEParser, count_tokens
from pdtb.figures.summary import summarize

VOCAB, MAX_LEN = 1000, 512


def make_app(first_s: float, itl_s: float, state: dict | None = None, hold: int = 1) -> web.Application:
    """A router stand-in: first token after `first_s`, then one token every `itl_s`. Tenant
    "bad" fails after its first token; prompts over MAX_LEN are rejected with 400. Without
    token_ids, `hold` > 1 sends text only with every `hold`-th token (as a detokenizer holding
    back partial characters does); the usage chunk reports every token."""
    state = state if state is not None else {}
    state.update(in_flight=0, max_in_flight=0, bodies=[])

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["bodies"].append(body)
        if len(body["prompt"]) + body["max_tokens"] > MAX_LEN:
            return web.json_response({"error": {"message": "too long", "type": "invalid_request_error"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            n = 0 if body["user"] == "empty" else body["max_tokens"]  # "empty": [DONE] and nothing else
            await asyncio.sleep(first_s)
            for i in range(n):
                if i and body["user"] == "bad":
                    await resp.write(b'data: {"error": {"message": "node died", "type": "server_error"}}\n\n')
                    n = 0  # no usage after an error
                    break
                choice = {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1 else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [7]
                chunk = {"choices": [choice]}
                if i == n - 1:
                    chunk["pdtb_timing"] = {"prefill_s": 0.01}
                if body.get("return_token_ids") or (i + 1) % hold == 0 or i == n - 1:
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if i < n - 1:
                    await asyncio.sleep(itl_s)
            if n and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n, "total_tokens": n,
                         # half the prompt served from a prefix cache; "plain": vLLM without the details flag
                         "prompt_tokens_details": None if body["user"] == "plain" else
                         {"cached_tokens": len(body["prompt"]) // 2}}
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        finally:
            state["in_flight"] -= 1
        return resp

    async def models(_):
        return web.json_response({"data": [{"id": "tiny", "max_model_len": MAX_LEN, "vocab_size": VOCAB}]})

    async def cluster(_):
        return web.json_response([
            {"role": "prefill", "id": "p0", "pages_total": 100, "pages_free": 90, "extra": {}},
            {"role": "decode", "id": "d0", "pages_total": 100, "pages_free": 40,
             "extra": {"policy": "vtc", "tenant_pages": {"whale": 50, "minnow": 10}}}])

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/cluster", cluster)
    return app


def run_against(app, specs, **cfg):
    async def go():
        runner, url = await start(app)
        try:
            return await asyncio.wait_for(run(specs, RunConfig(url, None, VOCAB, progress=False, **cfg)), 20)
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_measured_ttft_and_itl_match_injected_delays():
    """First token after 200 ms, then one every 50 ms: the client must see that at the p50
    (±15 ms: the machine is shared), and its own overhead must be small."""
    specs = [RequestSpec(0.05 * i, f"t{i % 2}", "c", 32, 6) for i in range(6)]
    res = run_against(make_app(0.200, 0.050), specs, sample_interval=0.1)
    assert [r.status for r in res.records] == ["ok"] * 6
    assert all(r.output_tokens == 6 and len(r.token_times) == 6 for r in res.records)
    s = summarize(res.records, res.duration)["overall"]
    assert s["ttft_ms"]["p50"] == pytest.approx(200, abs=15)
    assert s["itl_ms"]["p50"] == pytest.approx(50, abs=15)
    assert s["tpot_ms"]["p50"] == pytest.approx(50, abs=15)
    assert s["e2e_ms"]["p50"] == pytest.approx(450, abs=30)
    assert res.records[0].server_timing == {"prefill_s": 0.01}
    over = res.client_overhead
    assert over["dispatch_lag_ms"]["p50"] < 15 and over["parse_us_per_token"]["p50"] < 2000
    assert [r.scheduled_time for r in res.records] == pytest.approx([0.05 * i for i in range(6)])
    assert res.samples and res.samples[0]["nodes"][1]["tenant_pages"] == {"whale": 50, "minnow": 10}


def test_the_servers_cached_prompt_tokens_are_recorded_per_request():
    specs = [RequestSpec(0.0, "t", "c", 16, 2), RequestSpec(0.0, "plain", "c", 16, 2)]
    res = run_against(make_app(0.01, 0.01), specs, sample_interval=0)
    assert [(r.status, r.cached_tokens) for r in res.records] == [("ok", 8), ("ok", None)]
    back = [RequestRecord.from_json(json.loads(json.dumps(r.to_json()))) for r in res.records]
    assert [r.cached_tokens for r in back] == [8, None]
    old = {k: v for k, v in res.records[0].to_json().items() if k != "cached_tokens"}  # a file from before the field
    assert RequestRecord.from_json(old).cached_tokens is None


def test_without_token_ids_the_output_count_comes_from_usage():
    """Text arrives with every other token (held back in between): the stream shows 3 chunks
    for 6 tokens, the usage chunk says 6, and the record keeps both."""
    specs = [RequestSpec(0.0, "t", "c", 16, 6)]
    res = run_against(make_app(0.05, 0.02, hold=2), specs, sample_interval=0, return_token_ids=False)
    rec = res.records[0]
    assert rec.status == "ok" and rec.output_tokens == 6 and len(rec.token_times) == 3
    s = summarize(res.records, res.duration)["overall"]
    assert s["tpot_ms"]["p50"] == pytest.approx((rec.end_time - rec.first_token_time) * 1000 / 5)


def test_max_concurrency_caps_an_open_loop():
    """Six arrivals at once, at most two in flight: the rest wait for a slot (dispatch lag)."""
    state: dict = {}
    specs = [RequestSpec(0.0, "t", "c", 8, 3) for _ in range(6)]
    res = run_against(make_app(0.05, 0.01, state), specs, sample_interval=0, max_concurrency=2)
    assert [r.status for r in res.records] == ["ok"] * 6 and state["max_in_flight"] == 2
    assert max(r.send_time - r.scheduled_time for r in res.records) > 0.05  # waited for a slot
    s = summarize(res.records, res.duration, {"ttft_ms": 10_000})["overall"]
    span = max(r.end_time for r in res.records) - min(r.send_time for r in res.records)
    assert s["request_rps"] == pytest.approx(6 / span)
    assert s["total_tok_s"] == pytest.approx(6 * (8 + 3) / span) and s["slo_attainment"] == 1.0


def test_warm_up_requests_go_first_and_are_not_recorded():
    state: dict = {}
    specs = [RequestSpec(0.0, "t", "c", 8, 6) for _ in range(2)]
    res = run_against(make_app(0.01, 0.005, state), specs, sample_interval=0, warmup=3)
    assert len(res.records) == 2 and res.warmup_failed == 0
    assert [b["max_tokens"] for b in state["bodies"]] == [4, 4, 4, 6, 6]  # the warm-up went first
    assert state["bodies"][0]["prompt"] != state["bodies"][3]["prompt"]  # not the run's prompts


def test_failures_closed_loop_and_request_shape():
    state: dict = {}
    specs = [RequestSpec(0.0, "good", "c", 10, 3, priority=1), RequestSpec(0.0, "bad", "c", 10, 3),
             RequestSpec(0.0, "good", "c", 600, 3)] + [RequestSpec(0.0, "good", "c", 5, 2) for _ in range(3)]
    res = run_against(make_app(0.01, 0.005, state), specs, concurrency=2, sample_interval=0)
    recs = res.records
    assert [r.status for r in recs] == ["ok", "failed", "failed", "ok", "ok", "ok"]
    assert recs[1].error == "node died" and recs[1].output_tokens == 1 and recs[1].first_token_time is not None
    assert recs[2].error.startswith("HTTP 400") and recs[2].first_token_time is None
    assert state["max_in_flight"] <= 2  # closed loop: never more than --concurrency in flight
    first = next(b for b in state["bodies"] if b.get("priority") == 1)
    assert len(first["prompt"]) == 10 and all(16 <= t < VOCAB for t in first["prompt"])
    assert first["ignore_eos"] is True and first["user"] == "good" and first["max_tokens"] == 3
    assert sum("priority" in b for b in state["bodies"]) == 1  # sent only when the spec has one
    assert res.samples == []


def test_prompt_ids_are_seeded():
    cfg = RunConfig("http://x", None, VOCAB, seed=3)
    spec = RequestSpec(0.0, "a", "c", 50, 4)
    assert request_body(cfg, 5, spec) == request_body(cfg, 5, spec)
    assert request_body(cfg, 5, spec) != request_body(cfg, 6, spec)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=20), st.booleans())
def test_sse_parser_any_split(cuts, crlf):
    nl = b"\r\n" if crlf else b"\n"
    events = [{"choices": [{"text": "a", "token_ids": [1, 2]}]}, {"choices": [{"text": "b"}]}]
    raw = b": keep-alive" + nl + nl + b"".join(b"data: " + json.dumps(e).encode() + nl + nl for e in events)
    raw += b"event: x" + nl + b"data: [DONE]" + nl + nl
    parser, got, pos = SSEParser(), [], 0
    for c in cuts:
        got += parser.feed(raw[pos:pos + c])
        pos += c
    got += parser.feed(raw[pos:]) + parser.close()
    assert got[-1] == "[DONE]" and [json.loads(g) for g in got[:-1]] == events
    assert [count_tokens(json.loads(g)) for g in got[:-1]] == [2, 1]


def test_cli_end_to_end(tmp_path, capsys):
    """`main` against the server in a thread: results file keys, labels read from /cluster."""
    out = tmp_path / "r.json"
    with app_in_thread(make_app(0.02, 0.005)) as url:
        rc = main(["--url", url, "--workload", "whale-minnow", "--whales", "1", "--whale-prompt", "400",
                   "--whale-output", "200", "--whale-start", "0", "--minnow-rate", "20", "--minnow-prompt", "8",
                   "--minnow-output", "3", "--duration", "0.4", "--seed", "2", "--out", str(out),
                   "--slo", "ttft_ms=5000", "--sample-interval", "0.05", "--quiet", "--label-mode", "test"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert list(data) == ["meta", "requests", "summary", "samples"]
    meta = data["meta"]
    assert (meta["mode"], meta["policy"], meta["seed"], meta["workload"]) == ("test", "vtc", 2, "whale-minnow")
    assert meta["clamped_to_context"] == 1  # the 600-token whale is clamped to the 512 context
    assert {"dispatch_lag_ms", "parse_us_per_token", "loop_lag_ms"} <= set(meta["client_overhead"])
    req = data["requests"][0]
    assert list(req)[:11] == ["tenant", "class", "prompt_tokens", "output_tokens", "send_time", "first_token_time",
                              "token_times", "end_time", "status", "error", "server_timing"]
    whale = next(r for r in data["requests"] if r["class"] == "whale")
    assert whale["prompt_tokens"] + whale["output_tokens"] == MAX_LEN and whale["status"] == "ok"
    summary = data["summary"]
    assert set(summary) >= {"overall", "per_tenant", "per_class", "fairness"}
    assert set(summary["overall"]) == {"count", "failed", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms",
                                       "output_tok_s", "total_tok_s", "request_rps", "goodput_rps",
                                       "slo_attainment"}
    assert set(summary["fairness"]) >= {"service", "normalized_service", "jain_index", "max_service_gap",
                                        "share_jain_mean", "share_jain_min"}
    assert summary["overall"]["failed"] == 0 and data["samples"]
    assert "class whale" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--concurrency", "0"), ("--concurrency", "-1"), ("--max-requests", "0"),
                                        ("--time-scale", "-2"), ("--request-timeout", "nan")])
def test_counts_and_scales_must_be_positive(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--workload", "multi-tenant", "--dry-run", "--duration", "1", flag, value])
    assert e.value.code == 2 and "above 0" in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["multi-tenant", "whale-minnow"])
@pytest.mark.parametrize("flag,value", [("--time-scale", "0.1"), ("--length-scale", "0.5"), ("--max-context", "512"),
                                        ("--block-tokens", "16")])
def test_a_trace_flag_on_a_generated_workload_is_refused_not_ignored(workload, flag, value, capsys):
    assert main(["--workload", workload, "--dry-run", "--duration", "1", flag, value]) == 2
    assert f"{flag}: trace replay only" in capsys.readouterr().err


def test_serve_refuses_an_unwritable_out_and_explains_a_dead_url(capsys, tmp_path):
    """--out is checked before any request is sent (a bad path found afterwards loses the results
    of a whole run), and a server that cannot be reached gets one readable line, not aiohttp's repr."""
    import socket

    from pdtb.client.serve import main as serve_main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert serve_main(["--url", url, "--workload", "whale-minnow", "--out", str(tmp_path / "no/dir/r.json")]) == 2
    assert "cannot write --out" in capsys.readouterr().err
    assert serve_main(["--url", url, "--workload", "whale-minnow", "--out", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdtb bench serve: cannot read") and "cannot connect" in err and "ConnectionKey" not in err
    assert not (tmp_path / "r.json").exists()


def test_a_stream_without_tokens_fails_and_rates_start_at_the_first_send():
    """A stream that ends with [DONE] but never carried a token is a failure (as vLLM's client:
    no TTFT, no success), not an ok request that meets every SLO. Throughput is over first
    send to last completion: arrivals due from 0.4 s do not count the 0.4 s before them."""
    specs = [RequestSpec(0.4, "t", "c", 8, 3), RequestSpec(0.4, "empty", "c", 8, 3)]
    res = run_against(make_app(0.05, 0.01), specs, sample_interval=0)
    ok, empty = res.records
    assert ok.status == "ok" and empty.status == "failed" and "without an output token" in empty.error
    summary = summarize(res.records, res.duration, {"ttft_ms": 10_000})
    span = max(r.end_time for r in res.records) - min(r.send_time for r in res.records)
    assert summary["duration_s"] == pytest.approx(span) and summary["run_s"] == res.duration >= 0.4 + span
    s = summary["overall"]
    assert s["failed"] == 1 and s["request_rps"] == pytest.approx(1 / span) and s["slo_attainment"] == 0.5
