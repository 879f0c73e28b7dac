"""Colocated node: both roles in one process over one page pool.

Queues: scheduler.waiting (new and preempted requests) -> scheduler.running (prefill chunks and
decode steps interleaved in one batch under the token budget). A request's path:

    GenerateRequest -> validate -> waiting -> chunked prefill -> first token (event) ->
    decode steps (one event per token) -> finished (final event with timing, pages freed)

It runs the same engine, scheduler and admission interface as the disaggregated nodes, so the
comparison between the two modes is policy against policy, not code against code.
"""
from __future__ import annotations

import time

from pdtb.nodes.arrival import accept_request
from pdtb.nodes.node_base import NodeBase
from pdtb.nodes.protocol import GenerateRequest
from pdtb.engine.scheduler import StepEvent


class ColocatedNode(NodeBase):
    def on_generate(self, req: GenerateRequest) -> None:
        accept_request(self, req)

    def on_step_events(self, events: list[StepEvent], t: float) -> None:
        now = time.time()
        for c in self.engine.last_output.chunks:
            c.seq.timeline.stamp_once("prefill_start", t)
            if not c.seq.output_token_ids:
                self.metrics.prompt_tokens.inc(c.num_new_tokens)
        for ev in events:
            tl = ev.seq.timeline
            if tl.first_token is None:
                tl.first_token = tl.decode_admit = now
                self.metrics.ttft.observe(now - tl.arrival)
            else:
                self.metrics.itl.observe(now - (tl.last_token or now))
            tl.last_token = now
            self.metrics.gen_tokens.inc()
            self.emit(ev.seq, [ev.token_id], ev.finished)
