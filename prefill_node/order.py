"""Prefill-side admission order (FIFO that does not block on held requests).

Prefill-side scheduling policy: the cluster's fairness policy for *order*, with two rules
of the prefill node's own.

- A prompt starts only when its whole prompt fits the pool: a whale admitted chunk by chunk
  into a nearly full pool (it also holds pages of requests the decode side deferred) would be
  preempted halfway and recomputed, again and again. Whether a prompt that does not fit
  blocks the ones behind it is the policy's `strict_order`: FCFS keeps arrival order (as
  vLLM and SGLang do), fair policies let small prompts pass.
- No reclaim: the prefill pool has no host tier, so evicting means recompute. The policy's
  order (which prompt first, how much of the step's token budget a chunk may take) applies;
  its quotas and evictions are for the decode side.
"""
from __future__ import annotations

from fairness.interface import QuotaView


class PrefillOrder:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"prefill-{inner.name}"
        self.strict_order = inner.strict_order

    def reclaim(self, running, candidates, state):
        self.inner.reclaim(running, candidates, state)  # refreshes the policy's per-step view
        return []

    def step_order(self, running, state):
        return self.inner.step_order(running, state)

    def admission_order(self, candidates, state):
        return self.inner.admission_order(candidates, state)

    def chunk_limit(self, seq, budget, state):
        return self.inner.chunk_limit(seq, budget, state)

    def may_admit(self, seq, need_pages, state):
        whole = -(-seq.num_tokens // state.page_size) - state.pages.get(seq.request_id, 0)
        return whole <= state.device_free

    def pick_victim(self, candidates, requester, state):
        return self.inner.pick_victim(candidates, requester, state)

    def on_step(self, chunks, state):
        self.inner.on_step(chunks, state)

    def forget(self, request_id):
        self.inner.forget(request_id)

    def quotas(self):
        return QuotaView()  # quotas are the decode side's
