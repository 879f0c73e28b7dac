"""`Migration`, `MigrationBook`: migrations in flight and done, as `/cluster/migrations` shows
them.

The router's side of live migration between decode nodes: what it asked for, what became of
it, and whose token events a request takes while it moves (decode_node/migration.py has the
nodes' side).

    Migrate(request, target) ──▶ source ──precopy, pause, final──▶ target
    target: HandoffNotice(migration_id, output_tokens=N)   the router switches the request to
            the target; the source's events count until the request has N tokens, the target's
            wait (held) until then, so the stream keeps its order across two connections
    source: MigrationReport(ok | failed[, resumed])        the book records the outcome
    target: MigrationReport(downtime_s)                    the pause the request saw

If the router already has more than N tokens when the target's notice comes (the source
resumed: its confirmation was lost), the target is told to drop the request; if the source's
events go past N after the switch, the source is told to drop it. Either way one node holds it.
"""
from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass, field

from pdtb.nodes.protocol import MigrationReport, TokenEvent

DONE_KEPT = 256  # finished migrations /cluster lists
NO_REPORT_S = 120.0  # a migration with no word from its source this long is counted as lost


@dataclass(eq=False)
class Migration:
    migration_id: str
    request_id: str
    source: str  # node ids
    target: str
    reason: str  # "admin" | "drain" | "pressure" | "fair"
    started: float  # monotonic
    state: str = "in_flight"  # "in_flight" | "done" | "failed"
    switch_at: int = -1  # the target's notice: output tokens the request had when the source paused it
    switched: bool = False  # the router takes the target's events now
    held: list[TokenEvent] = field(default_factory=list)  # target events that came before the source's last ones
    outcome: str = ""  # why it failed, or how it ended
    phase: str = ""
    pages: int = 0
    precopy_bytes: int = 0
    final_bytes: int = 0
    precopy_s: float = 0.0
    final_s: float = 0.0
    downtime_s: float | None = None
    ended: float | None = None  # monotonic

    def to_dict(self, now: float) -> dict:
        return {"migration_id": self.migration_id, "request_id": self.request_id, "source": self.source,
                "target": self.target, "reason": self.reason, "state": self.state, "phase": self.phase,
                "outcome": self.outcome, "pages": self.pages, "precopy_bytes": self.precopy_bytes,
                "final_bytes": self.final_bytes, "precopy_s": round(self.precopy_s, 6),
                "final_s": round(self.final_s, 6),
                "downtime_s": None if self.downtime_s is None else round(self.downtime_s, 6),
                "age_s": round(now - self.started, 3)}


class MigrationBook:
    """Migrations in flight (by id) and the last DONE_KEPT that ended."""

    def __init__(self) -> None:
        self.in_flight: dict[str, Migration] = {}
        self.done: collections.deque[Migration] = collections.deque(maxlen=DONE_KEPT)
        self.counts = collections.Counter()  # outcome -> migrations
        self._ids = itertools.count(1)
        self.on_end = None  # callback(Migration) when one ends (metrics)

    def new(self, request_id: str, source: str, target: str, reason: str, prefix: str) -> Migration:
        m = Migration(f"{prefix}-m{next(self._ids)}", request_id, source, target, reason, time.monotonic())
        self.in_flight[m.migration_id] = m
        return m

    def by_node(self, node_id: str) -> int:
        """Migrations in flight from or to `node_id`."""
        return sum(node_id in (m.source, m.target) for m in self.in_flight.values())

    def report(self, r: MigrationReport) -> Migration | None:
        """Apply a node's report; returns the migration it ended (None: a downtime report, or unknown)."""
        m = self.in_flight.get(r.migration_id) or next((d for d in self.done if d.migration_id == r.migration_id), None)
        if m is None:
            return None
        if r.downtime_s > 0 or (r.ok and r.phase == "resumed"):  # the target's word: the pause it saw
            m.downtime_s = r.downtime_s
            return None
        m.phase, m.pages = r.phase, r.pages or m.pages
        m.precopy_bytes, m.final_bytes = r.precopy_bytes or m.precopy_bytes, r.final_bytes or m.final_bytes
        m.precopy_s, m.final_s = r.precopy_s or m.precopy_s, r.final_s or m.final_s
        if m.state == "in_flight":
            self.end(m, "done" if r.ok else "failed", r.reason or "moved")
        return m

    def end(self, m: Migration, state: str, outcome: str) -> None:
        if m.state != "in_flight":
            return
        m.state, m.outcome, m.ended = state, outcome, time.monotonic()
        self.in_flight.pop(m.migration_id, None)
        self.done.append(m)
        self.counts[state] += 1
        if self.on_end is not None:
            self.on_end(m)

    def expire(self, now: float) -> list[Migration]:
        """End the migrations with no word from their source in NO_REPORT_S; returns them."""
        old = [m for m in self.in_flight.values() if now - m.started > NO_REPORT_S]
        for m in old:
            self.end(m, "failed", f"no word from the source in {NO_REPORT_S:g} s")
        return old

    def summary(self, now: float) -> dict:
        return {"in_flight": [m.to_dict(now) for m in self.in_flight.values()],
                "done": [m.to_dict(now) for m in self.done],
                "counts": dict(self.counts)}
