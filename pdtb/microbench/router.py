"""`pdtb bench router`: what one router process carries, against a minimal relay in the same run.

    pdtb bench router [--mode colocated|disagg] [--nodes 2] [--quick] [--only cost,variants,...]
                      [--routers N] [--model DIR] [--out FILE.json] [--router-args "..."]

The real router (`pdtb router`, its own process) in front of scripted nodes (router_nodes.py,
one process) that speak the real control protocol and step as engines do: one TokenBatch per
router per step, carrying a token of every request they run. The load client is this process.

Figures, each from the router process's own CPU time (psutil), so they hold on a busy machine:
- cost: closed loop, 32 in flight, nodes stepping every 20 ms (below saturation, so every
  token is its own SSE chunk): 24-token prompts with 1, 16 and 128 output tokens, fitted as
  cpu = a x requests + b x streamed tokens (least squares);
- variants: CPU per request and per token of non-streamed, chat, long prompts (2K, 8K, 32K
  tokens: tokenization) and 1,024-token outputs;
- saturation: closed loop, 128 in flight, nodes stepping every 2 ms (far more than one core
  can relay): req/s and streamed tokens/s, the router's and the relay's (sse_relay.py: no
  tokenization, no detokenization, the bound for Python and aiohttp on this machine), and
  their ratio;
- latency: open loop at 10, 25, 50 and 75% of the router's saturation req/s (--latency-levels),
  nodes stepping every 20 ms: added TTFT, token delay and added ITL p50/p99 against the nodes' own send times
  (router_load.py).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import uvloop

from pdtb.microbench import router_load as load
from pdtb.microbench import router_procs as procs

SECTIONS = ("cost", "variants", "saturation", "latency")


@dataclass(frozen=True)
class Phase:
    """One load against the target: a closed loop, or an open one at `rate`."""

    name: str
    count: int  # requests
    max_tokens: int  # output tokens each
    prompt_tokens: int = 24
    stream: bool = True
    chat: bool = False
    concurrency: int = 32  # closed loop: requests in flight
    step_ms: float = 20.0  # the nodes' step time
    rate: float = 0.0  # > 0: open loop at this many requests per second


def phases(section: str, quick: bool) -> list[Phase]:
    k = 0.25 if quick else 1.0
    n = lambda x: max(8, int(x * k))  # noqa: E731
    if section == "cost":
        return [Phase("out1", n(480), 1), Phase("out16", n(320), 16), Phase("out128", n(96), 128)]
    if section == "variants":
        return [Phase("nostream16", n(240), 16, stream=False), Phase("chat16", n(240), 16, chat=True),
                Phase("prompt2k", n(96), 16, prompt_tokens=2048), Phase("prompt8k", n(32), 16, prompt_tokens=8192),
                Phase("prompt32k", n(16), 16, prompt_tokens=32768),
                Phase("out1024", n(32), 1024, step_ms=5.0)]
    if section == "saturation":
        return [Phase("saturation", n(512), 128, concurrency=128, step_ms=2.0)]
    return []


class Prompts:
    """Prompt texts of about N tokens, and an output vocabulary of one-word tokens."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        words = []
        for i in range(len(tokenizer)):
            text = tokenizer.decode([i])
            if re.fullmatch(r" [a-z]{2,}", text):
                words.append(i)
        if len(words) < 8:
            raise SystemExit("the model's vocabulary has too few one-word tokens for the bench's output")
        self.vocab = words[:64]
        self.base = " ".join(tokenizer.decode([w]).strip() for w in words) + " "
        ids = tokenizer(self.base * 8, add_special_tokens=False)["input_ids"]
        self.chars_per_token = len(self.base) * 8 / len(ids)

    def text(self, tokens: int) -> str:
        chars = int(tokens * self.chars_per_token)
        return (self.base * (chars // len(self.base) + 1))[:chars]


def body(phase: Phase, prompts: Prompts, model: str, i: int, real: bool = False) -> dict:
    """One request of `phase`. `real`: for a cluster of real nodes, which may sample an end of
    sequence and whose tokens are not one word each: no early end, and the count in the usage."""
    text = prompts.text(phase.prompt_tokens)
    b = {"model": model, "max_tokens": phase.max_tokens, "stream": phase.stream, "user": f"tenant-{i % 4}"}
    if real:
        b["ignore_eos"] = True
        if phase.stream:
            b["stream_options"] = {"include_usage": True}
    if phase.chat:
        b["messages"] = [{"role": "user", "content": text}]
    else:
        b["prompt"] = text
    return b


def run_phase(target, url: str, nodes: procs.Child | None, phase: Phase, prompts: Prompts,
              model: str) -> tuple[dict, list[load.Shot]]:
    """One phase against `target` (a process with cpu_s()): its figures, and the shots (for the
    latency analysis). `nodes` None: real nodes, at their own pace."""
    if nodes is not None:
        procs.set_step(nodes, phase.step_ms)
    path = "/v1/chat/completions" if phase.chat else "/v1/completions"
    bodies = [body(phase, prompts, model, i, real=nodes is None) for i in range(phase.count)]
    cpu0, client0 = target.cpu_s(), time.process_time()
    if phase.rate > 0:
        shots, wall = uvloop.run(load.open_loop(url + path, bodies, phase.rate, 0, timeout=600.0))
    else:
        shots, wall = uvloop.run(load.closed_loop(url + path, bodies, phase.concurrency, timeout=600.0))
    cpu, client = target.cpu_s() - cpu0, time.process_time() - client0
    ok = [s for s in shots if not s.error]
    tokens = sum(s.tokens for s in ok)
    errors = sorted({s.error for s in shots if s.error})
    short = sum(1 for s in ok if s.tokens != phase.max_tokens)  # the nodes send exactly max_tokens each
    out = {"phase": phase.name, "requests": len(shots), "failed": len(shots) - len(ok), "short": short, "tokens": tokens,
           "wall_s": round(wall, 3), "req_per_s": round(len(ok) / wall, 2), "tok_per_s": round(tokens / wall, 1),
           "cpu_s": round(cpu, 4), "cpu_ms_per_req": round(1e3 * cpu / max(1, len(ok)), 4),
           "cpu_us_per_tok": round(1e6 * cpu / max(1, tokens), 2),
           "client_cpu_us_per_tok": round(1e6 * client / max(1, tokens), 2), "errors": errors[:3],
           "settings": asdict(phase)}
    return out, shots


def fit(rows: list[dict]) -> dict:
    """cpu = a x requests + b x tokens, least squares over the cost phases."""
    import numpy as np

    A = np.array([[r["requests"] - r["failed"], r["tokens"]] for r in rows], dtype=float)
    y = np.array([r["cpu_s"] for r in rows])
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return {"cpu_ms_per_request": round(a * 1e3, 4), "cpu_us_per_token": round(b * 1e6, 2),
            "tokens_per_core_s": round(1 / b) if b > 0 else None}


def print_row(target: str, r: dict) -> None:
    print(f"{target:7s} {r['phase']:12s} {r['requests']:5d} req {r['failed'] + r['short']:3d} failed  {r['req_per_s']:8.1f} req/s "
          f"{r['tok_per_s']:9.0f} tok/s  cpu {r['cpu_ms_per_req']:7.3f} ms/req {r['cpu_us_per_tok']:8.1f} us/tok  "
          f"(client {r['client_cpu_us_per_tok']:.1f} us/tok)", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pdtb bench router", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("colocated", "disagg"), default="colocated")
    ap.add_argument("--nodes", type=int, default=2, help="colocated nodes (disagg: this many prefill and decode)")
    ap.add_argument("--model", help="checkpoint whose tokenizer the router serves (default: the embedded model)")
    ap.add_argument("--routers", type=int, default=1, help="router processes behind one port (SO_REUSEPORT); "
                    "with more than one, saturation is measured on one router too, as the ratio's baseline")
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests of each phase")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--latency-s", type=float, default=10.0, help="seconds of arrivals per latency level")
    ap.add_argument("--latency-levels", default="0.1,0.25,0.5,0.75", help="the latency section's loads, as "
                    "fractions of the router's saturation req/s")
    ap.add_argument("--router-args", default="", help="extra flags for `pdtb router`")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--label", default="", help="what this run is, for the results section (e.g. the commit measured)")
    ap.add_argument("--target", metavar="URL", help="a running cluster's router instead of scripted nodes "
                    "(sections cost and variants; --model: the cluster's checkpoint)")
    ap.add_argument("--target-pid", type=int, nargs="+", help="with --target: the router processes' ids "
                    "(run-dir/router-*.pid), their CPU summed")
    a = ap.parse_args(argv)
    if a.target and (a.target_pid is None or set(a.only.split(",")) - {"cost", "variants"}):
        ap.error("--target needs --target-pid and --only cost[,variants]")
    try:
        a.levels = [float(x) for x in a.latency_levels.split(",")]
    except ValueError:
        ap.error(f"--latency-levels wants fractions, got {a.latency_levels!r}")
    if not all(0 < x <= 1 for x in a.levels):
        ap.error("--latency-levels: each level a fraction in (0, 1]")
    bad = set(a.only.split(",")) - set(SECTIONS)
    if bad or a.nodes < 1 or a.latency_s <= 0 or a.routers < 1:
        ap.error(f"unknown sections {sorted(bad)}" if bad else "--nodes and --routers >= 1, --latency-s > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    from pdtb.engine.model_info import resolve_model_arg
    from pdtb.engine.tokenizer import load_tokenizer

    sections = [s for s in SECTIONS if s in a.only.split(",")]
    if a.target:
        return against_cluster(a, sections, Prompts(load_tokenizer(resolve_model_arg(a.model))))
    with tempfile.TemporaryDirectory(prefix="pdtb-bench-router-") as tmp:
        tmpdir = Path(tmp)
        model_dir = procs.long_context_copy(resolve_model_arg(a.model), tmpdir / "model", 65536)
        prompts = Prompts(load_tokenizer(model_dir))
        counts = {"colocated": (a.nodes, 0, 0), "disagg": (a.nodes, a.nodes, a.nodes)}[a.mode]
        nodes, addrs = procs.start_nodes(tmpdir, prompts.vocab, *counts, step_ms=20.0)
        children = [nodes]
        try:
            routed = {r: addrs[r] for r in (("colocated",) if a.mode == "colocated" else ("prefill", "decode"))}
            router, url = procs.start_routers(tmpdir, model_dir, routed, a.router_args.split(), a.routers)
            children.append(router)
            procs.wait_healthy(url)
            one = None
            if a.routers > 1 and "saturation" in sections:  # the baseline of the ratio, in the same run
                one = procs.start_routers(tmpdir, model_dir, routed, a.router_args.split(), 1, "one-router")
                children.append(one[0])
                procs.wait_healthy(one[1])
            result = bench(a, sections, nodes, router, url, addrs["colocated"], prompts, tmpdir, children, one)
            if "node_cpu_s" not in result:
                result["node_cpu_s"] = procs.end_nodes(nodes, tmpdir).get("cpu_s")
        finally:
            for c in reversed(children):
                c.stop()
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


def against_cluster(a, sections: list[str], prompts: Prompts) -> int:
    """The cost and variant phases against a running cluster's router: real nodes, real model."""
    import urllib.request

    import psutil

    with urllib.request.urlopen(f"{a.target}/v1/models", timeout=10) as r:
        card = json.load(r)["data"][0]
    router = procs.Attached([psutil.Process(pid) for pid in a.target_pid])
    result: dict = {"target": a.target, "label": a.label, "quick": a.quick, "rows": []}
    print(f"pdtb bench router: the router at {a.target} (pids {a.target_pid}), real nodes", flush=True)
    run_phase(router, a.target, None, Phase("warm-up", 8, 16), prompts, card["id"])
    for section in sections:
        for phase in phases(section, a.quick):
            if phase.prompt_tokens + phase.max_tokens > card["max_model_len"]:
                continue
            row, _ = run_phase(router, a.target, None, phase, prompts, card["id"])
            print_row("router", row)
            result["rows"].append({"target": "router", "section": section, **row})
    cost = [r for r in result["rows"] if r["section"] == "cost"]
    if cost:
        result["fit"] = {"router": fit(cost)}
        f = result["fit"]["router"]
        print(f"router CPU fit: {f['cpu_ms_per_request']:.3f} ms per request + {f['cpu_us_per_token']:.1f} us per "
              f"streamed token ({f['tokens_per_core_s']} streamed tokens per core-second)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


RELAYED = ("cost", "saturation")  # sections run on the relay too, each phase right after the router's


def bench(a, sections, nodes, router, url, relay_nodes, prompts, tmpdir, children, one=None) -> dict:
    model = Path(tmpdir / "model").name
    result: dict = {"mode": a.mode, "nodes": a.nodes, "routers": a.routers, "router_args": a.router_args,
                    "label": a.label, "quick": a.quick, "rows": []}
    print(f"pdtb bench router: {a.mode}, {a.nodes} node(s) per role, {a.routers} router(s) at {url}", flush=True)
    targets = {"router": (router, url)}
    if set(RELAYED) & set(sections):
        relay, relay_url = procs.start_relay(tmpdir, relay_nodes)
        children.append(relay)
        targets["relay"] = (relay, relay_url)
    if one is not None:
        targets["one router"] = one
    for child, target_url in targets.values():
        run_phase(child, target_url, nodes, Phase("warm-up", 16, 16), prompts, model)
    for section in (s for s in sections if s != "latency"):
        for phase in phases(section, a.quick):
            names = [t for t in targets if t != "one router" or section == "saturation"]
            for name in names if section in RELAYED else ("router",):
                row, _ = run_phase(*targets[name], nodes, phase, prompts, model)
                print_row(name, row)
                result["rows"].append({"target": name, "section": section, **row})
    cost = {t: [r for r in result["rows"] if r["section"] == "cost" and r["target"] == t] for t in targets}
    if cost["router"]:
        result["fit"] = {t: fit(rows) for t, rows in cost.items()}
        for t, f in result["fit"].items():
            print(f"{t} CPU fit: {f['cpu_ms_per_request']:.3f} ms per request + {f['cpu_us_per_token']:.1f} us per "
                  f"streamed token ({f['tokens_per_core_s']} streamed tokens per core-second)", flush=True)
    sat = {r["target"]: r for r in result["rows"] if r["section"] == "saturation"}
    if sat:
        r, b = sat["router"], sat["relay"]
        result["vs_relay"] = {"tok_per_s_ratio": round(r["tok_per_s"] / max(b["tok_per_s"], 1e-9), 3),
                              "cpu_per_tok_ratio": round(r["cpu_us_per_tok"] / max(b["cpu_us_per_tok"], 1e-9), 2)}
        if "fit" in result:
            f = result["fit"]
            result["vs_relay"]["fit_cpu_per_tok_ratio"] = round(
                f["router"]["cpu_us_per_token"] / max(f["relay"]["cpu_us_per_token"], 1e-9), 2)
        print("router/relay: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["vs_relay"].items()), flush=True)
        if "one router" in sat:
            result["vs_one_router"] = {"req_per_s_ratio": round(r["req_per_s"] / max(sat["one router"]["req_per_s"], 1e-9), 3)}
            print(f"{a.routers} routers / one router at saturation: req/s "
                  f"{result['vs_one_router']['req_per_s_ratio']:.2f}x", flush=True)
    if "latency" in sections:
        result["latency"] = latency(a, result, router, url, nodes, prompts, model, tmpdir)
    return result


def latency(a, result, router, url, nodes, prompts, model, tmpdir) -> list[dict]:
    """Open loop at fractions of the router's saturation req/s; the added latency of each level
    (the nodes' log is read at the end of the run: its process is ended for it, so this comes last)."""
    sat = [r for r in result["rows"] if r["section"] == "saturation" and r["target"] == "router"]
    if not sat:
        raise SystemExit("the latency section needs the saturation section's req/s (--only saturation,latency)")
    base = phases("saturation", a.quick)[0]
    levels, shots_by = [], {}
    for frac in a.levels:
        rate = frac * sat[0]["req_per_s"]
        if rate <= 0:
            raise SystemExit("the saturation phase finished no request: no load levels to measure latency at")
        phase = replace(base, name=f"load{round(frac * 100)}", rate=rate, step_ms=20.0,
                        count=max(20, int(rate * a.latency_s)))
        row, shots = run_phase(router, url, nodes, phase, prompts, model)
        print_row("router", row)
        result["rows"].append({"target": "router", "section": "latency", **row})
        levels.append((frac, rate, row))
        shots_by[frac] = shots
    log = procs.end_nodes(nodes, tmpdir)
    result["node_cpu_s"] = log.get("cpu_s")
    out = []
    for frac, rate, row in levels:
        lat = load.added_latency(shots_by[frac], log)
        out.append({"fraction_of_saturation": frac, "req_per_s": round(rate, 2), **lat})
        print(f"router at {round(frac * 100)}% of saturation ({rate:.1f} req/s): added TTFT p50/p99 "
              f"{lat['ttft_p50_ms']}/{lat['ttft_p99_ms']} ms, token delay p50/p99 {lat['delay_p50_ms']}/"
              f"{lat['delay_p99_ms']} ms, added ITL p50/p99 {lat['itl_p50_ms']}/{lat['itl_p99_ms']} ms", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
