"""The router's section of docs/results.md, from `pdtb bench router --out` files
(scripts/router_results.sh).

    python -m pdtb.figures.results_doc --section router --router-files A.json [B.json ...] --out docs/results.md
"""
from __future__ import annotations

import json
from pathlib import Path

ROUTER_HEADING = "## The router: CPU per request and per token, saturation, added latency"


def _label(r: dict) -> str:
    if r.get("label"):
        return r["label"]
    if r.get("target", "").startswith("http"):
        return "real colocated cluster (tiny model)"
    label = f"scripted {r['mode']}, {r['nodes']} node(s) per role"
    label += f", {r['routers']} routers" if r.get("routers", 1) > 1 else ""
    return label + (f", `{r['router_args']}`" if r.get("router_args") else "")


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(paths: list[str], commands: list[str], stamp: str) -> list[str]:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    out = [ROUTER_HEADING, "", stamp, "", "Commands, in order:", ""]
    out += [f"- `{c}`" for c in commands]
    out += ["", "CPU from the router process's own CPU time (psutil, 10 ms ticks). Scripted nodes step every "
            "20 ms in the cost phases, each step one TokenBatch with a token of every running request; "
            "the relay (pdtb/microbench/sse_relay.py) is the bound: the same nodes, sockets and aiohttp, no "
            "tokenization, no detokenization, no checks.", "",
            "| run | target | CPU per request | CPU per streamed token | streamed tokens per core-second |",
            "|---|---|---|---|---|"]
    for r in runs:
        fits = r.get("fit") or {}
        for target in ("router", "relay"):
            f = fits.get(target)
            if f:
                out.append(f"| {_label(r)} | {target} | {_f(f['cpu_ms_per_request'], 3)} ms | "
                           f"{_f(f['cpu_us_per_token'])} us | {f['tokens_per_core_s']} |")
    out += _targets(runs) + _against_baseline(runs)
    variants = [(r, row) for r in runs for row in r["rows"] if row.get("section") == "variants"]
    if variants:
        out += ["", "| run | phase | prompt tokens | output tokens | CPU per request | CPU per streamed token |",
                "|---|---|---|---|---|---|"]
        for r, row in variants:
            s = row["settings"]
            out.append(f"| {_label(r)} | {row['phase']} | {s['prompt_tokens']} | {s['max_tokens']} | "
                       f"{_f(row['cpu_ms_per_req'], 3)} ms | {_f(row['cpu_us_per_tok'])} us |")
    sat = [(r, row) for r in runs for row in r["rows"] if row.get("section") == "saturation"]
    if sat:
        out += ["", "Saturation: 128 in flight, 128 tokens each, nodes stepping every 2 ms (far more than one "
                "core relays): a handler behind its node merges the events queued for it into one chunk.", "",
                "| run | target | req/s | streamed tok/s | CPU per streamed token | failed |", "|---|---|---|---|---|---|"]
        for r, row in sat:
            out.append(f"| {_label(r)} | {row['target']} | {_f(row['req_per_s'])} | {_f(row['tok_per_s'], 0)} | "
                       f"{_f(row['cpu_us_per_tok'])} us | {row['failed'] + row.get('short', 0)} |")
        for r in runs:
            v = r.get("vs_relay")
            if v:
                out.append("")
                out.append(f"{_label(r)}: router/relay streamed tok/s at saturation **{v['tok_per_s_ratio']:.2f}x**, "
                           f"CPU per token at saturation {v['cpu_per_tok_ratio']:.2f}x"
                           + (f", fitted CPU per token (20 ms steps) {v['fit_cpu_per_tok_ratio']:.2f}x"
                              if "fit_cpu_per_tok_ratio" in v else "") + ".")
        for r in runs:
            v = r.get("vs_one_router")
            if v:
                out += ["", f"{_label(r)}: {r['routers']} routers / one router at saturation, req/s "
                        f"**{v['req_per_s_ratio']:.2f}x** (one load client, the nodes and the routers share this "
                        f"machine's cores)."]
    lat = [(r, x) for r in runs for x in r.get("latency") or []]
    if lat:
        out += ["", "Added latency, open loop at fractions of the router's saturation req/s, 128 tokens each, nodes "
                "stepping every 20 ms, against the nodes' own send times (pdtb/microbench/router_load.py):", "",
                "| run | load | req/s | added TTFT p50 / p99 | token delay p50 / p99 | added ITL p50 / p99 |",
                "|---|---|---|---|---|---|"]
        for r, x in lat:
            out.append(f"| {_label(r)} | {round(100 * x['fraction_of_saturation'])}% | {_f(x['req_per_s'])} | "
                       f"{_f(x['ttft_p50_ms'])} / {_f(x['ttft_p99_ms'])} ms | {_f(x['delay_p50_ms'])} / "
                       f"{_f(x['delay_p99_ms'])} ms | {_f(x['itl_p50_ms'])} / {_f(x['itl_p99_ms'])} ms |")
    return out + [""]


def _targets(runs: list[dict]) -> list[str]:
    """One router's targets against the first scripted run's fits: 1 ms per request, 25 us per
    streamed token, and the relay's own CPU per token beside it (what Python and aiohttp cost
    here before the router's work)."""
    scripted = [r for r in runs if "mode" in r and (r.get("fit") or {}).get("relay")]
    if not scripted:
        return []
    f = scripted[0]["fit"]
    req, tok, relay = f["router"]["cpu_ms_per_request"], f["router"]["cpu_us_per_token"], f["relay"]["cpu_us_per_token"]
    return ["", f"One router's targets, {_label(scripted[0])}: at most 1 ms of CPU per request, "
            f"**{'met' if req <= 1.0 else 'not met'}** ({req:.3f} ms); at most 25 us per streamed token, "
            f"**{'met' if tok <= 25.0 else 'not met'}** ({tok:.1f} us), where the relay itself takes "
            f"{relay:.1f} us ({tok / relay:.2f}x)."]


def _against_baseline(runs: list[dict]) -> list[str]:
    """Real-cluster runs labelled `before ...` and `after ...`, interleaved in one script run:
    the per-token and per-request CPU of each side's median run, and their ratio."""
    import statistics

    sides = {}
    for side in ("before", "after"):
        fits = [r["fit"]["router"] for r in runs if r.get("label", "").startswith(side) and r.get("fit")]
        if fits:
            sides[side] = (statistics.median(f["cpu_ms_per_request"] for f in fits),
                           statistics.median(f["cpu_us_per_token"] for f in fits), len(fits))
    if len(sides) < 2:
        return []
    (bq, bt, n), (aq, at, _) = sides["before"], sides["after"]
    return ["", f"The same real cluster's router before and after (the median of {n} runs each, interleaved): "
            f"{bq:.3f} -> {aq:.3f} ms a request, {bt:.1f} -> {at:.1f} us a streamed token, "
            f"**{bt / at:.2f}x** less CPU a token."]

