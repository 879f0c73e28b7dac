"""`pdtb sim reproduce essay`: the project's claims at H100 scale, each beside what a simulated
run measures. "A 128K-token request holds 64 times the KV memory of a 2K-token one; the top 5%
longest requests hold about 80% of HBM; whale co-scheduling raises minnow evictions 2-4x."

Setting: Llama-3-8B (the shipped "llama-3-8b" shape) on one H100 SXM, colocated, priced by the
roofline (RooflineCost "h100-sxm"), the device pool what the roofline leaves for KV
(pool_pages(): 25,650 pages of 16 tokens, 410K tokens) and a host tier of 256 GiB of pinned
memory, so an eviction is a demotion over PCIe, not a recompute. The nodes' context is 135,000
tokens, enough for a 128K prompt and its output. The workload is whale-minnow (one tenant each,
the workload's default): 2,048+512-token minnows, Poisson at 14/s, and 131,072+256-token whales
every 10 s from t = 5 s, for 30 s of arrivals. Every request ends; nothing is cut off.

Why these sizes: one H100 prefills about 14 2K-token prompts a second beside its decoding, so
the minnow stream is about as fast as this node can take; with 512 output tokens the minnows
alone then hold most of the pool (70% on average from t = 5 s to 30 s, measured), a pool
under pressure before any whale comes. Outputs are kept modest for the simulator's cost (about 10 us
of wall time per generated token: about 0.2M tokens a run); a whale's output is short, as the
longest contexts of a real trace generate little (docs/method.md).

Where the essay's conditions hold: `--minnow-rate 4 --whale-interval 5 --whales 5` keeps about
two whales among about forty minnows in the pool, so the largest 5% of the requests in memory
are the whales (scripts/scorecard.sh runs it as sim-essay-top5.json).

  (a) pages of one request, by the engine's rule (KVSpec.pages_for), 128K vs 2K prompt tokens
  (b) the top 5% of requests' share of the device pool over the busy part (the observer's top5
      series, from the first whale to the last arrival, samples with requests in the pool)
  (c) minnow evictions (demotions and preemptions) per minnow, with whales vs the same minnow
      stream alone, under fcfs and under memfair
  (d) memfair over fcfs, both with whales: minnow TTFT p99 and ITL p99
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass

from pdtb.client import workloads as wl
from pdtb.figures.summary import summarize
from pdtb.common import CliError
from pdtb.sim.repro.args import OneLineParser, config_from
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.node import NodeShape
from pdtb.sim.roofline import RooflineCost
from pdtb.sim.flags import page_spec

GIB = 2**30
ESSAY = {"page_ratio": 64.0, "top5_share": 0.80, "eviction_ratio": "2-4x"}
TOP_FRAC, WHALE_TIMES = 0.05, 64  # the essay's arithmetic: 5% of requests, each 64 times the rest
BY_HAND_TOP5 = TOP_FRAC * WHALE_TIMES / (TOP_FRAC * WHALE_TIMES + 1 - TOP_FRAC)  # of the KV in use: 0.77
POLICIES = ("fcfs", "memfair")
NOTES = (  # how to read the figures against the essay's (printed with them)
    "(a) counts a prompt's pages by the engine's rule; whole requests differ by their outputs",
    "(b) the essay's 80% is the share when 5% of the requests in memory are 64 times the rest (77% of the KV "
    "in use, by hand); one H100's pool holds three 128K prompts, and in the default setting the whales come "
    "one at a time among about a hundred minnows, so the largest 5% is one whale or none and a few minnows",
    "(c) a ratio needs minnow evictions without whales: in the default setting this node prefills about as "
    "many 2K prompts a second as the minnows send, so by themselves they overflow the pool rarely, if at all",
    "(d) memfair splits each step's prompt tokens: a quarter of each tenant's max-min share to it, the rest to "
    "the smallest prompts first, so the 2K minnow prompts do not queue behind a 128K one",)


@dataclass(frozen=True)
class EssayConfig:
    duration: float = 30.0  # seconds of arrivals
    whales: int = 3
    whale_prompt: int = 131072
    whale_output: int = 256
    whale_start: float = 5.0  # first whale's send time (s)
    whale_interval: float = 10.0  # seconds between whales
    minnow_rate: float = 14.0  # minnows per second (Poisson)
    minnow_prompt: int = 2048
    minnow_output: int = 512
    host_gib: float = 256.0  # pinned host memory for the host tier
    kv_pages: int | None = None  # device pages (default: the roofline's pool for one H100)
    context: int = 135000  # the node's max_model_len
    page_size: int = 16
    budget: int = 2048  # per-step token budget (the nodes' default)
    seed: int = 0
    tp: int = 1  # GPUs of the node (tensor parallel): its HBM, so its pool, grows with them

    def __post_init__(self) -> None:
        if not self.duration > 0 or self.whales < 1 or self.minnow_rate <= 0:
            raise ValueError("--duration and --minnow-rate must be positive, --whales at least 1")
        if min(self.whale_prompt, self.whale_output, self.minnow_prompt, self.minnow_output, self.page_size,
               self.budget) < 1:
            raise ValueError("lengths, --page-size and --budget must be at least 1")
        if not 0 <= self.whale_start < self.duration or self.whale_interval < 0 or self.host_gib < 0:
            raise ValueError("--whale-start must be in [0, --duration), --whale-interval and --host-gib >= 0")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError("--kv-pages must be at least 1")
        if self.context < self.whale_prompt + self.whale_output:
            raise ValueError(f"--context must hold a whale: at least {self.whale_prompt + self.whale_output}")


def workload(cfg: EssayConfig, whales: bool) -> list:
    """The request list; without whales the minnows are the same (their own seeded stream)."""
    return wl.whale_minnow(wl.WhaleMinnowConfig(
        whales=cfg.whales if whales else 0, whale_prompt=str(cfg.whale_prompt), whale_output=str(cfg.whale_output),
        whale_start=cfg.whale_start, whale_interval=cfg.whale_interval, minnow_rate=cfg.minnow_rate,
        minnow_prompt=str(cfg.minnow_prompt), minnow_output=str(cfg.minnow_output), duration=cfg.duration), cfg.seed)


def node_shape(cfg: EssayConfig, cost: RooflineCost, policy: str) -> NodeShape:
    pages = cfg.kv_pages or cost.pool_pages()
    return NodeShape("colocated", pages, int(cfg.host_gib * GIB // cost.page_bytes), max_num_batched_tokens=cfg.budget,
                     max_model_len=cfg.context, policy=policy)


def run_one(cfg: EssayConfig, cost: RooflineCost, policy: str, whales: bool) -> dict:
    """One simulated run: the minnows' figures, evictions per class and the top-5% series."""
    t0 = time.perf_counter()
    shape = node_shape(cfg, cost, policy)
    cluster = SimCluster(ClusterShape((shape,)), page_spec(cost.page_bytes, cfg.page_size), cost)
    records = cluster.run(workload(cfg, whales))
    minnow = summarize(records, max(r.end_time for r in records))["per_class"].get("minnow")
    if minnow is None:
        raise ValueError("the workload has no minnows: a higher --minnow-rate or a longer --duration")
    sim = cluster.observer.summary(records)
    busy = [s for s in cluster.observer.top5 if cfg.whale_start <= s[0] <= cfg.duration and s[3]]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    return {
        "minnow_evictions_per_request": sim["evictions_per_request"]["minnow"],
        "evictions": sim["evictions"],
        "minnow_ttft_p99_ms": minnow["ttft_ms"]["p99"], "minnow_itl_p99_ms": minnow["itl_ms"]["p99"],
        "minnow_ttft_p50_ms": minnow["ttft_ms"]["p50"], "failed": sum(r.status != "ok" for r in records),
        "top5_pool_mean": mean([s[2] for s in busy]), "top5_pool_max": max((s[2] for s in busy), default=None),
        "top5_used_mean": mean([s[1] for s in busy]), "requests_in_pool_mean": mean([s[3] for s in busy]),
        "pool_used_mean": mean([1 - n["pages_free"] / n["pages_total"] for x in cluster.observer.samples
                                if cfg.whale_start <= x["t"] <= cfg.duration for n in x["nodes"]]),
        "device_pages": shape.num_pages, "host_pages": shape.host_pages,
        "simulated_s": round(cluster.loop.now, 1), "wall_s": round(time.perf_counter() - t0, 1),
    }


def page_figures(cfg: EssayConfig, cost: RooflineCost) -> dict:
    """(a): pages of a whale's and a minnow's prompt, and of whole requests, by the engine's rule."""
    spec = page_spec(cost.page_bytes, cfg.page_size)
    whale, minnow = spec.pages_for(cfg.whale_prompt), spec.pages_for(cfg.minnow_prompt)
    whole = spec.pages_for(cfg.whale_prompt + cfg.whale_output) / spec.pages_for(cfg.minnow_prompt + cfg.minnow_output)
    return {"whale_pages": whale, "minnow_pages": minnow, "page_ratio": whale / minnow,
            "whole_request_ratio": round(whole, 2), "whale_gib": whale * cost.page_bytes / GIB,
            "minnow_gib": minnow * cost.page_bytes / GIB, "page_bytes": cost.page_bytes}


def ratio(a, b):
    """a / b, None where either is missing or b is 0 (a ratio the run cannot give)."""
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def figures(cfg: EssayConfig) -> dict:
    """Every run and the four figures."""
    cost = RooflineCost.of("h100-sxm", "llama-3-8b", page_size=cfg.page_size, tp=cfg.tp)
    runs = {f"{p}{'' if w else '_alone'}": run_one(cfg, cost, p, w) for p in POLICIES for w in (True, False)}
    fc, mf = runs["fcfs"], runs["memfair"]
    per = (lambda r: r["minnow_evictions_per_request"])
    return {
        "pages": page_figures(cfg, cost),
        "top5": {"pool_mean": fc["top5_pool_mean"], "pool_max": fc["top5_pool_max"], "used_mean": fc["top5_used_mean"],
                 "requests_in_pool_mean": fc["requests_in_pool_mean"], "by_hand_used": round(BY_HAND_TOP5, 3)},
        "evictions": {p: {"with_whales": per(runs[p]), "alone": per(runs[f"{p}_alone"]),
                          "ratio": ratio(per(runs[p]), per(runs[f"{p}_alone"]))} for p in POLICIES},
        "memfair_over_fcfs": {"minnow_ttft_p99": ratio(mf["minnow_ttft_p99_ms"], fc["minnow_ttft_p99_ms"]),
                              "minnow_itl_p99": ratio(mf["minnow_itl_p99_ms"], fc["minnow_itl_p99_ms"])},
        "essay": ESSAY, "notes": list(NOTES), "runs": runs, "cost": cost.name, "config": asdict(cfg),
    }


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _times(e: dict) -> str:
    """An eviction ratio; with none alone, there is no ratio to give."""
    if e["ratio"] is not None:
        return f"{e['ratio']:.2f}x"
    return "inf (0 alone)" if e["with_whales"] else "- (0 and 0)"


def _figure_rows(s: dict) -> list[tuple[str, str, str]]:
    """(figure, this run, the essay's) rows of the main table."""
    c, pg, t5, ev, mo = s["config"], s["pages"], s["top5"], s["evictions"], s["memfair_over_fcfs"]
    return [
        (f"(a) pages, {c['whale_prompt']:,} vs {c['minnow_prompt']:,} tokens", f"{pg['page_ratio']:g}x", "64x"),
        ("(b) top-5% share of HBM, mean (fcfs)", _pct(t5["pool_mean"]), "~80%"),
        ("    max", _pct(t5["pool_max"]), ""),
        ("    share of the KV in use, mean", _pct(t5["used_mean"]), f"{_pct(t5['by_hand_used'])} by hand"),
        ("(c) minnow evictions with / without whales, fcfs", _times(ev["fcfs"]), "2-4x"),
        ("    memfair", _times(ev["memfair"]), ""),
        ("(d) memfair / fcfs, minnow TTFT p99", _x(mo["minnow_ttft_p99"]), ""),
        ("    minnow ITL p99", _x(mo["minnow_itl_p99"]), ""),
    ]


def _detail_lines(s: dict) -> list[str]:
    """What each figure is made of."""
    pg, t5, ev = s["pages"], s["top5"], s["evictions"]
    held = t5["requests_in_pool_mean"] or 0
    lines = [f"(a) {pg['whale_pages']:,} pages ({pg['whale_gib']:.1f} GiB) vs {pg['minnow_pages']:,} "
             f"({pg['minnow_gib']:.2f} GiB); whole requests (prompt + output) {pg['whole_request_ratio']:g}x",
             f"(b) requests holding pages: {held:.0f} on average, so the top 5% is {math.ceil(0.05 * held)} of "
             f"them; by hand: 5% of requests at 64x hold {_pct(t5['by_hand_used'])} of the KV in use"]
    for p in POLICIES:
        lines.append(f"(c) {p}: {ev[p]['with_whales']:.4f} evictions per minnow with whales, "
                     f"{ev[p]['alone']:.4f} alone")
    return lines


def _run_lines(runs: dict) -> list[str]:
    """One line per simulated run."""
    lines = [f"{'run':<16}{'ev/minnow':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}{'pool used':>10}"
             f"{'failed':>7}{'sim s':>7}{'wall s':>7}"]
    for name, x in runs.items():
        lines.append(f"{name:<16}{x['minnow_evictions_per_request']:>10.4f}{x['minnow_ttft_p50_ms'] or 0:>10.0f}"
                     f"{x['minnow_ttft_p99_ms'] or 0:>10.0f}{x['minnow_itl_p99_ms'] or 0:>9.1f}"
                     f"{_pct(x['pool_used_mean']):>10}{x['failed']:>7}{x['simulated_s']:>7.0f}{x['wall_s']:>7.1f}")
    lines.append("(times in ms; pool used: mean share of device pages held, from the first whale to the last arrival)")
    return lines


def table(s: dict) -> str:
    c, r = s["config"], s["runs"]
    head = [
        f"The essay's claims at H100 scale ({s['cost']}, colocated, {r['fcfs']['device_pages']:,} device pages "
        f"of {s['pages']['page_bytes'] // 2**20} MiB, {r['fcfs']['host_pages']:,} host pages)",
        f"{c['whales']} whales of {c['whale_prompt']:,}+{c['whale_output']} tokens every {c['whale_interval']:g} s "
        f"from {c['whale_start']:g} s; minnows {c['minnow_prompt']:,}+{c['minnow_output']} at {c['minnow_rate']:g}/s "
        f"for {c['duration']:g} s", "",
        f"{'':<52}{'this run':>12}{'essay':>14}",
        *(f"{a:<52}{b:>12}{x:>14}" for a, b, x in _figure_rows(s)), "",
    ]
    notes = ["", "reading the figures against the essay's:", *(f"  - {n}" for n in s["notes"])]
    return "\n".join(head + _detail_lines(s) + [""] + _run_lines(r) + notes)


def parse(argv: list[str]) -> tuple[EssayConfig, bool]:
    d = EssayConfig()
    ap = OneLineParser(prog="pdtb sim reproduce essay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    for name in ("duration", "whale_start", "whale_interval", "minnow_rate", "host_gib"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    for name in ("whales", "whale_prompt", "whale_output", "minnow_prompt", "minnow_output", "kv_pages", "context",
                 "page_size", "budget", "seed", "tp"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    return config_from(ap, argv, EssayConfig)


def main(argv: list[str]) -> int:
    cfg, as_json = parse(argv)
    try:
        s = figures(cfg)
    except ValueError as e:  # a page size the roofline's page cannot take, a pool too small for a whale
        raise CliError(f"pdtb sim reproduce essay: {e}") from None
    print(json.dumps(s) if as_json else table(s))
    return 0
