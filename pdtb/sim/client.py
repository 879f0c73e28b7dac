"""`SimClient`: the load client's sending (open loop, closed loop of N, at most M in flight) and
each request's record.

The simulated load client, sending as pdtb/client/load.py does:

    open loop:            each request at its spec's send time
    closed loop (N):      N requests in flight, the next sent when one ends at the client
                          (the specs' send times ignored; each is scheduled when it is sent)
    max_concurrency (M):  open loop with at most M in flight, an arrival past that waiting
                          for a slot (its wait shows as dispatch lag: send_time - scheduled_time)

Each request's record is made here; the router gets it `client_latency_s` after it is sent.
"""
from __future__ import annotations

from collections import deque

from pdtb.figures.records import RequestRecord, RequestSpec

DEFAULT_TAIL_S = 3600.0  # simulated time after the last arrival before open requests are cut off


class SimClient:
    def __init__(self, cluster, concurrency: int | None = None, max_concurrency: int | None = None) -> None:
        self.cluster, self.loop = cluster, cluster.loop
        self.closed = bool(concurrency)
        self.slots = concurrency or max_concurrency or 0  # 0: no limit
        self.queue: deque = deque()  # (index, spec) waiting for a slot
        self.in_flight = 0

    def horizon(self, specs: list[RequestSpec]) -> float:
        """The default end of a run: an hour after the last arrival (closed loop: an hour for
        each round of requests)."""
        if self.closed:
            return DEFAULT_TAIL_S * (1 + len(specs) / self.slots)
        return max((s.send_time for s in specs), default=0.0) + DEFAULT_TAIL_S

    def start(self, specs: list[RequestSpec]) -> list[RequestRecord]:
        """Every request's record, and its sending scheduled."""
        c, out = self.cluster, []
        for i, s in enumerate(specs):
            t = 0.0 if self.closed else s.send_time
            rec = c.records[f"sim-{i}"] = RequestRecord(s.tenant, s.klass, s.prompt_len, s.output_len,
                                                        scheduled_time=t, send_time=t, priority=s.priority)
            out.append(rec)
            if self.closed:
                self.queue.append((i, s))
            elif self.slots:
                self.loop.at(t, self._arrive, i, s)
            else:  # (no slot to wait for: it goes at its time)
                self.loop.at(t + c.shape.client_latency_s, c.submit, i, s)
        for _ in range(min(self.slots, len(specs)) if self.closed else 0):
            self._send(*self.queue.popleft())
        return out

    def _arrive(self, i: int, s: RequestSpec) -> None:
        if self.in_flight >= self.slots:
            self.queue.append((i, s))
        else:
            self._send(i, s)

    def _send(self, i: int, s: RequestSpec) -> None:
        self.in_flight += 1
        rec, now = self.cluster.records[f"sim-{i}"], self.loop.now
        rec.send_time = now
        if self.closed:
            rec.scheduled_time = now
        self.loop.after(self.cluster.shape.client_latency_s, self.cluster.submit, i, s)

    def ended(self, t: float) -> None:
        """A request ended at the client at `t`: its slot goes to the next one waiting, then."""
        if not self.slots:
            return
        self.in_flight -= 1
        if self.queue:
            self.loop.at(t, self._send, *self.queue.popleft())
