"""`pdtb sim reproduce vtc [--json]`: VTC vs fcfs with two backlogged clients (Sheng et al.,
OSDI'24), the accumulated service difference against the paper's bound and the artifact's figures.

`pdtb sim reproduce vtc`: the synthetic two-client experiment of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI'24, arXiv 2401.00588; artifact Ying1123/VTC-artifact,
suite "overload": two clients sending 256+256-token requests at 1.5 and 3 per second).

Service is VTC's weighted tokens: w_in per input token, w_out per output token (1 and 2, the
paper's defaults). For any two clients backlogged over an interval [t1, t2), VTC keeps

    |W_f(t1, t2) - W_g(t1, t2)|  <=  2 * max(w_in * L_input, w_out * M)

(L_input: the longest input; M: the most tokens a running batch holds, the KV pool). FCFS
serves in arrival order, so the client sending twice as fast gets twice the service and the
difference grows with time.

Both policies run in one simulated colocated node (the real Scheduler, PagePool and
fairness/vtc.py or fcfs.py) until sending stops; while the clients send faster than the node
serves, both stay backlogged. The accumulated difference D(t) = W_2(0, t) - W_1(0, t) is
exact: a request's input counts when its first token arrives, each output token when it
arrives (pdtb/figures/service.py). The artifact's own measure (each request's service spread
evenly between its first token and its end, sampled at 20 ticks: its
plot/plot_6.2_work_diff.py) is printed beside it, since the paper's figures use that one.
"""
from __future__ import annotations

import bisect
import json
import random
import time
from dataclasses import asdict, dataclass

from pdtb.figures.records import RequestRecord, RequestSpec
from pdtb.figures.service import ServiceWeights, service_events
from pdtb.sim.repro.args import OneLineParser, config_from
from pdtb.sim.cluster import ClusterShape, SimCluster
from pdtb.sim.cost import FixedStepCost
from pdtb.sim.node import NodeShape
from pdtb.sim.flags import page_spec

# The paper's setting and what its artifact's published results show (fair_bench/{VTC,FCFS}/
# all_results_overload.jsonl through the artifact's measure): Llama-2-7B on an A10G, a
# 10,000-token pool (launch_server.py --num-token), served about 1.75 requests/s.
PAPER = {
    "bound": 40000.0,  # 2 * max(1 * 256, 2 * 10000)
    "vtc_max": 7654.0,  # VTC, a 360 s run: the largest accumulated difference over its 19 ticks
    # FCFS, a 600 s run: the accumulated difference at its ticks, every 30 s
    "fcfs_at": dict(zip(range(30, 600, 30), (11603.0, 25040.0, 38319.0, 51342.0, 64682.0, 77948.0, 91046.0,
                                             103636.0, 117105.0, 130349.0, 143417.0, 156699.0, 169963.0, 183007.0,
                                             195612.0, 209118.0, 222387.0, 235513.0, 248716.0))),
    "fcfs_end_over_half": 2.01,  # FCFS: the difference at 360 s over the one at 180 s
    "throughput_rps": 1.75,
}
NOTES = (
    "one step takes a fixed 50 ms (FixedStepCost): the node then serves about 1.8 requests/s, the "
    "artifact's measured 1.75/s; the bound counts tokens, not seconds, so no accelerator model is needed",
    "M is this node's device pool (10,000 tokens, as the artifact's server); a host tier (40,000 tokens) "
    "takes the requests the scheduler evicts as the batch grows, where the artifact's server admitted a "
    "request only once its whole output fitted (vtc_req_queue.py) and evicted none; without it (--host-tokens 0) an evicted request is "
    "recomputed and fairness/vtc.py charges its prompt again, which the measured service does not count",
    "fairness/vtc.py charges input tokens as they are prefilled, the paper's VTC all of them at admission",
    "the run stops when sending does (default 180 s, the paper's 360 s with --duration 360): after it the "
    "backlogs drain one after the other and the clients are no longer both backlogged",
)


@dataclass(frozen=True)
class VtcConfig:
    duration: float = 180.0  # seconds of sending; the run is cut off there
    rates: tuple[float, float] = (1.5, 3.0)  # requests/s of client 1 and client 2
    prompt: int = 256  # input tokens of every request (L_input)
    output: int = 256  # output tokens of every request
    kv_tokens: int = 10000  # M: tokens of the device pool
    host_tokens: int = 40000  # host tier (0: evicted requests are recomputed)
    page_size: int = 16
    step_ms: float = 50.0  # the fixed time of one step
    budget: int = 2048  # per-step token budget
    w_in: float = 1.0  # service per input token
    w_out: float = 2.0  # service per output token
    seed: int = 42  # the phase of each client's arrivals
    ticks: int = 20  # points of the printed series (and of the artifact's measure)

    def __post_init__(self) -> None:
        if not self.duration > 0 or len(self.rates) != 2 or min(self.rates) <= 0:
            raise ValueError("--duration must be positive and --rates two positive rates")
        if min(self.prompt, self.output, self.page_size, self.budget, self.ticks) < 1:
            raise ValueError("--prompt, --output, --page-size, --budget and --ticks must be at least 1")
        if self.kv_tokens % self.page_size or self.host_tokens % self.page_size or self.host_tokens < 0:
            raise ValueError("--kv-tokens and --host-tokens must be whole pages (multiples of --page-size)")
        if self.kv_tokens < self.prompt + self.output:
            raise ValueError(f"--kv-tokens must hold one request: at least {self.prompt + self.output}")
        if not self.step_ms > 0 or self.w_in < 0 or self.w_out < 0 or not self.w_in + self.w_out > 0:
            raise ValueError("--step-ms must be positive and the weights non-negative, not both 0")


def vtc_bound(max_input: int, batch_tokens: int, w_in: float, w_out: float) -> float:
    """The paper's bound on the service difference of two backlogged clients under VTC."""
    return 2 * max(w_in * max_input, w_out * batch_tokens)


def two_clients(cfg: VtcConfig) -> list[RequestSpec]:
    """The artifact's "uniform" arrivals: client i sends every 1 / rate_i seconds from a random
    phase in [0, 1 / rate_i), every request of the same lengths."""
    rng, specs = random.Random(cfg.seed), []
    for i, rate in enumerate(cfg.rates):
        t = rng.random() / rate
        while t < cfg.duration:
            specs.append(RequestSpec(t, f"client{i + 1}", f"client{i + 1}", cfg.prompt, cfg.output))
            t += 1 / rate
    return sorted(specs, key=lambda s: s.send_time)


def vtc_args(cfg: VtcConfig) -> tuple:
    """vtc's settings for the paper's charges (fairness/vtc.py)."""
    return ("input_weight", repr(cfg.w_in)), ("output_weight", repr(cfg.w_out))


def simulate_policy(cfg: VtcConfig, policy: str) -> list[RequestRecord]:
    """The two clients through one colocated node under `policy`, cut off when sending stops."""
    cost = FixedStepCost(cfg.step_ms / 1e3, 4 * cfg.page_size)  # a page's bytes matter to nothing here
    node = NodeShape("colocated", cfg.kv_tokens // cfg.page_size, cfg.host_tokens // cfg.page_size,
                     max_num_batched_tokens=cfg.budget, max_model_len=max(4096, cfg.prompt + cfg.output),
                     policy=policy, policy_args=vtc_args(cfg) if policy == "vtc" else ())
    cluster = SimCluster(ClusterShape((node,)), page_spec(cost.page_bytes, cfg.page_size), cost)
    return cluster.run(two_clients(cfg), cfg.duration)


def difference(records: list[RequestRecord], w: ServiceWeights) -> tuple[list[float], list[float]]:
    """D(t) = client 2's service minus client 1's, after each service event (times sorted)."""
    sign = {"client1": -1.0, "client2": 1.0}
    events = sorted((t, sign[r.tenant] * s) for r in records for t, s in service_events(r, w))
    times, diffs, d = [0.0], [0.0], 0.0
    for t, s in events:
        d += s
        times.append(t)
        diffs.append(d)
    return times, diffs


def value_at(times: list[float], diffs: list[float], t: float) -> float:
    """D at time t (the last event at or before it)."""
    return diffs[bisect.bisect_right(times, t) - 1]


def backlogged_since(records: list[RequestRecord], tenant: str, end: float) -> float | None:
    """Since when `tenant` has had a sent request without its first token, up to `end`
    (None: it had none left at the end)."""
    steps = sorted([(r.send_time, 1) for r in records if r.tenant == tenant]
                   + [(r.first_token_time, -1) for r in records if r.tenant == tenant and r.first_token_time])
    since, open_ = None, 0
    for t, step in steps:
        open_ += step
        if open_ == 0:
            since = None
        elif since is None:
            since = t
    return since if open_ and since is not None and since <= end else None


def artifact_measure(records: list[RequestRecord], w: ServiceWeights, ticks: list[float]) -> list[float]:
    """The artifact's accumulated difference at `ticks`: a request's whole service spread
    evenly over [first token, end] (plot_6.2_work_diff.py), absolute value."""
    acc = {"client1": [0.0] * len(ticks), "client2": [0.0] * len(ticks)}
    for r in records:
        if r.first_token_time is None or r.end_time is None or r.end_time <= r.first_token_time:
            continue
        s = w.input * r.prompt_tokens + w.output * r.output_tokens
        for i, x in enumerate(ticks):
            overlap = max(0.0, min(x, r.end_time) - r.first_token_time)
            acc[r.tenant][i] += s * overlap / (r.end_time - r.first_token_time)
    return [abs(a - b) for a, b in zip(acc["client1"], acc["client2"])]


def measure(cfg: VtcConfig, policy: str) -> dict:
    """One policy's figures: the accumulated difference (exact and the artifact's measure),
    and the largest difference over any interval in which both clients were backlogged."""
    t0 = time.perf_counter()
    records = simulate_policy(cfg, policy)
    w = ServiceWeights(cfg.w_in, cfg.w_out)
    times, diffs = difference(records, w)
    end, half = value_at(times, diffs, cfg.duration), value_at(times, diffs, cfg.duration / 2)
    since = [backlogged_since(records, c, cfg.duration) for c in ("client1", "client2")]
    window = None if None in since else max(since)
    interval_max = None
    if window is not None:  # max over t1 < t2 in the window of |D(t2) - D(t1)|: the range of D there
        inside = [value_at(times, diffs, window)] + [d for t, d in zip(times, diffs) if t >= window]
        interval_max = max(inside) - min(inside)
    ticks = [cfg.duration * i / cfg.ticks for i in range(1, cfg.ticks + 1)]
    art = artifact_measure(records, w, ticks)
    return {
        "max_abs_diff": max(abs(d) for d in diffs), "end_diff": end, "half_diff": half,
        "end_over_half": round(end / half, 3) if half else None,
        "both_backlogged_from_s": window, "max_interval_diff_backlogged": interval_max,
        "artifact_max_diff": round(max(art), 1), "artifact_end_diff": round(art[-1], 1),
        "served": {c: sum(1 for r in records if r.tenant == c and r.status == "ok") for c in ("client1", "client2")},
        "waiting_at_end": {c: sum(1 for r in records if r.tenant == c and r.first_token_time is None)
                           for c in ("client1", "client2")},
        "series": [[round(t, 2), value_at(times, diffs, t)] for t in ticks],
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def summarize(cfg: VtcConfig) -> dict:
    bound = vtc_bound(cfg.prompt, cfg.kv_tokens, cfg.w_in, cfg.w_out)
    runs = {p: measure(cfg, p) for p in ("fcfs", "vtc")}
    vtc, fcfs = runs["vtc"], runs["fcfs"]
    return {
        "bound": bound, "bound_formula": "2 * max(w_in * L_input, w_out * M)",
        "vtc_within_bound": vtc["max_abs_diff"] <= bound,
        "fcfs_end_exceeds_bound": abs(fcfs["end_diff"]) > bound,
        "runs": runs, "paper": PAPER, "config": asdict(cfg), "notes": list(NOTES),
    }


def table(s: dict) -> str:
    c, v, f, p = s["config"], s["runs"]["vtc"], s["runs"]["fcfs"], s["paper"]
    num = (lambda x: "-" if x is None else f"{x:,.0f}")
    paper_fcfs = p["fcfs_at"].get(round(c["duration"]))
    rows = [
        ("bound 2*max(w_in*L_in, w_out*M)", num(s["bound"]), num(p["bound"])),
        ("VTC  max |D| (exact)", num(v["max_abs_diff"]), ""),
        ("VTC  max |D| (artifact's measure)", num(v["artifact_max_diff"]), num(p["vtc_max"])),
        ("VTC  max over backlogged intervals", num(v["max_interval_diff_backlogged"]), ""),
        ("VTC  D at the end", num(v["end_diff"]), ""),
        ("FCFS D at half time", num(f["half_diff"]), num(p["fcfs_at"].get(round(c["duration"] / 2)))),
        ("FCFS D at the end", num(f["end_diff"]), num(paper_fcfs)),
        ("FCFS end / half", f"{f['end_over_half']}", f"{p['fcfs_end_over_half']}"),
    ]
    lines = [
        "VTC (fairness/vtc.py) vs FCFS, two backlogged clients: Sheng et al., OSDI'24, suite \"overload\"",
        f"rates {c['rates'][0]:g}/s and {c['rates'][1]:g}/s, {c['prompt']}+{c['output']} tokens, "
        f"M = {c['kv_tokens']:,} tokens, weights {c['w_in']:g}/{c['w_out']:g}, {c['duration']:g} s, "
        f"steps of {c['step_ms']:g} ms",
        "D(t): client 2's accumulated service minus client 1's (weighted tokens)", "",
        f"{'':<40}{'this run':>12}{'paper':>10}",
        *(f"{a:<40}{b:>12}{x:>10}" for a, b, x in rows),
        "paper: the bound for its setting; the rest from the artifact's published results through its measure "
        "(FCFS from a 600 s run at the same times; end / half: 360 s over 180 s)", "",
        f"VTC within the bound: {s['vtc_within_bound']}; FCFS past it at the end: {s['fcfs_end_exceeds_bound']}",
    ]
    lines += _run_lines(v, f) + ["", "setting against the paper's:", *(f"  - {n}" for n in s["notes"])]
    return "\n".join(lines)


def _run_lines(v: dict, f: dict) -> list[str]:
    """Each run's requests and wall time, then both series side by side."""
    num = (lambda x: "-" if x is None else f"{x:,.0f}")
    lines = [f"{name}: served {r['served']}, waiting at the end {r['waiting_at_end']}, both backlogged "
             f"from {num(r['both_backlogged_from_s'])} s, {r['wall_s']:.1f} s wall"
             for name, r in (("vtc", v), ("fcfs", f))]
    lines += ["", f"{'t (s)':>8}{'D vtc':>12}{'D fcfs':>12}"]
    return lines + [f"{tv:>8g}{dv:>12,.0f}{df:>12,.0f}" for (tv, dv), (_, df) in zip(v["series"], f["series"])]


def _rates(text: str) -> tuple[float, float]:
    parts = tuple(float(x) for x in text.split(","))
    if len(parts) != 2:
        raise ValueError
    return parts


def parse(argv: list[str]) -> tuple[VtcConfig, bool]:
    d = VtcConfig()
    ap = OneLineParser(prog="pdtb sim reproduce vtc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    ap.add_argument("--duration", type=float, default=d.duration, help="seconds of sending")
    ap.add_argument("--rates", type=_rates, default=d.rates, help="R1,R2 requests/s of the two clients")
    for name in ("prompt", "output", "kv_tokens", "host_tokens", "page_size", "budget", "seed", "ticks"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in ("step_ms", "w_in", "w_out"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    return config_from(ap, argv, VtcConfig)


def main(argv: list[str]) -> int:
    cfg, as_json = parse(argv)
    s = summarize(cfg)
    print(json.dumps(s) if as_json else table(s))
    return 0
