"""The event loop and clock (time order, ties in scheduling order).

The simulator's clock and event queue: callbacks at simulated times, run in time order
(ties in the order they were scheduled, so a run is deterministic)."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._ids = itertools.count()
        self.num_events = 0

    def __call__(self) -> float:
        """The clock (the scheduler's and the policies' `now`)."""
        return self.now

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run `fn(*args)` at simulated time `t` (not before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._ids), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float | None = None, max_events: int | None = None) -> bool:
        """Run events in time order until none is left (True), or the next one is past `until`
        or `max_events` have run (False: the rest stay queued)."""
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                return False
            if max_events is not None and self.num_events >= max_events:
                return False
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.num_events += 1
            fn(*args)
        return True

    def pending(self) -> int:
        return len(self._heap)
