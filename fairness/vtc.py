"""`vtc`: Virtual Token Counter (Sheng et al., OSDI 2024) applied to KV admission.

Each tenant has a counter charged w_in per input token prefilled and w_out per output token
decoded. Admission serves the waiting tenant with the smallest counter. When a tenant's queue
goes from empty to non-empty (waiting, parked, or held at the prefill side: work that waits
for device pages) its counter is lifted to the smallest counter among tenants with waiting
work (when all come back at once: where that stood when someone last had waiting work), so
idle time cannot be banked, as in the paper. Requests already running do not count: a
tenant that only decodes does not set the floor, and is lifted when new work of its waits.
Victim: the newest request of the tenant with the largest counter.
"""
from __future__ import annotations

from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


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
        """Apply the counter lift to tenants whose queue just became non-empty
        (`tenants_with_work`: the tenants with waiting work now)."""
        returning = tenants_with_work - self.active
        incumbents = [self.counters.get(t, 0.0) for t in tenants_with_work - returning]
        # With no incumbent (everyone returns together after a moment with no work), the floor
        # is where the smallest counter stood when someone last had work: otherwise a tenant
        # far behind would bank its idle time whenever the server went idle in between.
        floor = min(incumbents) if incumbents else self.last_floor
        for t in returning:
            c = self.counters.get(t, 0.0)
            self.counters[t] = max(c, floor) if floor is not None else c
        self.active = set(tenants_with_work)
        if tenants_with_work:
            self.last_floor = min(self.counters.get(t, 0.0) for t in tenants_with_work)

    def reclaim(self, running, candidates, state):
        super().reclaim(running, candidates, state)
        self.lift({s.tenant for s in candidates} | {h.tenant for h in self.live_held(state)})
        return []

    def admission_order(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        return sorted(candidates, key=lambda s: (self.counters.get(s.tenant, 0.0), s.arrival_time))

    def choose_victim(self, candidates, requester, state):
        return max(candidates, key=lambda s: (self.counters.get(s.tenant, 0.0), s.arrival_time))

    def on_step(self, chunks, state) -> None:
        super().on_step(chunks, state)
        w_in, w_out = self.settings.input_weight, self.settings.output_weight
        for c in chunks:
            seq, n = c.seq, c.num_new_tokens
            prompt_part = max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            charge = w_in * prompt_part + w_out * (1 if c.wants_logits else 0)
            self.counters[seq.tenant] = self.counters.get(seq.tenant, 0.0) + charge
