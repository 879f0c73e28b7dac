"""MC-SF on the real Scheduler, `fairness/mcsf.py` and a one-token-page PagePool, one step per
round on a fake clock.

MC-SF on the project's own code: the real `Scheduler`, the registered `mcsf` policy
(`fairness/mcsf.py`, built by `fairness.make_policy` as the nodes build it) and a real
`PagePool`, stepped on a fake clock, one scheduler step per round of the paper's model
(`mcsf_hindsight.py`), with a fake forward pass.

How the model maps onto the engine:

    job (a, s, o)   -> a Sequence of s prompt tokens, max_tokens = o, ignore_eos, added in step a
    memory M        -> a device pool of M pages of one token each (page_size 1: pages = tokens)
    round t         -> scheduler step t; the token budget takes every prompt whole, so a job
                       admitted in step p prefills and samples its first token in step p,
                       one token per step after, and finishes in step p + o - 1
    completion      -> p + o (the end of its last step); latency p + o - a

The policy plans each request at (tokens now, tokens max_tokens still allows) and checks the
pool at every predicted completion, the request counted with all its tokens there: the
memory charge of the model's rounds. The pool itself holds one token less per running request
(the token a step samples gets its KV in the next step), so it never runs out first: no
eviction or preemption happens, and `McsfRun.evictions` says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdtb.sim.repro.mcsf_hindsight import Instance


@dataclass
class McsfRun:
    starts: list[int]  # step each job was admitted in
    completions: list[int]  # end of each job's last step
    latency: int  # sum of completion - arrival
    evictions: int = 0  # demotions or preemptions the scheduler made (0 in this model)
    steps: int = 0  # scheduler steps taken


class _Clock:
    """The fake clock: the current round, in seconds."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _scheduler(inst: Instance, clock: _Clock):
    from fairness import make_policy
    from pdtb.engine.kv_spec import KVSpec
    from pdtb.engine.page_pool import PagePool
    from pdtb.engine.scheduler import Scheduler, SchedulerConfig

    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, page_size=1, dtype="float32")
    jobs = inst.jobs
    # a budget that takes every prompt and every decode row at once: admission is MC-SF's alone
    cfg = SchedulerConfig(max_num_seqs=len(jobs), max_num_batched_tokens=sum(j.prompt + 1 for j in jobs),
                          max_model_len=max(j.prompt + j.output for j in jobs) + 1)
    return Scheduler(cfg, PagePool(spec, inst.memory), policy=make_policy("mcsf"), clock=clock)


def _request(i: int, job):
    from pdtb.engine.sequence import SamplingParams, Sequence

    seq = Sequence.from_prompt(str(i), [1] * job.prompt, SamplingParams(max_tokens=job.output, ignore_eos=True))
    seq.arrival_time = float(job.arrival)  # the policy breaks ties between equal outputs by arrival
    return seq


def _forward(sched, out) -> list:
    """The fake forward pass: every chunk is computed, a chunk at the end samples a token, which
    ends its request by the engine's own rule (scheduler.append_token)."""
    from pdtb.engine.scheduler import append_token

    for c in out.chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
    return [c.seq for c in out.chunks if c.wants_logits and append_token(sched, c.seq, 1, ()).finished]


def run_mcsf(inst: Instance) -> McsfRun:
    """Run `inst` through the real scheduler under the real MC-SF policy."""
    clock = _Clock()
    sched = _scheduler(inst, clock)
    n = len(inst.jobs)
    starts, ends = [-1] * n, [-1] * n
    arrivals = sorted(range(n), key=lambda i: inst.jobs[i].arrival)
    limit = max(j.arrival for j in inst.jobs) + sum(j.output for j in inst.jobs) + 1  # serial finish
    run = McsfRun(starts, ends, 0)
    t = 0
    while min(ends) < 0:
        if t > limit:
            raise RuntimeError(f"mcsf did not finish within {limit} rounds (serial order finishes by then)")
        clock.t = float(t)
        while arrivals and inst.jobs[arrivals[0]].arrival == t:
            i = arrivals.pop(0)
            sched.add(_request(i, inst.jobs[i]))
        out = sched.schedule()
        run.evictions += len(out.moves)
        for c in out.chunks:
            i = int(c.seq.request_id)
            if starts[i] < 0:
                starts[i] = t
        for seq in _forward(sched, out):
            ends[int(seq.request_id)] = t + 1
        t += 1
    run.steps = t
    run.latency = sum(e - j.arrival for e, j in zip(ends, inst.jobs))
    return run
