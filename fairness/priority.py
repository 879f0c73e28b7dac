"""`priority`: priority classes (lower number runs first) with aging so nothing starves.

A request gains one class of urgency per `aging_s` seconds it goes unserved: a waiting or
parked request since it arrived (or was last served), a running request since the last step
that carried it (a resident row that higher classes keep out of a full step budget ages
too). Running requests step in that order; admission follows it; the victim is the least
urgent, newest request. A row that steps starts ageing afresh, so classes order the work and
aging only bounds how long any one request can be passed over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting


@dataclass(frozen=True)
class PrioritySettings(PolicySettings):
    aging_s: float = setting(2.0, "a request gains one class of urgency per this many seconds unserved",
                             lo=0.0, lo_open=True)


class PriorityPolicy(BasePolicy):
    name = "priority"
    Settings = PrioritySettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self._served: dict[str, float] = {}  # request id -> state.now of the last step that carried it

    def effective(self, seq, now: float) -> float:
        # Whole classes: a request passed over for less than aging_s keeps its class, so within
        # a class the order is arrival. (Aging by fractions of a class made equal rows take
        # turns step by step, the last served going last: two prompts of one class prefilled
        # side by side, each holding its pages twice as long.)
        waited = max(0.0, now - self._served.get(seq.request_id, seq.arrival_time))
        return seq.priority - math.floor(waited / self.settings.aging_s)

    def refresh(self, running, candidates, state):
        super().refresh(running, candidates, state)
        live = {s.request_id for s in running} | {s.request_id for s in candidates}
        if len(self._served) > 2 * len(live) + 64:  # forget ended requests now and then
            self._served = {r: t for r, t in self._served.items() if r in live}

    def forget(self, request_id):
        super().forget(request_id)
        self._served.pop(request_id, None)

    def step_order(self, running, state):
        return sorted(super().step_order(running, state), key=lambda s: (self.effective(s, state.now), s.arrival_time))

    def admission_order(self, candidates, state):
        return sorted(candidates, key=lambda s: (self.effective(s, state.now), s.arrival_time))

    def choose_victim(self, candidates, requester, state):
        return max(candidates, key=lambda s: (self.effective(s, state.now), s.arrival_time))

    def on_step(self, chunks, state):
        super().on_step(chunks, state)
        for c in chunks:
            self._served[c.seq.request_id] = state.now

    def on_steps(self, chunks, state, starts):
        for c in chunks:
            self._served[c.seq.request_id] = starts[-1]
