"""Processes sharing a host's cores (`pdtb sim --host-cores N`).

Every simulated process (each node, the router, the client) is one participant with a queue of
CPU work, done in order. A participant with work is runnable; with k runnable participants on
N cores each one runs at min(1, N / k) of full speed (processor sharing: what the kernel's
scheduler gives busy processes on average), so a step's time, and the router's and client's
work per token, stretch by the number of busy processes per core. The rate changes only when a
participant starts or finishes a piece of work; between two such moments every runnable
participant's head piece advances by (elapsed time) x (rate).

Without --host-cores no participant shares anything: a piece takes its own time (a GPU host, or
a node per machine).
"""
from __future__ import annotations

import collections
from typing import Callable

EPS_S = 1e-12  # work left below this is done (float rounding of rate x elapsed)


class SharedCores:
    def __init__(self, cores: int, loop) -> None:
        if cores < 1:
            raise ValueError(f"--host-cores must be at least 1, got {cores}")
        self.cores, self.loop = cores, loop
        self._queues: dict[str, collections.deque] = {}  # participant -> [[work_s left, callback], ...]
        self._last = 0.0  # when the heads were last advanced
        self._timer = 0  # generation of the pending completion event (older ones are stale)
        self.busy_s: dict[str, float] = collections.defaultdict(float)  # wall time each participant was runnable

    def rate(self) -> float:
        k = sum(1 for q in self._queues.values() if q)
        return min(1.0, self.cores / k) if k else 1.0

    def run(self, who: str, work_s: float, done: Callable[[], None]) -> None:
        """Queue `work_s` seconds of full-speed CPU work for participant `who`; `done()` runs when
        it is finished."""
        self._advance()
        self._queues.setdefault(who, collections.deque()).append([max(0.0, work_s), done])
        self._schedule()

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        if dt > 0:
            r = self.rate()
            for who, q in self._queues.items():
                if q:
                    q[0][0] -= dt * r
                    self.busy_s[who] += dt
        self._last = now

    def _schedule(self) -> None:
        self._timer += 1
        heads = [q[0][0] for q in self._queues.values() if q]
        if heads:
            self.loop.after(max(0.0, min(heads)) / self.rate(), self._on_timer, self._timer)

    def _on_timer(self, generation: int) -> None:
        if generation != self._timer:
            return  # the rate changed since: a later event stands for this one
        self._advance()
        finished = []
        for q in self._queues.values():
            if q and q[0][0] <= EPS_S:
                finished.append(q.popleft()[1])
        self._schedule()
        for done in finished:  # (after the queues are consistent: a callback may queue more work)
            done()
