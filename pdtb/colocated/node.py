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

from pdtb.nodes.node_base import NodeBase, to_sampling
from pdtb.nodes.protocol import GenerateRequest
from pdtb.engine.engine import StepEvent
from pdtb.engine.sequence import Sequence


def validate_prompt(engine, req: GenerateRequest) -> str | None:
    """Reason the request cannot run on this engine, or None."""
    info, cfg = engine.info, engine.scheduler.config
    n = len(req.prompt_token_ids)
    if n == 0:
        return "empty prompt"
    if n >= cfg.max_model_len:
        return f"prompt of {n} tokens does not fit the context of {cfg.max_model_len}"
    if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= info.vocab_size:
        return f"token id outside the vocabulary [0, {info.vocab_size})"
    if req.earlier is not None and not req.earlier.valid():
        return f"earlier attempts' figures out of order or not finite: {req.earlier}"
    peak = engine.scheduler.peak_pages(n, req.params.max_tokens)
    if peak > engine.pool.num_pages:
        return f"request needs up to {peak} KV pages; the pool has {engine.pool.num_pages}"
    return None


def make_seq(req: GenerateRequest) -> Sequence:
    seq = Sequence.from_prompt(req.request_id, req.prompt_token_ids, to_sampling(req.params),
                               tenant=req.tenant, priority=req.priority, slo_tier=req.slo_tier)
    seq.timeline.router_arrival = req.arrival_time
    seq.timeline.prefill_queued = time.time()
    seq.timeline.earlier = req.earlier  # (validate_prompt checked it)
    return seq


def accept_request(node, req: GenerateRequest, extra_check: str | None = None) -> Sequence | None:
    """Validate `req` on `node`'s engine and queue it; on any problem fail it with the reason."""
    try:
        bad = extra_check or validate_prompt(node.engine, req)
        seq = None if bad else make_seq(req)
    except ValueError as e:
        bad = str(e)
    if bad:
        node.fail(req.request_id, bad)
        return None
    node.seqs[seq.request_id] = seq
    node.engine.add(seq)
    return seq


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
