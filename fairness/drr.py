"""`drr`: deficit round robin over policy classes, as NVIDIA Dynamo's router schedules them.

Requests are grouped by class (their `priority`); within a class, first come first served. The
classes with waiting work take turns in a ring, in order of arrival in it; at its turn a class
gains `quantum` tokens of deficit and admits its head requests while the head's cost fits the
deficit, paying the cost. A request's cost is its uncached tokens: the prompt tokens still to
prefill (a parked request, already computed, costs nothing). A class whose queue empties
leaves the ring and its deficit goes (Shreedhar and Varghese, SIGCOMM 1995).

`admission_order` plays the rounds forward from the committed state; each admission commits
the state the play reached at that request, so the admitted requests follow DRR exactly.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fairness.base import BasePolicy
from fairness.settings import PolicySettings, setting


@dataclass(frozen=True)
class DrrSettings(PolicySettings):
    quantum: int = setting(2048, "uncached tokens a class may admit per turn", lo=1)


@dataclass(frozen=True)
class Ring:
    """The committed round state: classes in turn order (the first is up), their deficits,
    and whether the first already got its quantum this turn."""

    order: tuple = ()
    deficit: tuple = ()  # (class, tokens) pairs
    topped: bool = False


def cost(seq) -> int:
    """Uncached tokens: what admitting `seq` costs its class. A waiting request's prompt (a
    prefix-cache hit is found at admission, after the order, and is charged in full); a
    parked one's KV is computed: nothing."""
    return 0 if seq.num_computed_tokens else seq.num_tokens


class DrrPolicy(BasePolicy):
    name = "drr"
    Settings = DrrSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.ring = Ring()
        self._after: dict[str, Ring] = {}  # request id -> the state once it is admitted (this step's play)

    def admission_order(self, candidates, state):
        queues: dict[int, deque] = {}
        for s in sorted(candidates, key=lambda s: (s.arrival_time, s.request_id)):
            queues.setdefault(s.priority, deque()).append(s)
        order = [c for c in self.ring.order if c in queues] + sorted(c for c in queues if c not in self.ring.order)
        deficit = {c: d for c, d in self.ring.deficit if c in queues}
        topped = self.ring.topped and bool(order) and order[0] == self.ring.order[0]
        out, self._after = [], {}
        while order:
            c, q = order[0], queues[order[0]]
            if not topped:
                deficit[c] = deficit.get(c, 0) + self.settings.quantum
            while q and cost(q[0]) <= deficit[c]:
                s = q.popleft()
                deficit[c] -= cost(s)
                out.append(s)
                left = order if q else order[1:]
                self._after[s.request_id] = Ring(tuple(left), tuple((k, deficit[k]) for k in left if k in deficit
                                                                    and (k != c or q)), bool(q))
            order = order[1:] + ([c] if q else [])
            topped = False
            if not q:
                deficit.pop(c, None)
        return out

    def admitted(self, seq, need_pages, state):
        super().admitted(seq, need_pages, state)
        self.ring = self._after.pop(seq.request_id, self.ring)  # admitted: the play up to it is real
