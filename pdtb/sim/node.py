"""A simulated node: the real scheduler, page pools (ownership only, no bytes), fairness policy
and node accounting, stepped on the simulator's clock. Only the forward pass is a cost model.

    message arrives -> handled at once if the node is between steps, else queued in `inbox`
    (a real node reads its sockets only between engine steps) -> step: scheduler.schedule()
    at t, cost model says how long (forward pass + tier moves) -> at t + d: tokens appended
    (scheduler.append_token: the engine's rule for ending a request), accounting, the role's
    events -> inbox drained, role's I/O polled -> next step

A step in which nothing may run (a bandwidth cap, a quota's turn) waits `STALL_S` or the next
message, as a real node's loop does. Runs of identical decode steps are taken at once
(pdtb/sim/coast.py) unless the cluster steps one at a time (`ClusterShape.coast`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from fairness import make_policy
from fairness.config import FairnessConfig
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, append_token
from pdtb.nodes.accounting import NodeAccounting
from pdtb.nodes.node_metrics import NodeMetrics
from pdtb.sim import coast as runs
from pdtb.sim.cost import CostModel, StepShape

STALL_S = 0.01  # a real node's idle wait (node_base._wait_wake)
TOKEN = 7  # the token every simulated step samples (requests run with ignore_eos to max_tokens)
VOCAB = 1 << 20  # prompt ids are placeholders: any id is in the vocabulary
PREFIX_NS = "sim"  # the simulated nodes' page-hash namespace (one model: every node's the same)


@dataclass(frozen=True)
class NodeShape:
    """One node's configuration, as its command line would give it."""

    role: str  # "prefill" | "decode" | "colocated"
    num_pages: int  # device-tier pages
    host_pages: int = 0  # host-tier pages (decode and colocated)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    policy: str = "fcfs"  # a name or module:Class / file.py:Class (fairness/registry.py)
    policy_args: tuple = ()  # its own settings, (key, value) pairs
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    hold_timeout_s: float = 120.0  # prefill: how long a deferred hand-off keeps retrying
    step_scale: float = 1.0  # each step's time times this: a host's speed during one real run (--step-scale)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"node role must be prefill, decode or colocated, not {self.role!r}")
        if self.num_pages < 1 or self.host_pages < 0:
            raise ValueError("a node needs at least one device page (and no negative host pages)")
        if not self.step_scale > 0:
            raise ValueError(f"a node's step scale must be positive, got {self.step_scale!r}")


class SimNode:
    """What every simulated role shares; `on_step_events` and `poll_io` are the role's."""

    def __init__(self, node_id: str, shape: NodeShape, spec: KVSpec, cost: CostModel, loop, cluster) -> None:
        self.node_id, self.shape, self.cost, self.loop, self.cluster = node_id, shape, cost, loop, cluster
        self.config = SimpleNamespace(fairness=shape.fairness, role=shape.role, node_id=node_id)
        self.pool = PagePool(spec, shape.num_pages, storage=False)
        self.host_pool = PagePool(spec, shape.host_pages, tier="host", storage=False) if shape.host_pages else None
        self.policy = self.make_policy(shape)
        self.scheduler = Scheduler(SchedulerConfig(shape.max_num_seqs, shape.max_num_batched_tokens,
                                                   shape.max_model_len), self.pool, policy=self.policy,
                                   host_pool=self.host_pool, clock=loop)
        self.scheduler.step_cost = cost  # policies price a step by the model this run's steps take
        self.engine = self  # NodeAccounting and the nodes' validation read engine.pool, .scheduler, .info
        self.info = SimpleNamespace(vocab_size=VOCAB)
        self.metrics = NodeMetrics(shape.role, node_id)
        self.acct = NodeAccounting(self)
        self.seqs: dict = {}  # live requests on this node, by id
        self.inbox: deque = deque()
        self.busy = False
        self._timer = False  # a stall or retry wake-up is armed
        self.num_steps = 0
        self.busy_s = 0.0  # simulated seconds spent in steps
        self.token = TOKEN
        self.last_out = None  # the last step's scheduler output (None: it ran nothing)
        self.coast = None  # the run of decode steps in progress (pdtb/sim/coast.py)
        self.coasts = self.coasted = 0  # runs taken, and the steps in them
        self.dead = False  # its process is gone (pdtb/sim/faults.py): it steps no more, hears nothing
        if cluster.shape.prefix_cache and shape.role != "decode":  # (the decode side's cache is not simulated)
            self.scheduler.prefix_ns = PREFIX_NS
        # runs of decode steps only for a policy told of them (`on_steps`), and not with a prefix
        # cache (a decode step that fills a page registers it)
        self.may_coast = cluster.shape.coast and callable(getattr(self.policy, "on_steps", None)) and \
            self.scheduler.prefix_ns is None

    def make_policy(self, shape: NodeShape):
        return make_policy(shape.policy, shape.fairness, shape.policy_args)

    def add(self, seq) -> None:
        """Queue a new request (the engine's `add`: what accept_request calls)."""
        self.scheduler.add(seq)

    # ---- messages ------------------------------------------------------------------------------
    def deliver(self, fn, *args) -> None:
        """A message for this node: handled now if it is between steps, else after the step."""
        if self.dead:
            return  # (a message to a dead process is lost)
        if self.busy:
            if self.coast is not None:
                self._cut_short()
            self.inbox.append((fn, args))
            return
        fn(*args)
        self.poll_io()
        self.kick()

    def wake_at(self, t: float) -> None:
        """Step (or poll) again at `t` at the latest: a stalled step, a hand-off's retry time."""
        if not self._timer:
            self._timer = True
            self.loop.at(t, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = False
        if not self.busy and not self.dead:
            self.poll_io()
            self.kick()

    # ---- steps ---------------------------------------------------------------------------------
    def kick(self) -> None:
        if self.busy or self.dead or not self.scheduler.has_work():
            return
        if self.may_coast and runs.pure_decode(self.last_out):
            k = runs.plan(self)
            if k:
                return self._start_coast(k)
        out = self.scheduler.schedule()
        if not (out.chunks or out.moves or out.preempted):  # nothing may run now: wait, as a node does
            self.last_out = None
            self.wake_at(self.loop.now + STALL_S)
            return
        d = self.cost.step_s(StepShape.of(out.chunks)) * self.shape.step_scale + \
            sum(self.cost.tier_move_s(m.num_bytes) for m in out.moves)
        self.busy = True
        self.loop.after(d, self._end_step, out, self.loop.now)

    # ---- runs of decode steps (pdtb/sim/coast.py) -------------------------------------------------
    def _start_coast(self, k: int) -> None:
        c = self.coast = runs.Coast(self, self.scheduler.running, k, self.loop.now)
        runs.begin_run(c, 1)
        self.busy = True
        self.coasts += 1
        self.loop.at(c.ends[-1], self._coast_wake, c, c.gen)

    def sync(self) -> None:
        """Bring a run in progress up to now (something is about to read this node)."""
        if self.coast is not None:
            runs.advance(self.coast, self.loop.now)

    def _cut_short(self) -> None:
        c = self.coast
        runs.advance(c, self.loop.now)
        if runs.cut_short(c):
            c.gen += 1
            self.loop.at(c.ends[-1], self._coast_wake, c, c.gen)

    def _coast_wake(self, c, gen: int) -> None:
        """The last end time worked out: the run's end, or time to work out more of them."""
        if c is not self.coast or gen != c.gen:
            return  # the run was cut short (its end moved), or the node died
        if len(c.ends) < c.k:
            self.loop.at(c.extend(), self._coast_wake, c, gen)
            return
        runs.advance(c, self.loop.now)
        self.coast = None
        self.coasted += c.k
        t0 = c.start(c.k - 1)
        self.busy_s += t0 - c.t0
        self._end_step(SchedulerOutput(chunks=runs.decode_chunks(c.rows)), t0)

    def die(self) -> None:
        """kill -9: the step in progress never ends, nothing queued is handled."""
        self.dead, self.coast = True, None
        self.inbox.clear()

    def _end_step(self, out, t0: float) -> None:
        if self.dead:
            return
        now = self.loop.now
        self.last_out = out
        self.num_steps += 1
        self.busy_s += now - t0
        sampling = [c.seq for c in out.chunks if c.wants_logits]
        register = self.scheduler.register_computed if self.scheduler.prefix_ns is not None else None
        for c in out.chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            if register:
                register(c.seq)
        events = [append_token(self.scheduler, s, TOKEN, ()) for s in sampling]
        self.acct.on_output(out, now)
        self.cluster.observe_step(self, out, t0, now)
        self.on_step_events(out, events, t0)
        self.busy = False
        while self.inbox and not self.busy:
            fn, args = self.inbox.popleft()
            fn(*args)
        self.poll_io()
        self.kick()

    # ---- the role's ----------------------------------------------------------------------------
    def on_step_events(self, out, events, t0: float) -> None:
        raise NotImplementedError

    def poll_io(self) -> None:
        """Between steps: the role's transfers (prefill: hand-offs due)."""

    # ---- endings -------------------------------------------------------------------------------
    def emit(self, seq, finished: bool) -> None:
        """One token of `seq` leaves this node now (its last, with the timing, when finished)."""
        timing = self.acct.final_timing(seq) if finished else None
        self.cluster.on_token(self, seq.request_id, finished, timing)
        if finished:
            self._forget(seq.request_id)

    def fail(self, request_id: str, reason: str, retry: bool = False) -> None:
        """End a request with an error event; `retry`: no fault of the request's (the router
        recomputes it elsewhere)."""
        self.cluster.on_failed(request_id, reason, retry)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.acct.forget(request_id)
        self.policy.forget(request_id)
