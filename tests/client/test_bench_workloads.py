"""Workload generators (seeded, reproducible) and trace parsing of both formats."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdtb.client import workloads as wl
from pdtb.client.serve import build_parser, build_workload, main
from pdtb.figures.records import RequestSpec
from pdtb.client.traces import parse_azure_csv, parse_jsonl, read_trace, trace_specs

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def footprint(s: RequestSpec) -> int:
    return s.prompt_len + s.output_len


def test_whale_minnow_default_ratio_is_64_to_1():
    specs = wl.whale_minnow(wl.WhaleMinnowConfig(), seed=0)
    whales = [s for s in specs if s.klass == "whale"]
    minnows = [s for s in specs if s.klass == "minnow"]
    assert len(whales) == 2 and len(minnows) > 50
    assert {footprint(s) for s in whales} == {64 * footprint(minnows[0])}
    assert {footprint(s) for s in minnows} == {footprint(minnows[0])}
    assert {s.tenant for s in whales} == {"whale"} and {s.tenant for s in minnows} == {"minnow"}
    assert [s.send_time for s in specs] == sorted(s.send_time for s in specs)
    assert [s.send_time for s in whales] == pytest.approx([2.0, 16.0])  # evenly spaced from whale_start


def test_whale_minnow_seeded_and_options():
    cfg = wl.WhaleMinnowConfig(whales=4, minnow_rate=20, duration=5, whale_tenants=("A", "B"),
                               minnow_tenants=("C", "D"), minnow_prompt="uniform:10:20", minnow_priority=1)
    a, b, c = wl.whale_minnow(cfg, 7), wl.whale_minnow(cfg, 7), wl.whale_minnow(cfg, 8)
    assert a == b and a != c
    assert [s.tenant for s in a if s.klass == "whale"] == ["A", "B", "A", "B"]
    minnows = [s for s in a if s.klass == "minnow"]
    assert {s.tenant for s in minnows} == {"C", "D"} and {s.priority for s in minnows} == {1}
    assert all(10 <= s.prompt_len <= 20 for s in minnows) and all(s.send_time < 5 for s in a)
    assert 60 <= len(minnows) <= 140  # Poisson, 20/s for 5 s
    # the minnow stream does not depend on the number of whales
    fewer = wl.whale_minnow(wl.WhaleMinnowConfig(**{**vars(cfg), "whales": 1}), 7)
    assert [s for s in fewer if s.klass == "minnow"] == minnows


def test_long_context_whales_come_on_top_of_the_others():
    base = wl.WhaleMinnowConfig(whales=2, duration=10, whale_start=1.0, whale_interval=0.5, whale_tenants=("A", "B", "C"))
    cfg = wl.WhaleMinnowConfig(**{**vars(base), "context_whales": 4, "context_whale_start": 3.0,
                                  "context_whale_interval": 1.5})
    plain, mixed = wl.whale_minnow(base, 3), wl.whale_minnow(cfg, 3)
    extra = [s for s in mixed if s not in plain]
    assert [s for s in mixed if s in plain] == plain  # the whales and minnows of the plain run, unchanged
    assert [s.send_time for s in extra] == pytest.approx([3.0, 4.5, 6.0, 7.5])
    assert {(s.prompt_len, s.output_len, s.klass) for s in extra} == {(4032, 64, "whale")}
    minnow = next(s for s in plain if s.klass == "minnow")
    assert {footprint(s) for s in extra} == {64 * footprint(minnow)}  # the default keeps the 64x footprint
    assert [s.tenant for s in extra] == ["C", "A", "B", "C"]  # round-robin on from the whales before them
    # spread evenly from --whale-start when neither start nor interval is given
    spread = wl.whale_minnow(wl.WhaleMinnowConfig(**{**vars(base), "whales": 0, "context_whales": 3}), 3)
    assert [s.send_time for s in spread if s.klass == "whale"] == pytest.approx([1.0, 4.0, 7.0])
    for bad in ({"context_whales": -1}, {"context_whale_interval": -1.0}, {"context_whale_start": float("nan")}):
        with pytest.raises(ValueError):
            wl.whale_minnow(wl.WhaleMinnowConfig(**{**vars(base), "context_whales": 1, **bad}), 3)


def test_long_context_whales_from_the_command_line():
    a = build_parser().parse_args(["--url", "http://x", "--workload", "whale-minnow", "--whales", "1",
                                   "--duration", "5", "--context-whales", "2", "--context-whale-prompt", "100",
                                   "--context-whale-output", "uniform:3:5", "--context-whale-start", "2",
                                   "--context-whale-interval", "1"])
    specs, info = build_workload(a)
    ctx = [s for s in specs if s.klass == "whale" and s.prompt_len == 100]
    assert [s.send_time for s in ctx] == pytest.approx([2.0, 3.0]) and all(3 <= s.output_len <= 5 for s in ctx)
    assert info["whale_minnow"]["context_whales"] == 2


def test_length_distributions():
    rng = random.Random(1)
    assert wl.LengthDist.parse("64").sample(rng) == 64 == wl.LengthDist.parse("fixed:64").sample(rng)
    u = wl.LengthDist.parse("uniform:3:5")
    assert {u.sample(rng) for _ in range(200)} == {3, 4, 5}
    ln = wl.LengthDist.parse("lognormal:100:0.5")
    xs = sorted(ln.sample(rng) for _ in range(2001))
    assert 85 <= xs[1000] <= 115 and min(xs) >= 1  # median near 100
    for bad in ("x", "uniform:5:3", "lognormal:10", "0", "gamma:1:2"):
        with pytest.raises(ValueError):
            wl.LengthDist.parse(bad)


def test_multi_tenant_rates_weights_and_phases():
    tenants = wl.even_tenants(2, 30.0, [2, 1], "32", "8", on=1.0, off=1.0)
    assert [t.rate for t in tenants] == pytest.approx([20.0, 10.0])
    specs = wl.multi_tenant(tenants, 10.0, seed=3)
    assert specs == wl.multi_tenant(tenants, 10.0, seed=3)
    assert all((s.send_time % 2.0) < 1.0 for s in specs)  # nothing in the off phases
    n = {t: sum(s.tenant == t for s in specs) for t in ("t0", "t1")}
    assert 70 <= n["t0"] <= 130 and 30 <= n["t1"] <= 70  # 5 s on at 20/s and 10/s


def test_tenants_file_format():
    doc = {"duration": 20, "rate": 6.0, "tenants": [
        {"name": "A", "weight": 2, "prompt": "uniform:8:16", "output": "4", "class": "chat", "priority": 0},
        {"name": "B"},  # weight 1 of the total rate, default lengths
        {"name": "C", "rate": 1.5, "start": 5, "on": 2, "off": 3}]}
    tenants, duration = wl.parse_tenants(doc)
    assert duration == 20 and [t.rate for t in tenants] == pytest.approx([4.0, 2.0, 1.5])
    specs = wl.multi_tenant(tenants, duration, seed=0)
    a = [s for s in specs if s.tenant == "A"]
    assert {(s.klass, s.priority, s.output_len) for s in a} == {("chat", 0, 4)}
    assert all(s.send_time >= 5 and (s.send_time - 5) % 5 < 2 for s in specs if s.tenant == "C")
    with pytest.raises(ValueError):
        wl.parse_tenants({"tenants": [{"name": "A"}]})  # no rate anywhere


@pytest.mark.parametrize("doc,says", [
    ({"duration": "abc", "rate": 1, "tenants": [{"name": "A"}]}, "'duration'"),
    ({"duration": 0, "rate": 1, "tenants": [{"name": "A"}]}, "'duration'"),
    ({"duration": True, "rate": 1, "tenants": [{"name": "A"}]}, "'duration'"),
    ({"rate": 1, "tenants": [{"name": "A", "on": 0, "off": 0}]}, "'on'"),
    ({"rate": 1, "tenants": [{"name": "A", "on": 1, "off": -1}]}, "'off'"),
    ({"rate": 1, "tenants": [{"name": "A", "weight": 0}, {"name": "B", "weight": 0}]}, "weights"),
    ({"rate": 1, "tenants": [{"name": "A"}, {"name": "A"}]}, "given more than once"),
    ({"rate": 1, "tenants": [{"name": "A", "priority": "high"}]}, "'priority'"),
    ({"rate": 1, "tenants": [{"name": "A", "tier": "bad tier!"}]}, "'tier'"),
    ({"rate": 1, "tenants": [{"name": None}]}, "'name'"),
    ({"rate": 1, "tenants": [{"prompt": "8"}]}, "'name'"),
    ({"tenants": [{"name": "A", "rate": float("nan")}]}, "'rate'"),
    ({"rate": -2, "tenants": [{"name": "A"}]}, "'rate'"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_tenants_file_field_out_of_range_is_named(doc, says):
    """Each bad field is a ValueError naming it, not a crash or another workload than the file's."""
    with pytest.raises(ValueError, match=says):
        wl.parse_tenants(doc)


def test_clamp_to_context():
    s = RequestSpec(0.0, "a", "x", 100, 20)
    assert wl.clamp_to_context(s, 200) == (s, False)
    got, changed = wl.clamp_to_context(s, 64)
    assert changed and (got.prompt_len, got.output_len) == (44, 20)
    got, _ = wl.clamp_to_context(RequestSpec(0.0, "a", "x", 10, 500), 64)
    assert (got.prompt_len, got.output_len) == (1, 63)


JSONL = """{"timestamp": 1000, "tenant": "x", "input_length": 100, "output_length": 10, "priority": 2}
{"timestamp": 0, "input_length": 50, "output_length": 5, "hash_ids": [1, 2]}

{"timestamp": 3000, "tenant": "y", "input_length": 4000, "output_length": 300}
"""
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.5000000,374,44
2023-11-16 18:15:48.7500000,396,109
2023-11-16 18:16:00.0000000,2000,0
"""


def test_trace_jsonl_and_scaling():
    rows = parse_jsonl(JSONL.splitlines())
    assert [(r.timestamp, r.tenant, r.priority) for r in rows] == [(1.0, "x", 2), (0.0, "default", None),
                                                                    (3.0, "y", None)]
    specs, info = trace_specs(rows, length_scale=0.5, max_context=1024, time_scale=0.1)
    assert [(s.send_time, s.tenant, s.prompt_len, s.output_len, s.priority) for s in specs] == [
        (0.0, "default", 25, 2, None), (pytest.approx(0.1), "x", 50, 5, 2), (pytest.approx(0.3), "y", 874, 150, None)]
    assert info["clamped_by_max_context"] == 1 and info["time_scale"] == 0.1 and info["length_scale"] == 0.5
    specs, info = trace_specs(rows, max_requests=2)
    assert len(specs) == 2 and info["max_requests"] == 2 and specs[1].send_time == pytest.approx(1.0)


def test_trace_azure_csv(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    rows, fmt = read_trace(path)
    assert fmt == "azure-csv" and len(rows) == 3
    specs, info = trace_specs(rows)
    assert [s.send_time for s in specs] == pytest.approx([0.0, 2.25, 13.5])
    assert [(s.prompt_len, s.output_len) for s in specs] == [(374, 44), (396, 109), (2000, 1)]  # >= 1 token
    assert info["outputs_raised_to_one"] == 1
    with pytest.raises(ValueError):
        parse_azure_csv(["TIMESTAMP,ContextTokens,GeneratedTokens", "yesterday,1,2"])


@pytest.mark.parametrize("line,what", [
    ('{"timestamp": NaN, "input_length": 5, "output_length": 3}', "timestamp"),
    ('{"timestamp": -5, "input_length": 5, "output_length": 3}', "timestamp"),
    ('{"timestamp": true, "input_length": 5, "output_length": 3}', "timestamp"),
    ('{"timestamp": 0, "input_length": -7, "output_length": 3}', "input length"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 3}', "input length"),
    ('{"timestamp": 0, "input_length": 10.9, "output_length": 3}', "input length"),
    ('{"timestamp": 0, "input_length": true, "output_length": 3}', "input length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1}', "output length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 3, "priority": 1.7}', "priority"),
    ('{"timestamp": 0, "output_length": 3}', "no 'input_length' field"),
])
def test_a_bad_trace_row_is_refused_with_its_line(line, what):
    """A bad row is refused, naming its line: accepted, a NaN timestamp would fire the whole
    trace at t = 0, and bad lengths would be truncated or raised to 1 without a word."""
    good = '{"timestamp": 0, "input_length": 5, "output_length": 3}'
    with pytest.raises(ValueError, match=f"trace line 2: .*{what}"):
        parse_jsonl([good, line])


def test_a_trace_spanning_more_than_max_span_is_refused():
    """A timestamp far from the rest (1e300 ms) would have the client sleep for ever: refused,
    unless --time-scale brings the span within MAX_SPAN_S."""
    from pdtb.client.traces import MAX_SPAN_S, trace_specs

    rows = parse_jsonl(['{"timestamp": 0, "input_length": 5, "output_length": 3}',
                        '{"timestamp": 1e300, "input_length": 5, "output_length": 3}'])
    with pytest.raises(ValueError, match="spans"):
        trace_specs(rows)
    far = parse_jsonl(['{"timestamp": 0, "input_length": 5, "output_length": 3}',
                       f'{{"timestamp": {MAX_SPAN_S * 2000}, "input_length": 5, "output_length": 3}}'])
    assert trace_specs(far, time_scale=0.25)[0][-1].send_time == pytest.approx(MAX_SPAN_S / 2)


def test_trace_files_with_a_byte_order_mark_or_comments(tmp_path):
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_text("\ufeff# exported 2026-11-23\n" + '{"timestamp": 0, "input_length": 5.0, "output_length": 3, "tenant": 0}\n',
                     encoding="utf-8")
    rows, fmt = read_trace(jsonl)  # not read as an Azure CSV of 0 rows
    assert fmt == "jsonl" and [(r.input_length, r.tenant) for r in rows] == [(5, "0")]
    csv_path = tmp_path / "bom.csv"
    csv_path.write_text("\ufeff" + AZURE, encoding="utf-8")
    rows, fmt = read_trace(csv_path)  # not KeyError('TIMESTAMP')
    assert fmt == "azure-csv" and len(rows) == 3


def test_cli_builds_the_same_workload_for_the_same_seed(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text(JSONL)
    argv = ["--workload", f"trace:{tmp_path / 't.jsonl'}", "--length-scale", "2", "--max-context", "512"]
    specs, info = build_workload(build_parser().parse_args(argv))
    assert info["trace"]["format"] == "jsonl" and info["trace"]["max_context"] == 512
    assert all(s.prompt_len + s.output_len <= 512 for s in specs)
    args = build_parser().parse_args(["--workload", "multi-tenant", "--seed", "5", "--duration", "5"])
    assert build_workload(args)[0] == build_workload(args)[0]
    assert main(["--workload", "whale-minnow", "--dry-run", "--duration", "5"]) == 0
    assert "class whale: 2 requests" in capsys.readouterr().out
    assert main(["--workload", "nope", "--dry-run"]) == 2


def test_azure_timestamps_with_offsets_are_utc_whatever_the_local_zone(tmp_path, monkeypatch):
    """The 2024 Azure traces carry a UTC offset ('...009930+00:00'), and they load. A time
    without one is read as UTC, not in the machine's local zone, where a trace across a
    daylight-saving change would shift by an hour."""
    import time

    csv_2024 = "TIMESTAMP,ContextTokens,GeneratedTokens\n" \
               "2024-05-10 00:00:00.009930+00:00,100,10\n2024-05-10T00:00:01.5Z,50,5\n" \
               "2024-05-10 02:00:03+02:00,20,2\n"
    rows = parse_azure_csv(csv_2024.splitlines())
    assert [r.timestamp - rows[0].timestamp for r in rows] == pytest.approx([0.0, 1.49007, 2.99007])
    dst = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-05 00:59:00,1,1", "2023-11-05 01:30:00,1,1",
           "2023-11-05 02:10:00,1,1"]
    for zone in ("UTC", "America/New_York"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        specs, _ = trace_specs(parse_azure_csv(dst))
        assert [sp.send_time for sp in specs] == [0.0, 1860.0, 4260.0], zone
    monkeypatch.delenv("TZ")
    time.tzset()


def test_trace_errors_name_the_real_line_and_never_trace_back(tmp_path):
    header = "TIMESTAMP,ContextTokens,GeneratedTokens"
    with pytest.raises(ValueError, match="trace line 6: "):  # DictReader skips blank lines: its row count says 'line 3'
        parse_azure_csv([header, "", "", "", "2023-11-16 18:15:46.1,5,5", "2023-11-16 18:15:47.1,0,5"])
    huge = "1" * 400
    for line in (f'{{"timestamp": 0, "input_length": {huge}, "output_length": 5}}',
                 f'{{"timestamp": {huge}, "input_length": 5, "output_length": 5}}',
                 '{"timestamp": 0, "input_length": 5, "output_length": 5, "priority": 1e300}',
                 '[{"timestamp": 0, "input_length": 5, "output_length": 5}]'):
        with pytest.raises(ValueError, match="trace line 1: "):  # OverflowError escaped; 1e300 passed
            parse_jsonl([line])
    for text in ("", header + "\n"):
        (tmp_path / "empty").write_text(text)
        with pytest.raises(ValueError, match="no requests"):  # not a silent 0-request workload
            read_trace(tmp_path / "empty")


def test_max_context_below_two_is_refused(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text(JSONL)
    for bad in ("1", "0", "-5"):  # gave outputs of 0 or -6 tokens; 0 silently turned clamping off
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--workload", f"trace:{tmp_path / 't.jsonl'}", "--max-context", bad])
    with pytest.raises(ValueError, match="at least 2"):
        trace_specs(parse_jsonl(JSONL.splitlines()), max_context=1)
    specs, info = trace_specs(parse_jsonl(JSONL.splitlines()), max_context=2)
    assert all((sp.prompt_len, sp.output_len) == (1, 1) for sp in specs)
    assert main(["--workload", f"trace:{tmp_path / 't.jsonl'}", "--max-context", "2", "--dry-run"]) == 0
    assert "clamped by --max-context" in capsys.readouterr().out


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"shared traces not found at {TRACES}")
def test_real_traces():
    rows, fmt = read_trace(TRACES / "azure_llm_conv_2023.csv")
    assert fmt == "azure-csv" and len(rows) == 19366
    specs, _ = trace_specs(rows, max_requests=100)
    assert len(specs) == 100 and specs[0].send_time == 0.0 and specs[-1].send_time > 0
    rows, fmt = read_trace(TRACES / "vtc_multitenant_600s.jsonl")
    assert fmt == "jsonl" and len(rows) == 1500 and len({r.tenant for r in rows}) == 27
    specs, info = trace_specs(rows, time_scale=0.5)
    assert info["span_s"] == pytest.approx(max(r.timestamp for r in rows) * 0.5, abs=1.0)
    json.dumps(info)


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    """Gamma gaps of shape k and mean 1/rate: the coefficient of variation is 1/sqrt(k); k = 1
    draws the very Poisson stream (seeded workloads unchanged)."""
    import random
    import statistics

    from pdtb.client.workloads import poisson_times

    assert poisson_times(random.Random(1), 5.0, 0, 200) == poisson_times(random.Random(1), 5.0, 0, 200, 1.0)
    for k in (0.25, 4.0):
        t = poisson_times(random.Random(2), 5.0, 0.0, 2000.0, k)
        gaps = [b - a for a, b in zip(t, t[1:])]
        assert len(t) / 2000.0 == pytest.approx(5.0, rel=0.1)
        assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(k ** -0.5, rel=0.1)
    with pytest.raises(ValueError):
        poisson_times(random.Random(0), 1.0, 0, 1, 0.0)


def test_slo_tiers_reach_the_specs_and_the_request_body():
    """--whale-tier/--minnow-tier and a tenants file's "tier" go out as each request's slo_tier
    (none given: no field, the router's tenant default applies); a sweep's levels keep them."""
    from pdtb.client.load import RunConfig, request_body
    from pdtb.client.sweep import build_parser, level_specs
    from pdtb.client.workloads import WhaleMinnowConfig, parse_tenants, whale_minnow

    specs = whale_minnow(WhaleMinnowConfig(whales=2, duration=5.0, context_whales=1, whale_tier="batch",
                                           minnow_tier="interactive"), seed=3)
    assert {(s.klass, s.slo_tier) for s in specs} == {("whale", "batch"), ("minnow", "interactive")}
    cfg = RunConfig("http://x", None, 1000)
    bodies = [json.loads(request_body(cfg, i, s)) for i, s in enumerate(specs)]
    assert all(b["slo_tier"] == ("batch" if s.klass == "whale" else "interactive") for b, s in zip(bodies, specs))
    plain = whale_minnow(WhaleMinnowConfig(whales=1, duration=2.0), seed=3)
    assert "slo_tier" not in json.loads(request_body(cfg, 0, plain[0]))
    tenants, _ = parse_tenants({"rate": 2, "tenants": [{"name": "a", "tier": "gold"}, {"name": "b"}]})
    assert [t.tier for t in tenants] == ["gold", None]
    a = build_parser().parse_args(["--url", "x", "--workload", "whale-minnow", "--duration", "3", "--whales", "1",
                                   "--whale-tier", "batch", "--minnow-tier", "interactive"])
    level = level_specs(a, 2.0, 6.0, closed=False)
    assert {s.slo_tier for s in level} == {"batch", "interactive"}
