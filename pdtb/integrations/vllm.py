"""`FairScheduler`: vLLM's scheduler with a pd-testbed fairness policy deciding its order
(docs/vllm.md, "Your policy in vLLM"). vLLM loads it by name:

    PDTB_POLICY=memfair PDTB_POLICY_ARGS=starve_after_s=4 \\
        python -m vllm.entrypoints.openai.api_server ... --scheduler-cls pdtb.integrations.vllm.FairScheduler

Each step, before vLLM's own `schedule()` runs, the policy is asked (pdtb/integrations/fair_step.py):
reclaim (its victims preempted before the step), the running requests' order (vLLM steps them in it and,
out of blocks, preempts its tail, where the victims the policy picks for the foreseen shortfall
go), and, as vLLM's admission scan reaches them, the waiting requests' order and quotas (the
waiting queue is a PolicyQueue whose head is the policy's). After it, the policy is told what
the step served. vLLM's internals are touched only through pdtb/integrations/vllm_internals.py.
With PDTB_METRICS_PORT set, the policy's raised calls and illegal answers are Prometheus
counters served from this process (pdtb/integrations/policy_metrics.py).
"""
from __future__ import annotations

import os
import time

from pdtb.engine.sched_policy import SchedState
from pdtb.engine.scheduler import ScheduledChunk
from pdtb.integrations import vllm_internals as vi
from pdtb.integrations.fair_step import FairStep, with_free
from pdtb.integrations.policy_env import build_policy, policy_spec
from pdtb.integrations.policy_metrics import PolicyMetrics
from pdtb.integrations.step_log import StepLog

log = vi.logger()


class FairScheduler(vi.ChunkCaps, vi.Scheduler):
    """vLLM's Scheduler; the policy named by PDTB_POLICY (with PDTB_POLICY_ARGS) decides order,
    admission and victims. `policy_errors` counts the policy's calls that raised (each cost its
    step the policy's order, never the engine)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        vi.check_vllm(vllm_config)
        self.policy_spec = policy_spec(os.environ)
        policy = build_policy(self.policy_spec)
        super().__init__(vllm_config, *args, **kwargs)
        self.metrics = PolicyMetrics(self.policy_spec.name, os.environ, log)
        self.fair = FairStep(policy, log, self.metrics)
        self.queue = vi.install_queue(self)
        self.clock = time.time  # the clock vLLM stamps a request's arrival_time with
        self._state: SchedState | None = None
        self._tenants: set[str] = set()  # tenants seen (each logged once, when first seen)
        self.step_log = StepLog.open(os.environ)
        spec = self.policy_spec
        log.info("pd-testbed policy %s (%s), settings %s", spec.name, spec.source, dict(spec.args) or "default")

    @property
    def policy_errors(self) -> int:
        """Calls of the policy that raised, since start-up."""
        return self.fair.errors

    @property
    def policy_violations(self) -> list[str]:
        """Illegal answers of the policy (the first 50), each replaced by the default answer."""
        return self.fair.violations

    def schedule(self, *args, **kwargs):
        t_step = time.perf_counter()
        live = vi.live_requests(self)
        self.fair.forget_missing(live)
        running = [self._view(r, True) for r in vi.running(self)]
        waiting = [self._view(r, False) for r in self.queue]
        state = self._state = self._snapshot(running, self.fair.steps + 1)
        plan = self.fair.begin(running, waiting, state)
        excluded: set[str] = set()
        sitting: list = []
        if plan is not None:
            for v in plan.reclaimed:
                vi.preempt(self, live[v.request_id])
                excluded.add(v.request_id)
            # rows the policy leaves out sit the step out, keeping their blocks: vLLM's path for
            # a running request its token budget does not reach
            sitting = [live[v.request_id] for v in plan.sitting]
            vi.set_running(self, [live[v.request_id] for v in plan.order])
            self.queue.admission = self.fair.admission(
                self._view_of, self._live_state, lambda: not vi.running(self) and not sitting, excluded,
                lambda: len(vi.running(self)) + len(sitting) < vi.max_running(self))
        cap = vi.chunk_cap(self)
        if plan is not None and plan.chunk_cap is not None:
            vi.set_chunk_cap(self, plan.chunk_cap)
            self.chunk_caps = plan.caps  # each running prompt's own part of the step
        t0 = time.perf_counter()
        try:
            out = super().schedule(*args, **kwargs)
            t_vllm = time.perf_counter() - t0
        finally:
            self.queue.admission = None
            self.chunk_caps = {}
            vi.rejoin(self, sitting)
            vi.set_chunk_cap(self, cap)
        after = self._snapshot([self._view(r, True) for r in vi.running(self)], self.fair.steps)
        chunks = self._chunks(out, live)
        self.fair.end(chunks, after)
        if self.step_log is not None:
            dropped = vi.preempted(out)
            gone = [self.fair.views[r] for r in dropped if r in self.fair.views]
            gone += [v for v in plan.reclaimed if v.request_id not in dropped] if plan is not None else []
            self.step_log.write(self.fair.steps, chunks, len(self.queue), len(sitting),
                                plan.chunk_cap if plan is not None else None, time.perf_counter() - t_step, gone,
                                reclaimed=len(plan.reclaimed) if plan is not None else 0, free=state.device_free,
                                vllm_s=t_vllm)
        return out

    # ---- the policy's view ------------------------------------------------------------------------
    def _view(self, request, is_running: bool):
        views = self.fair.views
        v = views[request.request_id] = vi.sync_view(views.get(request.request_id), request, is_running)
        if v.tenant not in self._tenants:
            self._tenants.add(v.tenant)
            log.info("pd-testbed policy %s: first request of tenant %r (%s)", self.policy_spec.name, v.tenant,
                     v.request_id)
        return v

    def _view_of(self, request):
        return self.fair.views.get(request.request_id) or self._view(request, False)

    def _snapshot(self, running, step: int) -> SchedState:
        """The state as a policy sees it: blocks as pages, the running requests' blocks held."""
        pool = vi.pool(self)
        pages = {v.request_id: vi.blocks_held(self, v.request_id) for v in running}
        return SchedState(self.clock(), step, pool.block_size, pool.block_bytes, pool.total, pool.free,
                          0, 0, pages, {}, vi.token_budget(self))

    def _live_state(self) -> SchedState:
        return with_free(self._state, vi.free_blocks(self))

    def _chunks(self, out, live) -> list[ScheduledChunk]:
        """What the step serves, each chunk on its request's view as it stood before the step
        (vLLM has already advanced num_computed_tokens by the chunk)."""
        chunks = []
        for rid, n in vi.scheduled(out).items():
            request = live.get(rid)
            if request is None:
                continue
            v = self._view(request, True)
            v.num_computed_tokens = max(0, request.num_computed_tokens - n)
            chunks.append(ScheduledChunk(v, n))
        return chunks
