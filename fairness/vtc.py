"""`vtc`: Virtual Token Counter (Sheng et al., OSDI 2024) applied to KV admission.

Each tenant's counter is charged input_weight per input token prefilled and output_weight per
output token decoded; admission serves the waiting tenant with the smallest counter. When a
tenant's queue turns non-empty (waiting, parked, or held at the prefill side) its counter is
lifted to the smallest among tenants with waiting work, so idle time cannot be banked, as in
the paper; running requests do not count. Victim: the newest request of the largest counter.
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting


@dataclass(frozen=True)
class VtcSettings(PolicySettings):
    input_weight: float = setting(1.0, "charge per input token prefilled", lo=0.0)
    output_weight: float = setting(2.0, "charge per output token decoded", lo=0.0)


class VtcPolicy(BasePolicy):
    name = "vtc"
    Settings = VtcSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.counters: dict[str, float] = {}
        self.active: set[str] = set()  # tenants with waiting work at the previous step
        self.last_floor: float | None = None  # smallest counter among tenants with waiting work, when last anyone had some

    def lift(self, tenants_with_work: set[str]) -> None:
        """Lift the counters of tenants whose queue just turned non-empty (of `tenants_with_work`)."""
        returning = tenants_with_work - self.active
        incumbents = [self.counters.get(t, 0.0) for t in tenants_with_work - returning]
        # no incumbent (all return at once): the floor as it last stood, or idle time is banked
        floor = min(incumbents) if incumbents else self.last_floor
        for t in returning:
            self.counters[t] = max(self.counters.get(t, 0.0), floor if floor is not None else -1.0)
        self.active = set(tenants_with_work)
        if tenants_with_work:
            self.last_floor = min(self.counters.get(t, 0.0) for t in tenants_with_work)

    def reclaim(self, running, candidates, state):
        super().reclaim(running, candidates, state)
        self.lift({s.tenant for s in candidates} | {h.tenant for h in self.live_held(state)})
        return []

    def admission_order(self, candidates, state):
        return sorted(candidates, key=lambda s: (self.counters.get(s.tenant, 0.0), s.arrival_time))

    def choose_victim(self, candidates, requester, state):
        return max(candidates, key=lambda s: (self.counters.get(s.tenant, 0.0), s.arrival_time))

    def on_step(self, chunks, state) -> None:
        super().on_step(chunks, state)
        w_in, w_out = self.settings.input_weight, self.settings.output_weight
        for c in chunks:
            prompt_part = max(0, min(c.num_new_tokens, c.seq.num_prompt_tokens - c.seq.num_computed_tokens))
            charge = w_in * prompt_part + w_out * (1 if c.wants_logits else 0)
            self.counters[c.seq.tenant] = self.counters.get(c.seq.tenant, 0.0) + charge

    def on_steps(self, chunks, state, starts) -> None:
        w = self.settings.output_weight * len(starts)  # every row sampled a token each step
        for c in chunks:
            self.counters[c.seq.tenant] = self.counters.get(c.seq.tenant, 0.0) + w
