"""`pdtb bench sweep`: one workload at a series of offered loads against a running cluster.

  pdtb bench sweep --url URL --workload whale-minnow --rates 0.5,1,2 --out sweep.json \\
      --slo ttft_ms=500 --slo whale:ttft_ms=20000 --slo tpot_ms=100
  pdtb bench sweep --url URL --workload multi-tenant --concurrency-levels 1,2,4,8 --out s.json
  pdtb bench sweep --url URL --workload trace:FILE --time-scale 0.1 --until-knee --out s.json

Every workload, scaling and request flag of `pdtb bench serve` applies. A rate level m sends the
workload's arrivals m times as fast: the workload is built once per period (its --duration; a
trace's span), with seed+k for the k-th period, the periods laid end to end and every send time
divided by m, up to the level's warm-up plus its measured span. A concurrency level c keeps c
requests in flight (closed loop, the workload's requests in order, cycled) for as long. Each
level then waits at most --drain-s for the requests still in flight and cuts off the rest (they
count as failed). Figures and the `derived` block: `pdtb/figures/sweep_figures.py`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from argparse import Namespace
from dataclasses import replace

import aiohttp

from pdtb.figures import sweep_figures as sf
from pdtb.client import workloads as wl
from pdtb.client.serve import _csv, _unwritable, _why, build_parser as serve_parser, build_workload, server_info
from pdtb.figures.records import RequestSpec
from pdtb.figures.results import fmt, server_labels, server_policy_info, write_results
from pdtb.client.load import RunConfig, run
from pdtb.figures.service import ServiceWeights

SWEEP_VERSION = 1


def _loads(text: str) -> list[float]:
    try:
        out = [float(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a comma list of numbers, got {text!r}") from None
    if not out or not all(0 < x < float("inf") for x in out):
        raise argparse.ArgumentTypeError(f"every load must be a number above 0, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = serve_parser()
    ap.prog, ap.description = "pdtb bench sweep", "Run a workload at a series of offered loads."
    for action in ap._actions:  # argparse has no public way to relax a parent's required flag
        if action.dest == "workload":
            action.required = False  # --rescore needs none; every other use checks it below
    g = ap.add_argument_group("sweep")
    g.add_argument("--rates", type=_loads, help="rate multipliers of the workload's arrivals (default 0.5,1,1.5,2)")
    g.add_argument("--concurrency-levels", type=_loads, help="closed-loop levels: requests in flight")
    g.add_argument("--warmup-s", type=float, default=5.0, help="s of load before each level's measured span")
    g.add_argument("--span-s", type=float, default=20.0, help="measured s per level")
    g.add_argument("--drain-s", type=float, help="s to wait after sending for requests in flight (default: span)")
    g.add_argument("--target", type=float, default=0.9, help="attainment a level must reach to count (0..1)")
    g.add_argument("--knee-on", default="every-class", help="every-class | overall | a class name")
    g.add_argument("--until-knee", action="store_true",
                   help="add levels past the given ones until attainment collapses, then bisect the knee")
    g.add_argument("--growth", type=float, default=2.0, help="--until-knee: load factor per added level")
    g.add_argument("--knee-resolution", type=float, default=0.25,
                   help="--until-knee: stop once failing load / passing load <= 1 + this")
    g.add_argument("--max-levels", type=int, default=12)
    g.add_argument("--label-config", help="a name for this configuration (the frontier's point label)")
    g.add_argument("--rescore", metavar="SWEEP.json",
                   help="no server: recompute a sweep file's figures from its records, with this command's "
                        "--slo (default: the file's), --target and --knee-on, into --out")
    return ap


def _period(a: Namespace, specs: list[RequestSpec], info: dict) -> float:
    """The span one built workload covers (tiles are laid this far apart)."""
    if a.workload == "whale-minnow":
        return a.duration or 30.0
    if a.workload == "multi-tenant":
        return info["duration"]
    last = max(s.send_time for s in specs)
    return last + (last / max(1, len(specs) - 1) if len(specs) > 1 else 1.0)


def level_specs(a: Namespace, load: float, until: float, closed: bool) -> list[RequestSpec]:
    """The requests of one level: periods of the workload (seed + k for the k-th) laid end to end,
    send times divided by `load` (a rate level) and kept below `until`."""
    out: list[RequestSpec] = []
    k, offset = 0, 0.0
    stretch = 1.0 if closed else load
    while True:
        specs, info = build_workload(Namespace(**{**vars(a), "seed": a.seed + k}))
        if not specs:
            raise ValueError("the workload has no requests")
        period = _period(a, specs, info)
        for s in specs:
            t = (s.send_time + offset) / stretch
            if t < until:
                out.append(replace(s, send_time=t))
        offset += period
        k += 1
        if offset / stretch >= until or closed:
            break
    out.sort(key=lambda s: s.send_time)
    return out


def _row(lv: dict, classes: list[str]) -> str:
    o = lv["overall"]
    att = " ".join(f"{c}={fmt(lv['per_class'].get(c, {}).get('attainment'), 2)}" for c in classes)
    return (f"{lv['load']:>7.3g} {o['offered_rps']:>8.2f} {o['goodput_rps']:>8.2f} {o['output_tok_s']:>9.1f} "
            f"{fmt(o['ttft_ms']['p99'], 0):>9} {o['failed']:>6}  {att}")


async def _sweep(a: Namespace, slos: sf.SloTable, weights: ServiceWeights) -> int:
    url = a.url.rstrip("/")
    try:
        model, nodes = await server_info(url, a.api_key)
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        print(f"pdtb bench sweep: cannot read {url}/v1/models: {_why(e)}", file=sys.stderr)
        return 1
    vocab, max_len = a.vocab_size or model["vocab_size"], a.max_model_len or model["max_model_len"]
    mode, policy = server_labels(nodes)
    closed = a.concurrency_levels is not None
    todo = list(a.concurrency_levels or a.rates or [0.5, 1.0, 1.5, 2.0])
    warm, span = a.warmup_s, a.span_s
    drain = span if a.drain_s is None else a.drain_s
    detokenize = None
    if a.api == "chat":
        from pdtb.engine.model_info import resolve_model_arg
        from pdtb.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model_arg(a.tokenizer))
        detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    levels: list[dict] = []
    print(f"{'load':>7} {'offer/s':>8} {'good/s':>8} {'out tok/s':>9} {'TTFTp99':>9} {'failed':>6}  attainment",
          file=sys.stderr)
    while todo and len(levels) < a.max_levels:
        load = todo.pop(0)
        specs = [wl.clamp_to_context(s, max_len)[0] for s in level_specs(a, load, warm + span, closed)]
        cfg = RunConfig(url, a.model, vocab, a.min_token_id, a.seed + 7919 * (len(levels) + 1),
                        int(load) if closed else None, a.request_timeout, a.sample_interval, not a.no_token_ids,
                        a.temperature, False, a.api_key, a.max_concurrency, a.warmup if not levels else 0,
                        send_until=(warm + span) if closed else None, drain_timeout=drain, api=a.api,
                        detokenize=detokenize)
        res = await run(specs, cfg)
        lv = {"load": load, **sf.level_figures(res.records, warm, warm + span, slos, res.samples, weights,
                                                a.fairness_window),
              "run_s": res.duration, "requests": [r.to_json() for r in res.records], "samples": res.samples}
        levels.append(lv)
        classes = sorted({c for x in levels for c in x["per_class"]})
        print(_row(lv, classes), file=sys.stderr, flush=True)
        if a.until_knee and not todo:
            nxt = sf.next_load(levels, a.target, a.knee_on, a.growth, a.knee_resolution)
            if nxt is not None and closed:
                nxt = float(max(1, round(nxt)))
                if nxt in [x["load"] for x in levels]:
                    nxt = None
            if nxt is not None:
                todo.append(nxt)
    levels.sort(key=lambda lv: lv["load"])
    derived = sf.derive(levels, a.target, a.knee_on)
    opts = {k: v for k, v in vars(a).items() if k not in ("api_key",)}
    meta = {"version": SWEEP_VERSION, "kind": "sweep", "workload": a.workload, "options": opts, "url": url,
            "mode": a.label_mode or mode, "policy": a.label_policy or policy, "config": a.label_config,
            "policy_info": server_policy_info(nodes),
            "load_kind": "concurrency" if closed else "rate", "warmup_s": warm, "span_s": span, "drain_s": drain,
            "slos": slos.to_json(), "start_time": time.time(), "model": {"id": model.get("id")}}
    doc = {"meta": meta, "derived": derived, "levels": levels}
    if a.out:
        write_results(a.out, doc)
    print(json.dumps({k: derived[k] for k in ("max_goodput_rps", "max_goodput_every_class_rps", "knee_rps",
                                              "knee_bracket_rps", "saturation_tok_s")}))
    if a.out:
        print(f"sweep: {a.out}")
    return 0


def rescore(a: Namespace, path: str, weights: ServiceWeights) -> dict:
    """A sweep file's levels recomputed from their records (another SLO table or target)."""
    from pdtb.figures.frontier import load_sweep
    from pdtb.figures.records import RequestRecord

    doc = load_sweep(path)
    slos = sf.SloTable.parse(a.slo) if a.slo else sf.SloTable(**doc["meta"]["slos"])
    levels = []
    for lv in doc["levels"]:
        records = [RequestRecord.from_json(r) for r in lv["requests"]]
        start, end = lv["window_s"]
        levels.append({**lv, **sf.level_figures(records, start, end, slos, lv.get("samples"), weights,
                                                 a.fairness_window)})
    meta = {**doc["meta"], "slos": slos.to_json(), "rescored_from": path}
    return {"meta": meta, "derived": sf.derive(levels, a.target, a.knee_on), "levels": levels}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.rescore:
        if not a.out:
            print("pdtb bench sweep: --rescore needs --out", file=sys.stderr)
            return 2
        try:
            w_in, w_out = (float(x) for x in _csv(a.service_weights))
            doc = rescore(a, a.rescore, ServiceWeights(w_in, w_out))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"pdtb bench sweep: --rescore {a.rescore}: {e}", file=sys.stderr)
            return 2
        write_results(a.out, doc)
        print(json.dumps({k: doc["derived"][k] for k in ("max_goodput_rps", "max_goodput_every_class_rps",
                                                         "knee_rps", "saturation_tok_s")}))
        return 0
    try:
        if not a.workload:
            raise ValueError("--workload is required (whale-minnow, multi-tenant or trace:FILE)")
        slos = sf.SloTable.parse(a.slo)
        w_in, w_out = (float(x) for x in _csv(a.service_weights))
        if a.rates and a.concurrency_levels:
            raise ValueError("--rates and --concurrency-levels: one or the other")
        if a.concurrency or a.dry_run:
            raise ValueError("--concurrency and --dry-run belong to `pdtb bench serve` (use --concurrency-levels)")
        if a.span_s <= 0 or a.warmup_s < 0 or (a.drain_s is not None and a.drain_s < 0):
            raise ValueError("--span-s must be above 0, --warmup-s and --drain-s at least 0")
        if not 0 < a.target <= 1 or a.growth <= 1 or a.knee_resolution <= 0 or a.max_levels < 1:
            raise ValueError("--target in (0, 1], --growth above 1, --knee-resolution above 0, --max-levels >= 1")
        if a.concurrency_levels and any(c != int(c) for c in a.concurrency_levels):
            raise ValueError("--concurrency-levels are whole numbers of requests")
        build_workload(a)  # a bad workload flag is found now, not at the first level
    except (ValueError, OSError, KeyError) as e:
        print(f"pdtb bench sweep: {e}", file=sys.stderr)
        return 2
    if not a.url:
        print("pdtb bench sweep: --url is required", file=sys.stderr)
        return 2
    if a.out and (problem := _unwritable(a.out)):
        print(f"pdtb bench sweep: cannot write --out {a.out}: {problem}", file=sys.stderr)
        return 2
    return asyncio.run(_sweep(a, slos, ServiceWeights(w_in, w_out)))
