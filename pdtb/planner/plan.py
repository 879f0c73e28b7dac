"""`pdtb sim plan`: the prefill:decode split and host-tier budget that maximize goodput per GPU.

  pdtb sim plan --gpus 8 --gpu h100-sxm --model-config llama-3-8b --tp 1 --workload whale-minnow \\
      --policy memfair --slo ttft_ms=1000 --slo whale:ttft_ms=15000 --slo tpot_ms=100
  pdtb sim plan --gpus 16 --model-config llama-3-70b --tp 4 --workload trace:azure.csv \\
      --host-kv-pages 0,65536 --out plan.json

Every `pdtb sim` workload, SLO and node flag applies (the fairness policy and its flags run in
every simulated node); the cluster shape is what the plan chooses, so --mode, --prefill,
--decode and --replicas are refused. Candidates: colocated x N/T (the baseline) and every split
P prefill + D decode nodes with P + D = N/T, each with every --host-kv-pages size (a comma list
here). Each is a rate sweep (--until-knee always, from --rates, see pdtb/planner/search.py);
the levels' --warmup-s, --span-s and --drain-s set what one costs, --max-levels and
--knee-resolution how many there are.

Routers: the router processes are counted with the nodes. Each candidate's best passing level
streams so many tokens and takes so many requests a second; at the routers' costs
(--router-request-us, --router-token-us, or a calibration's router section) that is so many CPU
seconds a second, and the plan gives each candidate the routers that keep each one under
--router-target busy (pdtb/sim/routers.py routers_needed). The levels simulate --routers of
them (1 unless told), charged when the costs are given.

Budgets: a node's device pool is the roofline's (pool_pages(): HBM after the weights), or
--kv-pages. A smaller device share is not a candidate: in this model the HBM it would free buys
nothing (no larger batch of activations, no other tenant on the GPU), so it could only admit
less; the host tier is the budget that trades something (PCIe moves for room).

What a plan costs: the simulator runs the real scheduler token by token, so a level costs in
proportion to the tokens the cluster serves in it: about (the cluster's tokens/s at its knee)
x (--warmup-s + --span-s + --drain-s), times the levels, times the candidates, over --jobs.
Large clusters of small models (thousands of short requests a second) are the slow case:
shorten the levels, or start --rates near the knee.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from argparse import Namespace
from dataclasses import asdict

from pdtb.client.serve import _csv, _unwritable
from pdtb.figures.results import write_results
from pdtb.figures.service import ServiceWeights
from pdtb.figures.sweep_figures import SloTable
from pdtb.common import CliError
from pdtb.planner.search import Candidate, Outcome, candidates, search
from pdtb.sim.run import build_parser as sim_parser
from pdtb.sim.flags import build_cost, cluster_shape, router_cost

PLAN_VERSION = 1
CHOSEN = ("mode", "prefill", "decode", "replicas")  # cluster flags the plan sets itself


def _sizes(text: str) -> list[int]:
    try:
        out = [int(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a comma list of page counts, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"want page counts of at least 0, got {text!r}")
    return sorted(set(out))


def _one_line(message: str):
    raise CliError(f"pdtb sim plan: {message}")


def build_parser() -> argparse.ArgumentParser:
    ap = sim_parser()
    ap.prog, ap.description = "pdtb sim plan", __doc__.split("\n\n")[0]
    ap.error = _one_line  # one line, not argparse's usage block
    for action in ap._actions:  # argparse has no public way to widen a parent's flag
        if action.dest == "host_kv_pages":
            action.type, action.default = _sizes, [0]
            action.help = "comma list: host-tier pages per decode/colocated node, each a candidate (default 0)"
    g = ap.add_argument_group("plan")
    g.add_argument("--gpus", type=int, required=True, help="GPUs to deploy (N); a node is --tp of them")
    g.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                   help="candidates simulated at once, in processes (same figures whatever the number)")
    g.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    # The sweep's defaults are for a real cluster; a plan runs many sweeps, so shorter levels
    # (a request cut at the drain's end still counts where it was on track) and a finer knee.
    # --max-levels keeps the sweep's 12: the climb to a knee doubles the load, so its levels
    # together cost about as much as the last one.
    ap.set_defaults(cost="roofline", warmup_s=2.0, span_s=10.0, drain_s=5.0, knee_resolution=0.1,
                    mode=None, prefill=None, decode=None, replicas=None)
    return ap


def check(a: Namespace) -> ServiceWeights:
    """Refuse what a plan cannot honour; the service weights."""
    if not a.workload:
        raise ValueError("--workload is required (whale-minnow, multi-tenant or trace:FILE)")
    if given := [f"--{k}" for k in CHOSEN if getattr(a, k) is not None]:
        raise ValueError(f"{', '.join(given)}: the plan chooses the cluster's shape itself")
    if a.concurrency or a.concurrency_levels or a.dry_run or a.rescore:
        raise ValueError("--concurrency, --concurrency-levels, --dry-run and --rescore belong to the real client")
    if a.span_s <= 0 or a.warmup_s < 0 or a.drain_s < 0:
        raise ValueError("--span-s must be above 0, --warmup-s and --drain-s at least 0")
    if not 0 < a.target <= 1 or a.max_levels < 1 or a.jobs < 1 or a.growth <= 1 or a.knee_resolution <= 0:
        raise ValueError("--target must be in (0, 1], --max-levels and --jobs at least 1, --growth above 1, "
                         "--knee-resolution above 0")
    if a.out and (problem := _unwritable(a.out)):
        raise ValueError(f"cannot write --out {a.out}: {problem}")
    candidates(a.gpus, a.tp, tuple(a.host_kv_pages))  # the GPU count's errors, before any cost
    SloTable.parse(a.slo)
    w_in, w_out = (float(x) for x in _csv(a.service_weights))
    return ServiceWeights(w_in, w_out)


def pool_of(a: Namespace, cost) -> dict:
    """Device pages per prefill and per decode/colocated node (cluster_shape's rules)."""
    cand = Candidate("disagg", 1, 1, 0, a.tp)
    nodes = cluster_shape(Namespace(**{**vars(a), **cand.flags()}), cost).nodes
    return {"prefill": nodes[0].num_pages, "decode": nodes[1].num_pages}


def plan_doc(a: Namespace, cost, pools: dict, ranked: list[Outcome], wall_s: float) -> dict:
    """The plan as JSON: the setting, the candidates best first, the best's label."""
    opts = {k: v for k, v in vars(a).items() if k != "api_key"}
    return {"kind": "plan", "version": PLAN_VERSION, "gpus": a.gpus, "tp": a.tp, "cost": cost.name,
            "workload": a.workload, "policy": a.policy, "slos": SloTable.parse(a.slo).to_json(),
            "target": a.target, "knee_on": a.knee_on, "page_bytes": cost.page_bytes,
            "device_kv_pages": pools, "best": ranked[0].candidate.label,
            "router_cost": asdict(router_cost(a, cost)), "router_target": a.router_target,
            "wall_s": round(wall_s, 2), "options": opts, "candidates": [o.to_json() for o in ranked]}


def _bracket(o: Outcome) -> str:
    lo, hi = o.knee_bracket_rps
    return f"[{'-' if lo is None else f'{lo:.2f}'}, {'-' if hi is None else f'{hi:.2f}'}]"


def table(doc: dict, ranked: list[Outcome]) -> str:
    """The candidates best first, then the best against the colocated baseline."""
    pools = doc["device_kv_pages"]
    lines = [f"pdtb sim plan: {doc['gpus']} GPUs, {doc['cost']}, policy {doc['policy']}, device pages a node "
             f"{pools['decode']} (prefill {pools['prefill']}), target {doc['target']:g} {doc['knee_on']}",
             f"{'candidate':<22}{'GPUs':>5}{'host pages':>11}{'goodput/s':>11}{'per GPU':>9}"
             f"{'knee bracket req/s':>21}{'routers':>8}{'levels':>7}{'wall s':>8}"]
    for o in ranked:
        c = o.candidate
        lines.append(f"{c.label:<22}{c.gpus:>5}{c.host_kv_pages:>11}{o.max_goodput_rps:>11.2f}"
                     f"{o.per_gpu_rps:>9.3f}{_bracket(o):>21}{o.routers.get('routers', 1):>8}{len(o.levels):>7}"
                     f"{o.wall_s:>8.1f}")
    best = ranked[0]
    base = max((o for o in ranked if o.candidate.mode == "colocated"), key=lambda o: o.per_gpu_rps)
    vs = f"{best.per_gpu_rps / base.per_gpu_rps:.2f}x" if base.per_gpu_rps else "n/a"
    lines.append(f"best: {best.candidate.label}, {best.per_gpu_rps:.3f} req/s per GPU ({best.max_goodput_rps:.2f} "
                 f"on {best.candidate.gpus}); best colocated {base.candidate.label} {base.per_gpu_rps:.3f} ({vs})")
    r, rc = best.routers, doc["router_cost"]
    if r:
        lines.append(f"routers: {r['routers']} for {r['tokens_per_s']:.0f} tokens and {r['requests_per_s']:.2f} "
                     f"requests a second at {rc['token_s'] * 1e6:g} us a token and {rc['request_s'] * 1e6:g} us a request "
                     f"({r['cpu_s_per_s']:.3f} CPU s a second, each router under {doc['router_target']:g} busy)")
    if open_ := [o.candidate.label for o in ranked if not o.bracketed]:
        lines.append(f"knee not bracketed (raise --max-levels or start --rates nearer): {', '.join(open_)}")
    lines.append(f"knees to within --knee-resolution {doc['options']['knee_resolution']:g}: closer candidates tie; "
                 f"{doc['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str], cost=None) -> int:
    """The command; `cost` replaces the flags' cost model (tests build one by hand)."""
    a = build_parser().parse_args(argv)
    try:
        weights = check(a)
        cost = cost or build_cost(a)
        pools = pool_of(a, cost)  # no page fits, a bad --tenant-tier: refused before any sweep
        t0 = time.perf_counter()
        ranked = search(a, weights, cost, a.jobs)
        doc = plan_doc(a, cost, pools, ranked, time.perf_counter() - t0)
    except (ValueError, OSError, KeyError) as e:
        raise CliError(f"pdtb sim plan: {e}") from None
    if a.out:
        write_results(a.out, doc)
    print(json.dumps(doc) if a.json else table(doc, ranked))
    return 0
