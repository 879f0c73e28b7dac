"""`dlpm`: Deficit Longest Prefix Match (Cao et al., arXiv 2501.14312), at one node.

Each tenant (client) has a deficit counter. Waiting requests are admitted longest prefix match
first (the most leading pages found in this node's prefix cache: `SchedState.cached_pages`),
ties by arrival, but only from tenants whose deficit is positive; when no waiting request's
tenant has one, every tenant with waiting requests gains `quantum`. Admitting a request costs
its tenant `input_weight` per uncached prompt token, and each token it generates costs
`output_weight`. Prefix locality is kept within what each tenant has paid for.

`admission_order` plays this forward from the committed counters (the first `PLAY` requests:
a step admits fewer); each admission commits the counters the play reached at that request.
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting

PLAY = 256  # requests ordered by the rule per step; the rest follow in prefix-match order


@dataclass(frozen=True)
class DlpmSettings(PolicySettings):
    quantum: float = setting(2048.0, "deficit every tenant with waiting work gains when none may go", lo=0.0,
                             lo_open=True)
    input_weight: float = setting(1.0, "charge per uncached prompt token admitted", lo=0.0)
    output_weight: float = setting(2.0, "charge per token generated", lo=0.0)


class DlpmPolicy(BasePolicy):
    name = "dlpm"
    Settings = DlpmSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.deficit: dict[str, float] = {}  # tenant -> its counter, committed
        self._after: dict[str, dict] = {}  # request id -> the counters once it is admitted (this step's play)

    def uncached(self, seq, state) -> int:
        """Prompt tokens admitting `seq` would prefill (a parked request's KV is computed: none)."""
        if seq.num_computed_tokens:
            return 0
        hit = state.cached_pages(seq) if state.cached_pages else 0
        return max(0, seq.num_tokens - hit * state.page_size)

    def admission_order(self, candidates, state):
        hits = {s.request_id: state.cached_pages(s) if state.cached_pages else 0 for s in candidates}
        rest = sorted(candidates, key=lambda s: (-hits[s.request_id], s.arrival_time, s.request_id))
        deficit, out, self._after = dict(self.deficit), [], {}
        while rest and len(out) < PLAY:
            pick = next((s for s in rest if deficit.get(s.tenant, 0.0) > 0), None)
            if pick is None:
                for t in {s.tenant for s in rest}:
                    deficit[t] = deficit.get(t, 0.0) + self.settings.quantum
                continue
            rest.remove(pick)
            deficit[pick.tenant] = deficit.get(pick.tenant, 0.0) - self.settings.input_weight * \
                self.uncached(pick, state)
            out.append(pick)
            self._after[pick.request_id] = dict(deficit)
        return out + rest

    def admitted(self, seq, need_pages, state):
        super().admitted(seq, need_pages, state)
        self.deficit = self._after.pop(seq.request_id, self.deficit)  # admitted: the play up to it is real

    def on_step(self, chunks, state) -> None:
        super().on_step(chunks, state)
        for c in chunks:
            if c.wants_logits:
                self.deficit[c.seq.tenant] = self.deficit.get(c.seq.tenant, 0.0) - self.settings.output_weight

    def on_steps(self, chunks, state, starts) -> None:
        w = self.settings.output_weight * len(starts)  # every row sampled a token each step
        for c in chunks:
            self.deficit[c.seq.tenant] = self.deficit.get(c.seq.tenant, 0.0) - w
