"""Continuous-batching scheduler over two KV tiers, with a per-step token budget and chunked
prefill. Every choice of order is asked of a `SchedPolicy` (pdtb/engine/sched_policy.py).

Queues:
    waiting (new and preempted requests; need prefill or recompute)
    running (device-tier pages; scheduled for prefill chunks or decode steps)
    parked  (pages in the host tier; must be promoted before they can step)

Each step: (1) running requests, in the policy's step order, get their next chunk (one token
when decoding, up to the remaining budget while prefilling); when device pages run out the
policy picks a victim among not-yet-scheduled running requests, which is demoted to the host
tier if it has room, else preempted by recompute. (2) parked and waiting requests are admitted
in the policy's admission order while budget, pages, `max_num_seqs` and the policy's quota
check allow. The scheduler asks the pools for pages and copies them between tiers; it never
decides order itself.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdtb.engine.page_pool import PagePool
from pdtb.engine.prefix_hash import page_hashes
from pdtb.engine.sched_policy import FifoPolicy, SchedPolicy, SchedState
from pdtb.engine.sequence import Sequence, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens per step (prefill chunks + decode tokens)
    max_model_len: int = 4096  # prompt + output tokens at most

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive")


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    # this chunk ends at the sequence's last token, so it samples one (fixed when scheduled:
    # it stays true of this step after the engine has advanced the sequence)
    wants_logits: bool = field(init=False)

    def __post_init__(self) -> None:
        self.wants_logits = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class PrefixCounters:
    """Prompt tokens looked up in the prefix cache at each request's first prefill, and those
    served from it (not computed), in total and per tenant."""

    query_tokens: int = 0
    hit_tokens: int = 0
    recompute_hit_tokens: int = 0  # tokens a recompute after preemption found cached
    query_by_tenant: dict = field(default_factory=dict)
    hit_by_tenant: dict = field(default_factory=dict)

    def count(self, tenant: str, query: int, hit: int) -> None:
        self.query_tokens += query
        self.hit_tokens += hit
        self.query_by_tenant[tenant] = self.query_by_tenant.get(tenant, 0) + query
        self.hit_by_tenant[tenant] = self.hit_by_tenant.get(tenant, 0) + hit


@dataclass
class TierMove:
    request_id: str
    kind: str  # "demote" | "promote" | "preempt"
    num_pages: int
    num_bytes: int  # bytes copied between tiers (0 for preempt)
    seconds: float  # copy time


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # what runs this step
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting (recompute)
    moves: list[TierMove] = field(default_factory=list)  # demotions, promotions, preemptions
    unserved: list[Sequence] = field(default_factory=list)  # running (resident) but not served this step
    num_batched_tokens: int = 0  # sum of num_new_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool, policy: SchedPolicy | None = None,
                 host_pool: PagePool | None = None, clock=time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.host_pool = host_pool
        self.policy = policy or FifoPolicy()
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: list[Sequence] = []
        self.num_steps = 0
        self.prefill_only = False  # a prefill node's engine: requests leave after their prompt
        self._in_step = False  # inside schedule(): state() snapshots are reused
        self._state_key: tuple | None = None  # pool versions of the cached snapshot
        self._state: SchedState | None = None
        self._now = 0.0
        # the price of a step (step_s(StepShape) -> seconds, and `ready`): the engine's own fit
        # (step_cost.py), the simulator's cost model; policies see it as SchedState.step_s
        self.step_cost = None
        self.prefix_ns: str | None = None  # prefix cache namespace (prefix_hash.py); None: off
        self.prefix = PrefixCounters()

    # ---- queues --------------------------------------------------------------------------------
    def peak_pages(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Device pages a request holds at its longest (prompt + max_tokens, capped at the context;
        on a prefill-only engine just the prompt: its first token is sampled, not computed, and
        the decode side computes the rest)."""
        grows = 0 if self.prefill_only else max_tokens
        return self.pool.spec.pages_for(min(num_prompt_tokens + grows, self.config.max_model_len))

    def check_fits(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {seq.request_id}: {seq.num_tokens} tokens exceed max_model_len "
                             f"{self.config.max_model_len}")
        peak = self.peak_pages(seq.num_tokens, seq.params.max_tokens)
        if peak > self.pool.num_pages:
            raise ValueError(f"request {seq.request_id}: needs up to {peak} pages, the pool has {self.pool.num_pages}")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a request whose pages are already in the device pool (inherited from prefill)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def add_parked(self, seq: Sequence) -> None:
        """Adopt a request whose pages are already in the host pool."""
        seq.status = SeqStatus.PARKED
        self.parked.append(seq)

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling `seq` but keep its pages (prefill hands them to a decode node)."""
        self.running.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def queued_tokens(self) -> int:
        """Prompt tokens yet to prefill (what the router balances prefill nodes on)."""
        return sum(s.num_uncomputed_tokens for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if s.in_prefill)

    def all_requests(self) -> list[Sequence]:
        return [*self.running, *self.parked, *self.waiting]

    def state(self) -> SchedState:
        """Snapshot for policies. During `schedule()` it is rebuilt only after the pools change
        (policies ask for it several times per step) and `now` is the step's start."""
        hp = self.host_pool
        key = (self.pool.version, hp.version if hp else 0)
        if self._state is None or self._state_key != key or not self._in_step:
            self._state_key = key
            self._state = SchedState(self._now if self._in_step else self.clock(), self.num_steps,
                                     self.pool.spec.page_size, self.pool.bytes_per_page,
                                     self.pool.num_pages, self.pool.num_free,
                                     hp.num_pages if hp else 0, hp.num_free if hp else 0,
                                     self.pool.held_counts(), hp.held_counts() if hp else {},
                                     self.config.max_num_batched_tokens,
                                     *((self.pool.charged_counts(), self.pool.exclusive_counts())
                                       if self.pool.num_shared else (None, None)),
                                     cached_pages=self._cached_pages if self.prefix_ns is not None else None,
                                     step_s=self.step_cost.step_s if self.step_cost is not None
                                     and getattr(self.step_cost, "ready", True) else None)
        return self._state

    def snapshot(self, now: float) -> SchedState:
        """The state as a step beginning at `now` sees it (the simulator tells a policy of a run
        of decode steps with the state the last of them began with)."""
        self._now, self._in_step, self._state = now, True, None
        try:
            return self.state()
        finally:
            self._in_step, self._state = False, None

    # ---- step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self._now, self._in_step, self._state = self.clock(), True, None
        try:
            return self._schedule()
        finally:
            self._in_step, self._state = False, None

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        for victim in self.policy.reclaim(self.running, [*self.parked, *self.waiting], self.state()):
            if victim.status == SeqStatus.RUNNING:
                self.evict(victim, out)  # pages lent to an over-quota tenant go back to their owner
        order = self.policy.step_order(list(self.running), self.state())
        pool, ps = self.pool, self.pool.spec.page_size
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # evicted earlier in this loop
            # a decoding row feeds one token (budget > 0 here): no need to ask for its chunk
            n = 1 if len(seq.token_ids) - seq.num_computed_tokens == 1 else self._chunk(seq, budget)
            end = seq.num_computed_tokens + n
            # most steps a row's pages already hold its next token: growing is only for the rest
            if -(-end // ps) > pool.num_held(seq.request_id) and not self._grow(seq, end, scheduled, out):
                continue
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(seq.request_id)
            budget -= n
        budget = self._admit(budget, scheduled, out)
        for c in out.chunks:
            c.seq.last_step = self.num_steps
        out.unserved = [s for s in self.running if s.request_id not in scheduled]
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        self.policy.on_step(out.chunks, self.state())
        return out

    def _admit(self, budget: int, scheduled: set[str], out: SchedulerOutput) -> int:
        state = self.state()
        # A request evicted in this step does not come back in it: the policy evicted it to
        # make room for someone else (promoting it again would undo that and copy it twice).
        evicted = {m.request_id for m in out.moves}
        candidates = self.policy.admission_order([s for s in (*self.parked, *self.waiting)
                                                  if s.request_id not in evicted], state)
        for seq in candidates:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            parked = seq.status == SeqStatus.PARKED
            hit = [] if parked else self._prefix_match(seq)
            if hit:
                seq.num_computed_tokens = len(hit) * self.pool.spec.page_size
            n = self._chunk(seq, budget)
            need = self.pool.spec.pages_for(seq.num_computed_tokens + n)
            if not parked:
                need -= self.pool.num_held(seq.request_id) + len(hit)
            # Work conservation: with nothing running, the first candidate that fits runs
            # whatever the quotas say, so a quota can delay a request but never strand it.
            idle = not self.running
            yes, st = False, None
            if need + self.pool.num_revived(hit) <= self.pool.num_free:
                st = self.state()
                yes = self.policy.may_admit(seq, need, st)
                if yes and hasattr(self.policy, "admitted"):  # (optional: BasePolicy has it)
                    self.policy.admitted(seq, need, st)
            if st is None or not (yes or idle):
                if hit:
                    seq.num_computed_tokens = 0
                if self.policy.strict_order:
                    break  # the head waits; nothing overtakes it
                continue
            if not parked and self.prefix_ns is not None:
                self._count_prefix(seq, len(hit))
            if hit:
                self.pool.share(seq.request_id, hit)
                seq.num_registered = len(hit)
            if parked:
                self._promote(seq, out)
                grow = need - len(self.pool.pages_of(seq.request_id))
                if grow > 0:
                    self.pool.allocate(seq.request_id, grow)
            else:
                self.waiting.remove(seq)
                self.pool.allocate(seq.request_id, need)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(seq.request_id)
            budget -= n
        return budget

    # ---- prefix cache --------------------------------------------------------------------------
    def hashes_of(self, seq: Sequence, full_pages: int) -> list[int]:
        """Hashes of `seq`'s first `full_pages` pages (kept on the sequence, extended as it grows)."""
        have = seq.page_hashes
        if len(have) < full_pages:
            ps = self.pool.spec.page_size
            seq.page_hashes = have = page_hashes(seq.token_ids[:full_pages * ps], ps, self.prefix_ns,
                                                 start_page=len(have), parents=have)
        return have[:full_pages]

    def _prefix_match(self, seq: Sequence) -> list[int]:
        """Cached pages a waiting request can start from: its leading full pages found in the
        pool, leaving at least its last token to compute (that step samples its next token,
        and the page that token's K/V goes into is its own, never a shared one)."""
        if self.prefix_ns is None or seq.num_computed_tokens or self.pool.num_held(seq.request_id):
            return []
        usable = (seq.num_tokens - 1) // self.pool.spec.page_size
        if usable <= 0:
            return []
        return self.pool.match(self.hashes_of(seq, usable))

    def _cached_pages(self, seq: Sequence) -> int:
        """SchedState.cached_pages: the pages `_prefix_match` would share with `seq` now."""
        return len(self._prefix_match(seq))

    def _count_prefix(self, seq: Sequence, hit_pages: int) -> None:
        tokens = min(hit_pages * self.pool.spec.page_size, seq.num_prompt_tokens)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = tokens
            self.prefix.count(seq.tenant, seq.num_prompt_tokens, tokens)
        else:
            self.prefix.recompute_hit_tokens += hit_pages * self.pool.spec.page_size

    def register_computed(self, seq: Sequence) -> None:
        """Register `seq`'s full pages whose tokens are all computed (others may share them)."""
        if self.prefix_ns is None:
            return
        full = seq.num_computed_tokens // self.pool.spec.page_size
        if full <= seq.num_registered:
            return  # most steps: no page filled up
        full = min(full, self.pool.num_held(seq.request_id))
        if full > seq.num_registered:
            hashes = self.hashes_of(seq, full)
            self.pool.register(seq.request_id, seq.num_registered, hashes[seq.num_registered:])
            seq.num_registered = full

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens `seq` feeds this step: one when decoding; a prefill chunk (a prompt's first or
        a later one) as far as the budget and the policy's chunk limit allow."""
        n = min(seq.num_uncomputed_tokens, budget)
        if n > 1:
            n = max(1, min(n, self.policy.chunk_limit(seq, budget, self.state())))
        return n

    def _grow(self, seq: Sequence, num_tokens: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Make `seq` hold pages for `num_tokens`, evicting unscheduled running requests."""
        need = self.pool.spec.pages_for(num_tokens) - self.pool.num_held(seq.request_id)
        while need > self.pool.num_free:
            candidates = [s for s in self.running if s.request_id not in scheduled]
            if candidates == [seq]:
                # Nobody else to take pages from: what it lacks is held outside the running set
                # (pages reserved for transfers landing, prompts waiting for their hand-off),
                # which is released without this scheduler. It waits for them and keeps its own:
                # dropping them for a recompute made two such prompts of a prefill node take
                # turns redoing each other's prefill for as long as a hand-off waited.
                return False
            victim = self.policy.pick_victim(candidates, seq, self.state())
            if victim is None:  # (only for a prompt's chunk) it waits for pages, keeping its own
                return False
            self.evict(victim, out)
            if victim is seq:
                return False
        if need > 0:
            self.pool.allocate(seq.request_id, need)
        return True

    # ---- tier moves ----------------------------------------------------------------------------
    def evict(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take `seq`'s device pages: demote to the host tier if it fits, else preempt."""
        n = len(self.pool.pages_of(seq.request_id))
        hp = self.host_pool
        if hp is not None and 0 < n <= hp.num_free and seq.num_computed_tokens > 0:
            t0 = time.perf_counter()
            dst = hp.allocate(seq.request_id, n)
            nbytes = self.pool.copy_pages_to(self.pool.pages_of(seq.request_id), hp, dst)
            self.pool.free(seq.request_id)
            seq.num_registered = 0
            self.running.remove(seq)
            seq.status = SeqStatus.PARKED
            self.parked.append(seq)
            out.moves.append(TierMove(seq.request_id, "demote", n, nbytes, time.perf_counter() - t0))
        else:
            self.preempt(seq)
            out.preempted.append(seq)
            out.moves.append(TierMove(seq.request_id, "preempt", n, 0, 0.0))

    def _promote(self, seq: Sequence, out: SchedulerOutput) -> None:
        hp = self.host_pool
        src = hp.pages_of(seq.request_id)
        t0 = time.perf_counter()
        dst = self.pool.allocate(seq.request_id, len(src))
        nbytes = hp.copy_pages_to(src, self.pool, dst)
        hp.free(seq.request_id)
        self.parked.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.moves.append(TierMove(seq.request_id, "promote", len(src), nbytes, time.perf_counter() - t0))

    def preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s pages and queue it for recompute at the front of waiting."""
        self.pool.free(seq.request_id)
        seq.num_registered = 0
        if seq in self.running:
            self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # ---- endings -------------------------------------------------------------------------------
    def finish(self, seq: Sequence, status: SeqStatus, reason: str) -> None:
        """End `seq` (any queue) and free its pages on both tiers."""
        for q in (self.running, self.parked, self.waiting):
            if seq in q:
                q.remove(seq)
                break
        self.pool.free(seq.request_id)
        if self.host_pool is not None:
            self.host_pool.free(seq.request_id)
        seq.status = status
        seq.finish_reason = reason

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        for seq in self.all_requests():
            if seq.request_id == request_id:
                self.finish(seq, SeqStatus.FINISHED_ABORTED, reason)
                return seq
        return None


@dataclass
class StepEvent:
    """One sampled token (and whether it ended its request)."""

    seq: Sequence
    token_id: int
    finished: bool


def append_token(scheduler: Scheduler, seq: Sequence, token: int, eos_token_ids) -> StepEvent:
    """Give `seq` its sampled `token`; end it (pages freed) on EOS, a stop id, max_tokens or the
    context limit. The engine and the simulator (pdtb/sim) end requests by this one rule."""
    ids = seq.token_ids
    ids.append(token)
    p = seq.params
    if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
        scheduler.finish(seq, SeqStatus.FINISHED_STOPPED, "stop")
        return StepEvent(seq, token, True)
    n = len(ids)  # (counted once: this runs for every token of every request)
    if n - seq.num_prompt_tokens >= p.max_tokens or n >= scheduler.config.max_model_len:
        scheduler.finish(seq, SeqStatus.FINISHED_LENGTH, "length")
        return StepEvent(seq, token, True)
    return StepEvent(seq, token, False)
