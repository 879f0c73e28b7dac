"""Runs of identical decode steps taken at once: the simulator's cost follows the events that
can change a decision, not every step.

A node *coasts* when its last step served every running row one decode token, nothing waits,
is parked or is held at the prefill side, and its policy has `on_steps`. Then the next steps
are the same step again, each row one token further, until a row finishes, the free pages
would not cover the rows' growth, or a message arrives. The scheduler and the policy would
answer those steps alike (reclaim nothing, every row steps, nothing to admit), so they are not
asked; the policy is told how many steps passed (`on_steps`) before it is asked anything again.

    K steps planned, each's end time the sum of the cost model's step times (the same
    arithmetic as one event per step) -> one event at the last step's end -> that step ends
    as any step does (`SimNode._end_step`: finishes, timings, the next step)

Anything that reads the node meanwhile (the router's ping, the cluster's samples) first brings
it up to the time of the read (`advance`): steps begun by then have their pages, steps ended by
then their tokens. The router's routing reads only the last ping and its pending pages, which a
decode node's first token of a request takes off; that token comes from a normal step, since a
run starts only after a step with the same rows. A message for the node cuts the run short after
the step in progress, where it would have been handled between two steps.
"""
from __future__ import annotations

from pdtb.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdtb.sim.cost import StepShape

MAX_STEPS = 4096  # steps planned at once at most
STRETCH = 64  # end times worked out at first (then as many again as known)


def ceil_sum(n: int, ps: int) -> int:
    """sum over x = 1..n of ceil(x / ps) (pages read, summed over a row's steps)."""
    q, r = divmod(n, ps)
    return ps * q * (q + 1) // 2 + r * (q + 1)


def pure_decode(out: SchedulerOutput | None) -> bool:
    """Every chunk of `out` a decode row, no tier move, nobody left unserved."""
    if out is None or out.moves or out.preempted or out.unserved or not out.chunks:
        return False
    for c in out.chunks:
        s = c.seq
        if c.num_new_tokens != 1 or s.num_computed_tokens < s.num_prompt_tokens or s.params.stop_token_ids:
            return False
    return True


def steps_left(seq, max_model_len: int) -> int:
    """Steps until `seq` ends by length (scheduler.append_token's rule, requests run to max_tokens)."""
    n = len(seq.token_ids)
    return min(seq.params.max_tokens - (n - seq.num_prompt_tokens), max_model_len - n)


class Coast:
    """A planned run of `k` decode steps over `rows`, from `t0`. The steps' end times are worked
    out in stretches as the run gets there (`extend`): a run is often cut short by a message."""

    def __init__(self, node, rows: list, k: int, t0: float) -> None:
        self.node, self.rows, self.t0 = node, list(rows), t0
        self.c0 = [s.num_computed_tokens for s in rows]  # each row's context before the run
        self._ctx = sum(c + 1 for c in self.c0)  # StepShape.of: a decode row reads start + 1
        self.ends: list[float] = []  # end time of each step worked out so far
        self.k = k
        self.begun = 0  # steps whose scheduler part ran (pages grown, counted)
        self.ended = 0  # steps whose tokens were appended
        self.told = 0  # steps the policy was told of
        self.gen = 0  # the end event's generation (a run cut short schedules a new one)
        self.extend()

    def extend(self) -> float:
        """Work out the next stretch of end times (each as long again as the ones known, the
        same sums as one event per step); returns the stretch's last, the next wake-up."""
        ends, n, cost = self.ends, len(self.rows), self.node.cost
        i = len(ends)
        upto = min(self.k, max(STRETCH, 2 * i))
        t = ends[-1] if ends else self.t0
        ctx = self._ctx + i * n
        # a cost model's decode_s(rows, ctx), where it has one, is step_s of that shape
        step = getattr(cost, "decode_s", None) or (lambda r, c: cost.step_s(StepShape(r, c)))
        scale = self.node.shape.step_scale  # (as SimNode.kick applies it)
        for _ in range(i, upto):
            t += step(n, ctx) * scale
            ends.append(t)
            ctx += n
        return t

    def start(self, i: int) -> float:
        return self.t0 if i == 0 else self.ends[i - 1]


def plan(node) -> int:
    """Steps a run may take from here (0: step normally). See the module doc."""
    sch, pool = node.scheduler, node.pool
    rows = sch.running
    if sch.waiting or sch.parked or pool.num_shared or len(rows) != len(node.last_out.chunks):
        return 0
    served = {id(c.seq) for c in node.last_out.chunks}
    if any(id(s) not in served for s in rows) or node.policy.waiting_arrivals(sch.state()):
        return 0
    mml = sch.config.max_model_len
    k = min(MAX_STEPS, min(steps_left(s, mml) for s in rows))
    if k < 2:
        return 0
    # step i (0-based) needs pages for num_computed + i + 1 tokens: every row's growth over the
    # run comes from the free pages, so no victim is ever picked
    ps, free = pool.spec.page_size, pool.num_free
    base = [(s.num_computed_tokens, pool.num_held(s.request_id)) for s in rows]

    def need(steps: int) -> int:
        return sum(max(0, -(-(c + steps) // ps) - h) for c, h in base)

    if need(k) > free:
        lo, hi = 0, k  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
        k = lo
    return k if k >= 2 else 0


def begin_run(coast: Coast, upto: int) -> None:
    """Steps coast.begun .. upto-1 begin: each counted, each row given a page when its token
    needs one, step by step in row order (the scheduler's order of allocation)."""
    first = coast.begun
    if upto <= first:
        return
    node = coast.node
    sch, pool = node.scheduler, node.pool
    ps = pool.spec.page_size
    grows = []  # (step, row) of each page to allocate
    for r, (s, c) in enumerate(zip(coast.rows, coast.c0)):
        # step i needs pages for c + i + 1 tokens: the first one past what it holds, then every ps
        i = max(first, pool.num_held(s.request_id) * ps - c)
        grows += [(j, r) for j in range(i, upto, ps)]
    if grows:
        grows.sort()
        rows = coast.rows
        for _, r in grows:
            pool.allocate(rows[r].request_id, 1)
    sch.num_steps += upto - first
    for s in coast.rows:
        s.last_step = sch.num_steps
    coast.begun = upto


def end_run(coast: Coast, upto: int) -> None:
    """Steps coast.ended .. upto-1 end (never the run's last): their tokens, at their times."""
    first = coast.ended
    m = upto - first
    if m <= 0:
        return
    node = coast.node
    times = coast.ends[first:upto]
    ps, pb = node.pool.spec.page_size, node.pool.bytes_per_page
    reads = []
    for s in coast.rows:
        c = s.num_computed_tokens
        reads.append((s, (ceil_sum(c + m, ps) - ceil_sum(c, ps)) * pb))  # KVMeter.on_step's reads, summed
        s.num_computed_tokens = c + m
        s.token_ids.extend([node.token] * m)
        s.timeline.last_token = times[-1]
    node.acct.meter_reads(reads)
    node.cluster.on_tokens(node, [s.request_id for s in coast.rows], times)
    node.num_steps += m
    coast.ended = upto


def advance(coast: Coast, now: float) -> None:
    """Bring the node to `now`: the steps begun by then have begun, those ended by then have
    ended, except the run's last, which its event ends; the policy is told."""
    b, known = coast.begun, len(coast.ends)
    while b < coast.k and b <= known and coast.start(b) <= now:
        b += 1
    begin_run(coast, b)
    e = coast.ended
    while e < coast.k - 1 and e < known and coast.ends[e] <= now:
        e += 1
    end_run(coast, e)
    tell(coast)


def tell(coast: Coast) -> None:
    """The policy hears of the steps begun since it was last told (`on_steps`). Each row's
    sequence is as the last of them began: the earlier steps' tokens appended, not its own."""
    if coast.begun <= coast.told:
        return
    node = coast.node
    starts = [coast.start(i) for i in range(coast.told, coast.begun)]
    node.policy.on_steps(decode_chunks(coast.rows), node.scheduler.snapshot(starts[-1]), starts)
    coast.told = coast.begun


def decode_chunks(rows: list) -> list[ScheduledChunk]:
    return [ScheduledChunk(s, 1) for s in rows]


def cut_short(coast: Coast) -> bool:
    """A message arrived: the run ends with the step in progress (the message is handled after
    it, as between two steps). True if that moved its end."""
    k = max(coast.begun, 1)
    if k == coast.k:
        return False
    coast.k = k
    del coast.ends[k:]
    return True
