"""One engine step as a project policy sees it, engine-agnostic: the policy's questions in the
interface's order (fairness/interface.py), every answer checked by `pdtb.policies.guard`, and a
policy that raises costing only its step (the engine's own order), counted and logged once.

Per step, the engine adapter (pdtb/integrations/vllm.py) calls:

    begin(running, waiting, state)   reclaim -> step_order -> pick_victim (as many as the
                                     step's foreseen page shortfall needs) -> chunk_limit per
                                     running prompt: the running order to hand the engine, the
                                     victims at its tail, the rows sitting the step out, and
                                     the step's bound on a prompt chunk
    admission(...)                   admission_order -> may_admit per candidate that fits,
                                     asked lazily as the engine's admission scan reaches it
    end(chunks, state)               on_step
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence
from pdtb.policies.guard import Guarded, PolicyRaised

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """What the policy decided of the running requests at a step's start."""

    order: list[Sequence]  # running requests in stepping order; the engine evicts from the tail
    reclaimed: list[Sequence] = field(default_factory=list)  # to evict before the step (reclaim)
    sitting: list[Sequence] = field(default_factory=list)  # running, left out of the step by the policy
    chunk_cap: int | None = None  # the longest prompt chunk the policy gives a running prompt (None: none runs)
    caps: dict[str, int] = field(default_factory=dict)  # running prompt's request id -> its chunk's tokens at most


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def first_chunk_pages(seq: Sequence, state: SchedState) -> int:
    """Device pages `seq` needs for its next chunk (one token decoding, else as much of its
    uncomputed tokens as the step's budget carries), beyond those it holds."""
    n = 1 if seq.num_uncomputed_tokens == 1 else min(seq.num_uncomputed_tokens, state.token_budget)
    return max(0, pages_for(seq.num_computed_tokens + n, state.page_size) - state.pages.get(seq.request_id, 0))


def shortfall(order: list[Sequence], state: SchedState) -> tuple[int, Sequence | None]:
    """(pages the rows' next chunks lack beyond the free ones, the first row that lacks one),
    the rows served in `order` until the step's token budget is spent."""
    budget, need, first = state.token_budget, 0, None
    for s in order:
        if budget <= 0:
            break
        pages = first_chunk_pages(s, state)
        budget -= 1 if s.num_uncomputed_tokens == 1 else min(s.num_uncomputed_tokens, budget)
        if pages and first is None and need + pages > state.device_free:
            first = s
        need += pages
    return need - state.device_free, first


class FairStep:
    """A policy driven one engine step at a time; `errors` counts the steps' raised calls."""

    def __init__(self, policy, logger: logging.Logger = log, metrics=None) -> None:
        self.metrics = metrics  # a PolicyMetrics (pdtb/integrations/policy_metrics.py), or None
        self._bad_seen = 0  # illegal answers already counted in `metrics`
        self.inner = policy  # the policy itself, asked only through `policy`
        self.violations: list[str] = []  # illegal answers, replaced by the default (guard.py)
        self.policy = Guarded(policy, deque(maxlen=0), self.violations)  # (no trace is kept)
        self.errors = 0  # calls of the policy that raised; each cost its step the policy's order
        self.last_error = ""
        self.log = logger
        self.views: dict[str, Sequence] = {}  # request id -> the policy's view of it
        self.steps = 0  # steps begun (SchedState.step)

    def failed(self, e: PolicyRaised) -> None:
        """Count a raised call; the first is logged with its traceback, the rest only counted."""
        self.errors += 1
        self.last_error = str(e)
        if self.metrics is not None:
            self.metrics.raised()
        if self.errors == 1:
            self.log.error("policy %s: %s; this step falls back to the engine's own order (further "
                           "errors are counted, not logged: FairScheduler.policy_errors)", self.policy.name, e,
                           exc_info=e.__cause__)

    def forget_missing(self, live: set[str] | dict) -> None:
        """Forget the views of requests the engine no longer has (ended or aborted)."""
        for rid in [r for r in self.views if r not in live]:
            del self.views[rid]
            try:
                self.policy.forget(rid)
            except PolicyRaised as e:
                self.failed(e)

    def begin(self, running: list[Sequence], waiting: list[Sequence], state: SchedState) -> StepPlan | None:
        """Reclaim, step order and the victims for the foreseen shortfall; None: the policy
        raised, the step keeps the engine's order."""
        self.steps += 1
        try:
            reclaimed = self.policy.reclaim(running, waiting, state)
            gone = {s.request_id for s in reclaimed}
            rows = [s for s in running if s.request_id not in gone]
            stepping = self.policy.step_order(list(rows), state)
            chosen = {id(s) for s in stepping}
            sitting = [s for s in rows if id(s) not in chosen]  # they keep their pages, and may be victims
            victims, waits = self._victims(stepping + sitting, state)
            out = {id(v) for v in victims} | {id(w) for w in waits}
            order = [s for s in stepping if id(s) not in out] + victims[::-1]
            caps: dict[str, int] = {}
            cap = self._chunk_cap(order, state, caps)
        except PolicyRaised as e:
            self.failed(e)
            return None
        return StepPlan(order, reclaimed, [s for s in sitting if id(s) not in out] + waits, cap, caps)

    def _chunk_cap(self, order: list[Sequence], state: SchedState, caps: dict[str, int]) -> int | None:
        """The step's prefill split: `chunk_limit` asked of each running prompt in step order,
        with what the rows before it leave of the budget, each answer into `caps` (for an engine
        that bounds each request's chunk) and the largest returned (for one that bounds every
        chunk of the step alike: a whale's part caps its chunk, the small prompts' are under it)."""
        budget, cap = state.token_budget, None
        for s in order:
            if budget <= 0:
                break
            left = s.num_uncomputed_tokens
            if left <= 1:
                budget -= 1
                continue
            n = min(left, budget, self.policy.chunk_limit(s, budget, state))
            caps[s.request_id] = n
            cap = n if cap is None else max(cap, n)
            budget -= n
        return cap

    def _victims(self, order: list[Sequence], state: SchedState) -> tuple[list[Sequence], list[Sequence]]:
        """(the rows the policy gives up, first first; the prompts whose chunk waits this step,
        keeping their pages), until the shortfall foreseen at the step's start is met: asked as
        the first row that lacks pages would ask, among every row still in the step. A `None`
        answer (the requester's chunk waits) takes the requester out of the step, so that the
        engine does not take a victim for it; the next row that lacks pages asks in turn."""
        victims: list[Sequence] = []
        waits: list[Sequence] = []
        rows, freed = list(order), 0
        while len(rows) > 1:
            lack, requester = shortfall(rows, with_free(state, state.device_free + freed))
            if lack <= 0 or requester is None:
                break
            v = self.policy.pick_victim(rows, requester, state)
            if v is None:
                waits.append(requester)
                rows.remove(requester)
                continue
            victims.append(v)
            rows.remove(v)
            freed += state.pages.get(v.request_id, 0)
        return victims, waits

    def admission(self, view_of: Callable, live_state: Callable[[], SchedState],
                  idle: Callable[[], bool], excluded: set[str], seat: Callable[[], bool] = lambda: True) -> "Admission":
        return Admission(self, view_of, live_state, idle, excluded, seat)

    def end(self, chunks: list, state: SchedState) -> None:
        """Tell the policy what the step served (a list of pdtb.engine.scheduler.ScheduledChunk);
        count the step's illegal answers."""
        try:
            self.policy.on_step(chunks, state)
        except PolicyRaised as e:
            self.failed(e)
        bad = self.policy.bad_answers
        if self.metrics is not None and bad > self._bad_seen:
            self.metrics.violated(bad - self._bad_seen)
        self._bad_seen = bad


_UNSET = object()


class Admission:
    """One step's admission scan over an engine's waiting queue: its head is the first request
    in the policy's order that fits the free pages and that the policy admits (or any that fits
    while nothing runs: a quota delays a request, never strands it). A strict-order policy's
    scan stops at the first that does not; another's passes over it. Each candidate is asked
    once a step, when the scan reaches it, with the pages free at that moment."""

    def __init__(self, step: FairStep, view_of: Callable, live_state: Callable[[], SchedState],
                 idle: Callable[[], bool], excluded: set[str], seat: Callable[[], bool] = lambda: True) -> None:
        self.step, self.view_of, self.live_state, self.idle = step, view_of, live_state, idle
        self.seat = seat  # False: every slot is taken, the rows sitting this step out included
        self.excluded = excluded  # request ids evicted at this step's start: not back in it
        self.order: list | None = None  # the queue's requests in the policy's order
        self.cursor = 0
        self.gone: set[int] = set()  # id() of requests the engine took off the queue this step
        self.fallback = False  # the policy raised: the engine's own order for the rest of the step
        self._head = _UNSET

    def head(self, items) -> object | None:
        """The request the engine's scan should take next from `items` (the queue, in its own
        order), or None: nothing more is admitted this step."""
        if self._head is _UNSET:
            self._head = self._find(items) if self.seat() else None
        return self._head

    def _find(self, items) -> object | None:
        if not self.fallback:
            if self.order is None:
                self.order = self._ordered(items)
            found = None if self.fallback else self._next()
            if not self.fallback:
                return found
        return next(iter(items), None)

    def popped(self, item) -> None:
        """The engine took `item` (the head) off the queue: admitted, or set aside this step."""
        self.gone.add(id(item))
        self._head = _UNSET

    def _ordered(self, items) -> list:
        pairs = [(self.view_of(r), r) for r in items if r.request_id not in self.excluded]
        by_view = {id(v): r for v, r in pairs}
        try:
            views = self.step.policy.admission_order([v for v, _ in pairs], self.live_state())
        except PolicyRaised as e:
            self.step.failed(e)
            self.fallback = True
            return []
        return [by_view[id(v)] for v in views]

    def _next(self) -> object | None:
        strict = self.step.policy.strict_order
        while self.cursor < len(self.order):
            item = self.order[self.cursor]
            if id(item) in self.gone:
                self.cursor += 1
                continue
            try:
                ok = self._admits(self.view_of(item))
            except PolicyRaised as e:
                self.step.failed(e)
                self.fallback = True
                return None
            if ok:
                return item
            if strict:
                return None  # nothing overtakes the head
            self.cursor += 1
        return None

    def _admits(self, seq: Sequence) -> bool:
        state = self.live_state()
        need = first_chunk_pages(seq, state)
        if need > state.device_free:
            return False
        if self.step.policy.may_admit(seq, need, state):
            self.step.policy.admitted(seq, need, state)
            return True
        return self.idle()


def with_free(state: SchedState, device_free: int) -> SchedState:
    """`state` with `device_free` free pages (an admission scan's later candidates see fewer)."""
    return state if state.device_free == device_free else replace(state, device_free=device_free)
