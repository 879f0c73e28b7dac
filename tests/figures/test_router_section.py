"""The router's results section, rendered from bench files written by hand."""
from __future__ import annotations

import json

from pdtb.figures.router_section import ROUTER_HEADING, render


def row(target, section, phase, **kw):
    base = {"target": target, "section": section, "phase": phase, "requests": 10, "failed": 0, "short": 0,
            "tokens": 160, "req_per_s": 5.0, "tok_per_s": 80.0, "cpu_ms_per_req": 1.5, "cpu_us_per_tok": 93.75,
            "settings": {"prompt_tokens": 24, "max_tokens": 16}}
    return {**base, **kw}


def test_the_section_shows_each_fit_the_relay_ratio_and_the_latency_levels(tmp_path):
    scripted = {"mode": "colocated", "nodes": 2, "quick": False,
                "rows": [row("router", "variants", "chat16"), row("router", "saturation", "saturation", tok_per_s=3000.0),
                         row("relay", "saturation", "saturation", tok_per_s=2000.0)],
                "fit": {"router": {"cpu_ms_per_request": 0.4, "cpu_us_per_token": 100.0, "tokens_per_core_s": 10000},
                        "relay": {"cpu_ms_per_request": 0.2, "cpu_us_per_token": 50.0, "tokens_per_core_s": 20000}},
                "vs_relay": {"tok_per_s_ratio": 1.5, "cpu_per_tok_ratio": 0.9, "fit_cpu_per_tok_ratio": 2.0},
                "latency": [{"fraction_of_saturation": 0.5, "req_per_s": 12.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 4.0,
                             "delay_p50_ms": 0.5, "delay_p99_ms": 2.5, "itl_p50_ms": 0.0, "itl_p99_ms": 1.5}]}
    real = {"target": "http://127.0.0.1:1", "quick": False, "rows": [],
            "fit": {"router": {"cpu_ms_per_request": 0.7, "cpu_us_per_token": 97.5, "tokens_per_core_s": 10256}}}
    paths = []
    for name, doc in (("a", scripted), ("b", real)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"{name}.json"))
    text = "\n".join(render(paths, ["pdtb bench router"], "_measured_"))
    assert text.startswith(ROUTER_HEADING)
    assert "| scripted colocated, 2 node(s) per role | router | 0.400 ms | 100.0 us | 10000 |" in text
    assert "| scripted colocated, 2 node(s) per role | relay | 0.200 ms | 50.0 us | 20000 |" in text
    assert "| real colocated cluster (tiny model) | router | 0.700 ms | 97.5 us | 10256 |" in text
    assert "**1.50x**" in text and "fitted CPU per token (20 ms steps) 2.00x" in text
    assert "| chat16 | 24 | 16 | 1.500 ms | 93.8 us |" in text
    assert "| 50% | 12.0 | 1.0 / 4.0 ms | 0.5 / 2.5 ms | 0.0 / 1.5 ms |" in text
    # 0.4 ms a request is under 1 ms; 100 us a token over 25, twice the relay's 50
    assert "**met** (0.400 ms); at most 25 us per streamed token, **not met** (100.0 us)" in text
    assert "the relay itself takes 50.0 us (2.00x)" in text


def test_before_and_after_runs_give_the_median_of_each_and_their_ratio(tmp_path):
    paths = []
    for i, (label, req, tok) in enumerate([("before: a", 0.5, 300.0), ("after: b", 0.4, 100.0),
                                           ("before: a", 0.7, 340.0), ("after: b", 0.6, 140.0),
                                           ("before: a", 0.6, 320.0), ("after: b", 0.5, 120.0)]):
        doc = {"target": "http://x", "label": label, "quick": False, "rows": [],
               "fit": {"router": {"cpu_ms_per_request": req, "cpu_us_per_token": tok, "tokens_per_core_s": 1}}}
        (tmp_path / f"{i}.json").write_text(json.dumps(doc))
        paths.append(str(tmp_path / f"{i}.json"))
    text = "\n".join(render(paths, [], "_"))
    # medians: before 0.6 ms and 320 us, after 0.5 ms and 120 us: 320 / 120 = 2.67
    assert "(the median of 3 runs each, interleaved): 0.600 -> 0.500 ms a request, 320.0 -> 120.0 us" in text
    assert "**2.67x** less CPU a token" in text
    assert "| before: a | router | 0.500 ms | 300.0 us | 1 |" in text
