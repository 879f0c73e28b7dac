"""A request's arrival on a node, without the engine's model: its sampling parameters as they travel
and as the engine takes them, the checks a prompt must pass on a node, and its Sequence queued.
The real nodes and the simulator (pdtb/sim) accept requests by these same rules."""
from __future__ import annotations

import time

from pdtb.engine.sequence import SamplingParams, Sequence
from pdtb.nodes.protocol import GenerateRequest, Params


def to_sampling(p: Params) -> SamplingParams:
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                          ignore_eos=p.ignore_eos, stop_token_ids=tuple(p.stop_token_ids), first_index=p.first_index)


def to_params(p: SamplingParams) -> Params:
    """`to_sampling`'s inverse: a request's sampling parameters as they travel."""
    return Params(p.max_tokens, p.temperature, p.top_p, p.seed, p.ignore_eos, list(p.stop_token_ids), p.first_index)


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
