"""Every name of vLLM's internals that `pdtb.integrations.vllm` touches, in this one file, and
the vLLM versions it was read on (CHECKED_VERSIONS); the fair scheduler refuses any other at
start-up. Read against vllm/v1/core/sched/{scheduler,request_queue}.py and vllm/v1/request.py."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import vllm
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler

from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from pdtb.integrations.policy_env import check_version, request_labels

CHECKED_VERSIONS = ("0.32.0",)

__all__ = ["Scheduler", "PolicyQueue", "CHECKED_VERSIONS", "check_vllm", "install_queue", "pool", "free_blocks",
           "blocks_held", "sync_view", "running", "set_running", "rejoin", "max_running", "live_requests", "preempt",
           "scheduled", "token_budget", "logger", "chunk_cap", "set_chunk_cap",
           "ChunkCaps"]


def logger() -> logging.Logger:
    """A child of vLLM's own logger: its handler, level (VLLM_LOGGING_LEVEL) and format."""
    return logging.getLogger("vllm.pdtb")


def check_vllm(vllm_config) -> None:
    """Refuse, at start-up, a vLLM these internals were not read on, and async scheduling (its
    scheduler is another class, AsyncScheduler; the CPU platform turns it off)."""
    check_version(vllm.__version__, CHECKED_VERSIONS)
    if vllm_config.scheduler_config.async_scheduling:
        raise RuntimeError("pdtb.integrations.vllm.FairScheduler runs without async scheduling: "
                           "start vLLM with --no-async-scheduling")


class PolicyQueue(FCFSRequestQueue):
    """vLLM's first-come first-served waiting queue, except during a step's admission scan
    (`admission` set): its head is then the policy's (fair_step.Admission), and it is empty
    once the policy admits no one more this step. `Scheduler.schedule` reads the waiting queue
    during that scan only through `bool`, `peek_request` and `pop_request`; `len` stays the
    number of waiting requests."""

    def __init__(self) -> None:
        super().__init__()
        self.admission = None  # fair_step.Admission during a step's scan; None: vLLM's own order

    def __bool__(self) -> bool:
        if self.admission is None:
            return len(self) > 0
        return self.admission.head(self) is not None

    def peek_request(self):
        if self.admission is None:
            return super().peek_request()
        head = self.admission.head(self)
        if head is None:
            raise IndexError("no waiting request the policy admits in this step")
        return head

    def pop_request(self):
        if self.admission is None:
            return super().pop_request()
        head = self.peek_request()
        self.remove(head)
        self.admission.popped(head)
        return head


def install_queue(scheduler: Scheduler) -> PolicyQueue:
    """Replace the scheduler's (empty, at construction) waiting queue with a PolicyQueue."""
    assert not scheduler.waiting, "the waiting queue is replaced before any request arrives"
    scheduler.waiting = PolicyQueue()
    return scheduler.waiting


@dataclass(frozen=True)
class Pool:
    """The KV cache manager's blocks at a moment, as the policy's pages (one block = one page)."""

    block_size: int  # tokens per block
    block_bytes: int  # bytes of one block over all layers, K and V
    total: int  # blocks requests can hold (the pool's null block is never handed out)
    free: int


def pool(scheduler: Scheduler) -> Pool:
    blocks = scheduler.kv_cache_manager.block_pool
    cfg = scheduler.kv_cache_config
    nbytes = sum(t.size for t in cfg.kv_cache_tensors) // max(1, cfg.num_blocks)
    return Pool(scheduler.block_size, nbytes, blocks.num_gpu_blocks - 1, blocks.get_num_free_blocks())


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def blocks_held(scheduler: Scheduler, request_id: str) -> int:
    """Blocks `request_id` holds in the first KV cache group (the only one of a model whose
    layers all attend in full)."""
    return len(scheduler.kv_cache_manager.coordinator.get_blocks(request_id)[0])


def token_budget(scheduler: Scheduler) -> int:
    return scheduler.max_num_scheduled_tokens


def running(scheduler: Scheduler) -> list:
    return scheduler.running


def set_running(scheduler: Scheduler, order: list) -> None:
    """Reorder the running list: vLLM steps it in this order and, out of blocks, preempts its
    tail first (`self.running.pop()` under the FCFS scheduling policy)."""
    scheduler.running[:] = order


def rejoin(scheduler: Scheduler, requests: list) -> None:
    """Put back at the running list's tail the requests that sat a step out (set_running left
    them out; their blocks stayed theirs)."""
    scheduler.running.extend(requests)


def max_running(scheduler: Scheduler) -> int:
    """Requests the scheduler admits into its running list at most (its model runner's slots)."""
    return scheduler.max_num_active_reqs


def chunk_cap(scheduler: Scheduler) -> int:
    """The longest prefill chunk vLLM schedules for any request this step (0: the budget's)."""
    return scheduler.scheduler_config.long_prefill_token_threshold


class ChunkCaps:
    """Scheduler mixin: each request's prompt chunk bounded by `chunk_caps` (request id -> tokens),
    on top of the step's one bound. vLLM sizes a chunk inline in `schedule()` and passes every
    chunk it sizes, running and admitted, through `_reserve_prefill_lookahead` (read on 0.32.0):
    bounding it there is the per-request hook vLLM has no public form of."""

    chunk_caps: dict = {}

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        cap = self.chunk_caps.get(request.request_id)
        return n if cap is None or n <= 1 else min(n, max(1, cap))


def set_chunk_cap(scheduler: Scheduler, tokens: int) -> None:
    """vLLM reads `long_prefill_token_threshold` from its scheduler config at every step: set for
    one step, it bounds every chunk of that step (running prompts' and admitted ones')."""
    scheduler.scheduler_config.long_prefill_token_threshold = tokens


def live_requests(scheduler: Scheduler) -> dict:
    """Request id -> request, for every request the scheduler has not ended."""
    return scheduler.requests


def preempt(scheduler: Scheduler, request) -> None:
    """Take a running request's blocks at once and queue it for recompute, as vLLM preempts."""
    scheduler.running.remove(request)
    scheduler._preempt_request(request, time.monotonic())


def scheduled(output) -> dict[str, int]:
    """Request id -> tokens a SchedulerOutput gives it this step."""
    return output.num_scheduled_tokens


def preempted(output) -> set[str]:
    """Request ids a SchedulerOutput preempted this step (their blocks freed, to recompute)."""
    return set(output.preempted_req_ids or ())


def sync_view(view: Sequence | None, request, is_running: bool) -> Sequence:
    """The policy's view of a vLLM request (a pdtb Sequence), made once and kept current: its
    token ids are the request's own list (read-only), its tenant and SLO tier from
    `SamplingParams.extra_args` (the OpenAI API's `vllm_xargs`)."""
    if view is None:
        params = request.sampling_params
        tenant, tier = request_labels(params.extra_args if params is not None else None)
        view = Sequence(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                        SamplingParams(max_tokens=max(1, request.max_tokens)), tenant=tenant,
                        priority=request.priority, slo_tier=tier, arrival_time=request.arrival_time)
    view.num_computed_tokens = request.num_computed_tokens
    view.num_preemptions = request.num_preemptions
    view.status = SeqStatus.RUNNING if is_running else SeqStatus.WAITING
    return view
