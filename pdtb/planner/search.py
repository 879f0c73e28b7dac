"""The placement search: candidates (colocated x N/T, every P+D = N/T, each host-tier size), one
`sweep()` to the knee each, ranked by goodput per GPU.

The placement search behind `pdtb sim plan`: which prefill:decode split of N GPUs, and which
host-tier budget per node, gives the most goodput per GPU (DistServe's question, OSDI'24), with
the fairness policy and its flags running in every simulated node.

    candidates(N, T, hosts)      colocated x N/T (the baseline), then every P+D = N/T, P, D >= 1,
                                 each with every host-tier size in `hosts`
    evaluate(a, c, loads, ...)   one candidate's rate sweep (pdtb/sim/run.py's sweep, always
                                 --until-knee from `loads`), reduced to an `Outcome`
    router_count(levels, ...)    the router processes it needs: its best passing level's requests
                                 and tokens a second at the routers' costs, each router kept
                                 under --router-target busy (pdtb/sim/routers.py)
    search(a, ...)               the baseline from --rates (default 1), then every other
                                 candidate from the baseline's knee load, so that most of them
                                 bracket their own knee in a few levels; ranked by goodput per GPU

Each candidate starts from the same loads whatever the order or the number of worker
processes, so `--jobs` changes the wall time and nothing else.

A candidate's goodput is the sweep's max goodput where the knee scope (--knee-on: every class by
default) attains --target; it is found to within --knee-resolution of the load, so candidates
closer than that to each other are a tie as far as this search can tell.
"""
from __future__ import annotations

import sys
import time
from argparse import Namespace
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from pdtb.figures import sweep_figures as sf
from pdtb.figures.service import ServiceWeights
from pdtb.sim.flags import router_cost
from pdtb.sim.routers import RouterCost, routers_needed
from pdtb.sim.run import sweep


@dataclass(frozen=True)
class Candidate:
    """One way to deploy the GPUs: colocated replicas, or a prefill:decode split, and a host tier."""

    mode: str  # "colocated" | "disagg"
    prefill: int  # prefill nodes (0 when colocated)
    decode: int  # decode nodes (0 when colocated)
    replicas: int  # colocated nodes (0 when disaggregated)
    tp: int  # GPUs per node
    host_kv_pages: int = 0  # host-tier pages per decode/colocated node (a prefill node has none)

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode + self.replicas

    @property
    def gpus(self) -> int:
        return self.nodes * self.tp

    @property
    def label(self) -> str:
        base = f"colo x{self.replicas}" if self.mode == "colocated" else f"{self.prefill}P+{self.decode}D"
        return f"{base} host {self.host_kv_pages}" if self.host_kv_pages else base

    def flags(self) -> dict:
        """The `pdtb sim` cluster flags of this candidate (Namespace overrides)."""
        return {"mode": self.mode, "prefill": self.prefill, "decode": self.decode,
                "replicas": self.replicas, "host_kv_pages": self.host_kv_pages}


def candidates(gpus: int, tp: int, hosts: tuple[int, ...] = (0,)) -> list[Candidate]:
    """Every deployment of `gpus` GPUs in nodes of `tp`: colocated first (the baseline every
    other candidate starts its sweep from), then P prefill + D decode nodes for P = 1 .. n - 1."""
    if tp < 1 or gpus < 1:
        raise ValueError(f"--gpus and --tp must be at least 1, got {gpus} and {tp}")
    if gpus % tp:
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp {tp} (each node is --tp GPUs)")
    n = gpus // tp
    if n < 2:
        raise ValueError(f"--gpus {gpus} at --tp {tp} is one node: a prefill and a decode node need "
                         f"at least {2 * tp} GPUs")
    if not hosts or min(hosts) < 0:
        raise ValueError("--host-kv-pages wants sizes of at least 0")
    out = [Candidate("colocated", 0, 0, n, tp, h) for h in hosts]
    out += [Candidate("disagg", p, n - p, 0, tp, h) for p in range(1, n) for h in hosts]
    return out


@dataclass
class Outcome:
    """One candidate's rate sweep, reduced to what the ranking, the table and the JSON need."""

    candidate: Candidate
    max_goodput_rps: float  # the best goodput of a level where the knee scope attains the target
    knee_load: float | None  # load multiplier of the highest passing level below the first failing one
    knee_bracket_rps: list  # offered req/s of [that level, the failing one]; None where not found
    levels: list[dict] = field(default_factory=list)  # per level: load, offered, goodput, attainment
    wall_s: float = 0.0  # wall time of the sweep
    routers: dict = field(default_factory=dict)  # router_count's: the router processes it needs, and why

    @property
    def per_gpu_rps(self) -> float:
        return self.max_goodput_rps / self.candidate.gpus

    @property
    def bracketed(self) -> bool:
        """Both sides of the knee were found (else --max-levels ran out first)."""
        return None not in self.knee_bracket_rps

    def to_json(self) -> dict:
        c = self.candidate
        return {"label": c.label, **asdict(c), "gpus": c.gpus, "max_goodput_rps": self.max_goodput_rps,
                "per_gpu_rps": self.per_gpu_rps, "knee_load": self.knee_load,
                "knee_bracket_rps": self.knee_bracket_rps, "bracketed": self.bracketed,
                "wall_s": round(self.wall_s, 3), "routers": self.routers, "levels": self.levels}


def goodput_of(derived: dict, knee_on: str) -> float:
    """The sweep's max goodput in the knee's scope: every class, overall, or one class's own."""
    if knee_on == "every-class":
        return derived["max_goodput_every_class_rps"]
    if knee_on == "overall":
        return derived["max_goodput_rps"]
    return derived["per_class"].get(knee_on, {}).get("max_goodput_rps", 0.0)


def _level(lv: dict, target: float, knee_on: str) -> dict:
    """A level without its records: what the JSON keeps of it."""
    o = lv["overall"]
    return {"load": lv["load"], "offered_rps": o["offered_rps"], "goodput_rps": o["goodput_rps"],
            "attainment": o["attainment"], "passes": sf.passes(lv, target, knee_on),
            "per_class_attainment": {k: g["attainment"] for k, g in lv["per_class"].items()}}


def router_count(levels: list[dict], cost: RouterCost, target: float, knee_on: str, busy: float) -> dict:
    """Router processes for the candidate's best level that attains `target` (else its first):
    its offered requests and streamed tokens a second cost `cost.load_s` CPU seconds a second,
    spread over routers each at most `busy` busy."""
    ok = [lv for lv in levels if sf.passes(lv, target, knee_on)]
    lv = max(ok, key=lambda lv: lv["overall"]["goodput_rps"]) if ok else min(levels, key=lambda lv: lv["load"])
    o = lv["overall"]
    load = cost.load_s(o["offered_rps"], o["output_tok_s"])
    return {"routers": routers_needed(load, busy), "load": lv["load"], "requests_per_s": o["offered_rps"],
            "tokens_per_s": o["output_tok_s"], "cpu_s_per_s": load, "target_busy_share": busy}


def evaluate(a: Namespace, cand: Candidate, loads: list[float], weights: ServiceWeights, cost) -> Outcome:
    """`cand`'s rate sweep from `loads` until its knee is bracketed (or --max-levels)."""
    ns = Namespace(**{**vars(a), **cand.flags(), "rates": list(loads), "until_knee": True})
    t0 = time.perf_counter()
    doc = sweep(ns, weights, cost, quiet=True, keep_records=False)
    d = doc["derived"]
    routers = router_count(doc["levels"], router_cost(ns, cost), a.target, a.knee_on, a.router_target)
    return Outcome(cand, goodput_of(d, a.knee_on), d["knee_load"], list(d["knee_bracket_rps"]),
                   [_level(lv, a.target, a.knee_on) for lv in doc["levels"]], time.perf_counter() - t0, routers)


def _report(o: Outcome, quiet: bool) -> Outcome:
    if not quiet:
        print(f"plan: {o.candidate.label}: {len(o.levels)} levels, max goodput {o.max_goodput_rps:.2f} req/s "
              f"({o.per_gpu_rps:.3f} per GPU) in {o.wall_s:.1f} s", file=sys.stderr, flush=True)
    return o


def search(a: Namespace, weights: ServiceWeights, cost, jobs: int = 1, quiet: bool = False) -> list[Outcome]:
    """Every candidate of the flags' GPUs, ranked by goodput per GPU (best first; ties keep the
    candidates' order, the colocated baseline first)."""
    cands = candidates(a.gpus, a.tp, tuple(a.host_kv_pages))
    start = list(a.rates or [1.0])
    base = _report(evaluate(a, cands[0], start, weights, cost), quiet)
    # The baseline's knee is the nearest guess at every other candidate's; with none (it failed
    # at every load tried), the others start where it did.
    loads = [base.knee_load] if base.knee_load else start
    rest = cands[1:]
    if jobs > 1 and len(rest) > 1:
        with ProcessPoolExecutor(max_workers=min(jobs, len(rest))) as pool:
            futures = [pool.submit(evaluate, a, c, loads, weights, cost) for c in rest]
            outs = [_report(f.result(), quiet) for f in futures]
    else:
        outs = [_report(evaluate(a, c, loads, weights, cost), quiet) for c in rest]
    order = [base, *outs]
    return sorted(order, key=lambda o: -o.per_gpu_rps)
