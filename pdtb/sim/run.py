"""`pdtb sim`: one workload through a simulated cluster, or a sweep of offered loads.

  pdtb sim --workload whale-minnow --mode disagg --policy memfair --cost calibrated --out r.json
  pdtb sim --workload trace:azure.csv --mode disagg --prefill 1 --decode 1 --cost roofline \\
      --gpu h100-sxm --model-config llama-3-70b --tp 4 --out azure.json
  pdtb sim --workload whale-minnow --rates 1,2,4 --span-s 60 --out sweep.json   (a sweep file)

Every workload, scaling and request flag of `pdtb bench serve` applies, and every node flag
(page budgets, token budget, the fairness flags). The results file is `pdtb bench serve`'s
(a sweep file with --rates/--until-knee is `pdtb bench sweep`'s), so `pdtb report`, `pdtb
compare` and `pdtb frontier` read it unchanged; `meta.sim` adds what only a simulation sees
(pdtb/sim/observe.py), `meta.cost` the cost model.
"""
from __future__ import annotations

import json
import sys
import time
from argparse import Namespace
from dataclasses import replace

from pdtb.figures import sweep_figures as sf
from pdtb.client import workloads as wl
from pdtb.client.prefix import ideal_hit_rate
from pdtb.client.serve import _csv, _unwritable, arrival_label, build_workload
from pdtb.figures.results import build_results, format_table, policy_section, write_results
from pdtb.figures.service import ServiceWeights
from pdtb.figures.summary import summarize
from pdtb.client.sweep import SWEEP_VERSION, build_parser as sweep_parser, level_specs
from pdtb.common import CliError
from pdtb.sim.cluster import SimCluster
from pdtb.sim.flags import add_sim_args, build_cost, cluster_shape, context_of, page_spec, router_cost
from pdtb.sim.routers import router_figures


def build_parser():
    ap = sweep_parser()
    ap.prog, ap.description = "pdtb sim", __doc__.split("\n\n")[0]
    add_sim_args(ap)
    return ap


def simulate(a: Namespace, specs, cost=None) -> tuple[list, dict, SimCluster]:
    """Run `specs` through the cluster the flags describe: (records, sim figures, cluster)."""
    cost = cost or build_cost(a)
    shape = cluster_shape(a, cost)
    if a.prefix_cache == "on" and any(s.blocks for s in specs):
        shape = replace(shape, prefix_cache=True)
    try:
        cluster = SimCluster(shape, page_spec(cost.page_bytes, a.page_size), cost)
    except ValueError as e:  # (a --kill of a node the shape does not have)
        raise CliError(f"pdtb sim: {e}") from None
    t0, c0 = time.perf_counter(), time.process_time()
    records = cluster.run(specs, a.horizon_s, a.concurrency, a.max_concurrency)
    figures = cluster.observer.summary(records)
    figures.update(wall_s=round(time.perf_counter() - t0, 3), cpu_s=round(time.process_time() - c0, 3), events=cluster.loop.num_events,
                   steps={nid: n.num_steps for nid, n in cluster.nodes.items()},
                   steps_in_runs={nid: n.coasted for nid, n in cluster.nodes.items()},
                   busy_share={nid: round(n.busy_s / max(cluster.loop.now, 1e-9), 4) for nid, n in cluster.nodes.items()},
                   simulated_s=cluster.loop.now)
    duration = max(((r.end_time or 0.0) for r in records), default=0.0)  # (the results' duration_s)
    figures["routers"] = router_figures(cluster.routers, shape.routers, router_cost(a, cost), records,
                                        duration, a.router_target)
    if cluster.shape.kills:
        figures["faults"] = cluster.faults.figures()
    prefix = cluster.prefix_figures()
    if prefix is not None:
        prefix["ideal_hit_rate"] = ideal_hit_rate(specs)
        figures["prefix"] = prefix
    return records, figures, cluster


def _specs(a: Namespace) -> tuple[list, dict]:
    specs, info = build_workload(a)
    ctx = context_of(a)
    specs = [wl.clamp_to_context(s, ctx)[0] for s in specs]
    if not specs:
        raise ValueError("the workload has no requests")
    if any(s.blocks for s in specs) and a.prefix_cache == "on":
        info["prefix_sharing_simulated"] = "prefill and colocated nodes (a decode node receives every page)"
    return specs, info


def _meta(a: Namespace, cost, figures: dict, cluster: SimCluster | None) -> dict:
    opts = {k: v for k, v in vars(a).items() if k != "api_key"}
    return {"workload": a.workload, "options": opts, "seed": a.seed, "url": None, "simulated": True,
            "mode": a.label_mode or a.mode, "policy": a.label_policy or _policy_name(a),
            "policy_info": _policy_info(cluster), "cost": cost.name,
            **({"cost_info": cost.describe()} if hasattr(cost, "describe") else {}),
            "arrival": _arrival(a), "sim": figures}


def _arrival(a: Namespace) -> str:
    return "simulated " + arrival_label(a)


def _policy_name(a: Namespace) -> str:
    """The policy as real nodes name it: the class's own `name`, else its reference."""
    from fairness import PolicyLoadError, resolve

    try:
        return resolve(a.policy).name
    except PolicyLoadError:
        return a.policy


def _policy_info(cluster: SimCluster | None) -> dict | None:
    """`meta.policy_info` (pdtb/figures/results.py): the policy each simulated node runs, as a
    real node reports it in `/cluster`."""
    if cluster is None:
        return None
    from fairness import policy_info

    return policy_section({nid: policy_info(n.shape.policy, n.shape.policy_args).to_json()
                           for nid, n in cluster.nodes.items()})


def run_once(a: Namespace, weights: ServiceWeights) -> int:
    from pdtb.client.serve import parse_slos

    slos = parse_slos(a.slo)
    specs, info = _specs(a)
    cost = build_cost(a)
    records, figures, cluster = simulate(a, specs, cost)
    if hasattr(cost, "describe"):  # which calibration, measured where
        print(f"pdtb sim: {cost.describe()}", file=sys.stderr)
    duration = max((r.end_time or 0.0) for r in records)
    summary = summarize(records, duration, slos, weights, a.fairness_window)
    if figures.get("prefix"):  # the keys a real run's summary has (pdtb/client/prefix.py prefix_figures)
        p = figures["prefix"]
        summary.update(prefix_hit_rate=p["hit_rate"], prefix_hit_rate_ideal=p["ideal_hit_rate"],
                       prefix_tokens_queried=p["query_tokens"], prefix_tokens_hit=p["hit_tokens"])
    meta = {**_meta(a, cost, figures, cluster), "start_time": 0.0, "duration_s": duration, "workload_info": info}
    if a.out:
        write_results(a.out, build_results(meta, records, summary, cluster.observer.samples), compact=True)
    print(format_table(summary))
    ev = {k: v for k, v in figures["evictions_per_request"].items()}
    print(f"sim: {len(records)} requests, {duration:.1f} s simulated in {figures['wall_s']:.1f} s "
          f"({figures['events']} events); top-5% KV share of the pool {figures['top5_share_pool_mean']:.2f} mean, "
          f"{figures['top5_share_pool_max']:.2f} max; evictions per request {json.dumps(ev)}")
    print(router_line(figures["routers"]))
    if figures.get("prefix"):
        p = figures["prefix"]
        print(f"prefix cache: hit rate {p['hit_rate'] or 0:.3f} of {p['query_tokens']} prompt tokens "
              f"(the trace's ideal {p['ideal_hit_rate'] or 0:.3f})")
    if a.out:
        print(f"results: {a.out}")
    return 0


def router_line(f: dict) -> str:
    """The routers' figures in one line (pdtb/sim/routers.py router_figures)."""
    busy = max(r["busy_share"] for r in f["per_router"])
    wait = max((r["token_wait_ms"]["p99"] for r in f["per_router"] if "token_wait_ms" in r), default=0.0)
    cost = (f"{f['request_s'] * 1e6:g} us a request, {f['token_s'] * 1e6:g} us a token"
            if f["charged"] else "not charged")
    return (f"routers: {f['routers']} ({cost}); streamed {f['streamed_tok_s_mean']:.0f} tok/s mean, "
            f"{f['streamed_tok_s_peak_1s']} peak in 1 s; busiest router {busy:.3f} busy, token wait p99 "
            f"{wait:.2f} ms; routers needed at {f['target_busy_share']:g} busy: {f['routers_needed']} "
            f"({f['routers_needed_at_peak']} at the 1 s peak)")


def sweep(a: Namespace, weights: ServiceWeights, cost=None, quiet: bool = False, keep_records: bool = True) -> dict:
    """A sweep document (`pdtb bench sweep`'s shape) of the workload at the flags' rate levels
    (--rates, --until-knee), each level simulated on the cluster the flags describe.
    `keep_records=False` leaves every level's request records out (a caller that reads only
    the figures: turning records into JSON is a fifth of a level's time)."""
    slos = sf.SloTable.parse(a.slo)
    cost = cost or build_cost(a)
    warm, span = a.warmup_s, a.span_s
    drain = span if a.drain_s is None else a.drain_s
    todo, levels, ctx = list(a.rates or [0.5, 1.0, 1.5, 2.0]), [], context_of(a)
    cluster = None  # the last level's: every level runs the same nodes
    while todo and len(levels) < a.max_levels:
        load = todo.pop(0)
        specs = [wl.clamp_to_context(s, ctx)[0] for s in level_specs(a, load, warm + span, False)]
        lv_args = Namespace(**{**vars(a), "horizon_s": warm + span + drain})
        records, figures, cluster = simulate(lv_args, specs, cost)
        lv = {"load": load, **sf.level_figures(records, warm, warm + span, slos, cluster.observer.samples, weights,
                                                a.fairness_window),
              "run_s": cluster.loop.now, "requests": [r.to_json() for r in records] if keep_records else [],
              "samples": cluster.observer.samples, "sim": {k: v for k, v in figures.items() if k != "top5_series"}}
        levels.append(lv)
        o = lv["overall"]
        if not quiet:
            print(f"load {load:g}: offered {o['offered_rps']:.2f}/s goodput {o['goodput_rps']:.2f}/s "
                  f"({figures['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        if a.until_knee and not todo:
            nxt = sf.next_load(levels, a.target, a.knee_on, a.growth, a.knee_resolution)
            if nxt is not None:
                todo.append(nxt)
    levels.sort(key=lambda lv: lv["load"])
    derived = sf.derive(levels, a.target, a.knee_on)
    meta = {**_meta(a, cost, {}, cluster), "version": SWEEP_VERSION, "kind": "sweep", "config": a.label_config,
            "load_kind": "rate", "warmup_s": warm, "span_s": span, "drain_s": drain, "slos": slos.to_json(),
            "start_time": 0.0, "model": {"id": cost.name}}
    return {"meta": meta, "derived": derived, "levels": levels}


def run_sweep(a: Namespace, weights: ServiceWeights) -> int:
    doc = sweep(a, weights)
    if a.out:
        write_results(a.out, doc, compact=True)
    derived = doc["derived"]
    print(json.dumps({k: derived[k] for k in ("max_goodput_rps", "max_goodput_every_class_rps", "knee_rps",
                                              "knee_bracket_rps", "saturation_tok_s")}))
    return 0


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        if not a.workload:
            raise ValueError("--workload is required (whale-minnow, multi-tenant or trace:FILE)")
        if a.concurrency_levels or a.dry_run or a.rescore:
            raise ValueError("--concurrency-levels, --dry-run and --rescore belong to the real client")
        if a.concurrency and (a.rates or a.until_knee):
            raise ValueError("--concurrency is one closed-loop run: not with --rates or --until-knee")
        if a.span_s <= 0 or a.warmup_s < 0 or (a.drain_s is not None and a.drain_s < 0):
            raise ValueError("--span-s must be above 0, --warmup-s and --drain-s at least 0")
        w_in, w_out = (float(x) for x in _csv(a.service_weights))
        weights = ServiceWeights(w_in, w_out)
        if a.out and (problem := _unwritable(a.out)):
            raise ValueError(f"cannot write --out {a.out}: {problem}")
        if a.rates or a.until_knee:
            return run_sweep(a, weights)
        return run_once(a, weights)
    except (ValueError, OSError, KeyError) as e:
        raise CliError(f"pdtb sim: {e}") from None
