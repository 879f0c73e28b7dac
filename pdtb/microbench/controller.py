"""`pdtb bench controller`.

`pdtb bench controller`: per-step decision cost of each policy at 100, 1,000 and 10,000
resident requests, with the scheduler driven by a fake forward pass (no model), so only the
controller's and scheduler's own work is timed. Beside the n resident requests, `--waiting`
times n more wait for device pages (default 0.5: n/2 prompts), so that admission order, quota
checks and reclaim are in the timed step too, not only the ordering of running rows (memfair's
reclaim and MC-SF's feasibility check are where a quadratic cost would show, unseen by a
resident-only bench). Prints cost per step and its growth against n log n (a ratio <= 1 means no faster
than n log n) measured in the same run."""
from __future__ import annotations

import argparse
import json
import math
import random
import time

from fairness import POLICIES, make_policy
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig
from pdtb.engine.sequence import SamplingParams, Sequence

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, page_size=16, dtype="float32")


def build(policy: str, n: int, seed: int = 0, waiting: float = 0.0) -> Scheduler:
    rng = random.Random(seed)
    pages = n * 3 + 64
    n_wait = int(n * waiting)
    sched = Scheduler(SchedulerConfig(max_num_seqs=n + n_wait + 16, max_num_batched_tokens=n + 256, max_model_len=1 << 20),
                      PagePool(SPEC, pages), policy=make_policy(policy), host_pool=PagePool(SPEC, n, tier="host"),
                      clock=lambda: 0.0)
    for i in range(n):  # resident, decoding requests of 8 tenants
        plen = rng.randint(8, 30)
        seq = Sequence.from_prompt(f"r{i}", [1] * plen, SamplingParams(max_tokens=10_000, ignore_eos=True),
                                   tenant=f"t{i % 8}", priority=i % 3)
        seq.arrival_time = float(i)
        seq.token_ids.append(1)
        seq.num_computed_tokens = plen
        sched.pool.allocate(seq.request_id, SPEC.pages_for(plen + 1))
        sched.add_running(seq)
    for j in range(n_wait):  # prompts waiting for device pages, varied predicted lengths
        seq = Sequence.from_prompt(f"w{j}", [1] * 20, SamplingParams(max_tokens=rng.randint(2, 400), ignore_eos=True),
                                   tenant=f"t{j % 8}", priority=j % 3)
        seq.arrival_time = float(n + j)
        sched.add(seq)
    return sched


def time_steps(sched: Scheduler, steps: int) -> float:
    """Median seconds of one schedule() call; the fake forward advances every chunk."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        times.append(time.perf_counter() - t0)
        for c in out.chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            if c.wants_logits:
                c.seq.token_ids.append(1)
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb bench controller", description=__doc__)
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--policies", default=",".join(sorted(POLICIES)))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--waiting", type=float, default=0.5,
                    help="requests waiting for device pages per resident one (0: resident only)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not 0 <= a.waiting <= 10:
        ap.error("--waiting must be between 0 and 10")
    sizes = [int(x) for x in a.sizes.split(",")]
    rows = []
    for pol in a.policies.split(","):
        base = None
        for n in sizes:
            # small n: median over several fresh builds (one build's steps are too short to time
            # steadily, and the n=100 figure is every ratio's base)
            runs = [time_steps(build(pol, n, seed, waiting=a.waiting), a.steps) for seed in range(max(1, 1000 // n))]
            sec = sorted(runs)[len(runs) // 2]
            per = sec / (n * math.log2(n))
            base = base or per
            rows.append({"policy": pol, "n": n, "step_us": sec * 1e6, "us_per_request": sec * 1e6 / n,
                         "vs_nlogn": per / base})
    if a.json:
        print(json.dumps({"rows": rows, "steps": a.steps, "waiting": a.waiting}))
        return 0
    print(f"{'policy':9} {'n':>6} {'step (us)':>11} {'us/request':>10} {'cost/(n log n) vs n=' + str(sizes[0]):>24}")
    for r in rows:
        print(f"{r['policy']:9} {r['n']:6d} {r['step_us']:11.0f} {r['us_per_request']:10.2f} {r['vs_nlogn']:24.2f}")
    return 0
