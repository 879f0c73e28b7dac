"""`priority`: priority classes (lower number runs first) with aging so nothing starves.

A waiting request gains one class of urgency per `aging_s` seconds waited. Running requests
step in priority order; the victim is the least urgent, newest request.
"""
from __future__ import annotations

from fairness.base import BasePolicy


class PriorityPolicy(BasePolicy):
    name = "priority"

    def effective(self, seq, now: float) -> float:
        waited = max(0.0, now - seq.arrival_time)
        return seq.priority - waited / self.cfg.aging_s

    def step_order(self, running, state):
        return sorted(super().step_order(running, state), key=lambda s: (s.priority, s.arrival_time))

    def admission_order(self, candidates, state):
        return sorted(candidates, key=lambda s: (self.effective(s, state.now), s.arrival_time))

    def choose_victim(self, candidates, requester, state):
        return max(candidates, key=lambda s: (s.priority, s.arrival_time))
