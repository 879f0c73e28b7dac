"""Continuous-batching scheduler with a per-step token budget and chunked prefill.

Queues:  waiting (deque, FIFO; preempted requests go back to its front) -> running (list).

Each step: (1) running requests in order get their next chunk (one token when decoding, up to
the remaining budget while prefilling); if pages run out, the newest unscheduled running
request is preempted by recompute (pages freed, back to waiting). (2) waiting requests are
admitted in order while budget, pages and `max_num_seqs` allow. The scheduler asks the pool
for pages; it never touches KV bytes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from model_engine.page_pool import PagePool
from model_engine.sequence import Sequence, SeqStatus


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

    @property
    def wants_logits(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # what runs this step
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting
    num_batched_tokens: int = 0  # sum of num_new_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {seq.request_id}: {seq.num_tokens} tokens exceed max_model_len "
                             f"{self.config.max_model_len}")
        peak = min(seq.num_tokens + seq.params.max_tokens, self.config.max_model_len)
        if self.pool.spec.pages_for(peak) > self.pool.num_pages:
            raise ValueError(f"request {seq.request_id}: needs up to {self.pool.spec.pages_for(peak)} pages, "
                             f"the pool has {self.pool.num_pages}")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a request whose pages are already in the pool (inherited from prefill)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling `seq` but keep its pages (prefill hands them to a decode node)."""
        self.running.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n, scheduled, out):
                continue  # seq itself was preempted; running shrank, same index is the next one
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(seq.request_id)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            need = self.pool.spec.pages_for(seq.num_computed_tokens + n) - len(self.pool.pages_of(seq.request_id))
            if self.pool.allocate(seq.request_id, need) is None:
                break  # FIFO: the head waits for pages; nothing overtakes it
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(seq.request_id)
            budget -= n
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _grow(self, seq: Sequence, num_tokens: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Make `seq` hold pages for `num_tokens`, preempting newer unscheduled requests."""
        need = self.pool.spec.pages_for(num_tokens) - len(self.pool.pages_of(seq.request_id))
        while need > self.pool.num_free:
            victim = next((s for s in reversed(self.running) if s.request_id not in scheduled), None)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            self.pool.allocate(seq.request_id, need)
        return True

    # ---- transitions ------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s pages and queue it for recompute at the front of waiting."""
        self.pool.free(seq.request_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SeqStatus, reason: str) -> None:
        """End `seq` (any queue) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.request_id)
        seq.status = status
        seq.finish_reason = reason

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, SeqStatus.FINISHED_ABORTED, reason)
                return seq
        return None
