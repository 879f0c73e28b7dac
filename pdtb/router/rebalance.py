"""Live migration policy: which decoding requests move between decode nodes, and where.

The router's rebalancing controller calls `plan` on every tick with a snapshot of each decode node,
starts the moves it gets back and reports each one through `started`. The policy does no I/O and
reads no clock: `now` is the caller's monotonic time, so tests drive it with a fake clock.

One plan call, in order:

    1. drain     every mode: each listed request of a draining node goes to the non-draining node
                 with the most free pages where it fits; at most `drain_in_flight` in flight per source
    2. fair      mode "fair": one whale leaves a node where another tenant's requests wait (a whale:
                 a request of the heaviest tenant there that some other tenant waits behind)
    3. pressure  "pressure", and "fair" when step 2 found nothing: one request goes from the node with
                 the smallest free fraction to the one with the largest, when they differ by > gap_frac

Each step sees the free pages left by the moves planned before it. A request fits a node when
pages <= free - headroom, headroom = ceil(headroom_frac * pages_total): migration never fills a node
to its last page, which would leave the node's own requests no room to grow.

Steps 2 and 3 are rate limited; a drain must finish within its bound, so it waits for none of these:
    - a node that was source or target of a move started less than interval_s ago takes no part
    - a node with max_in_flight migrations in flight (its view's plus this call's) takes no part
    - a request whose move started less than settle_s ago stays where it is
    - no move B -> A within settle_s of a started move A -> B for the same reason (ping-pong);
      a fair move may undo a pressure move's direction: a pressure move knows nothing of who waits

Ties fall to the lower node_id, then the lower request_id, so a plan is a function of its inputs.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MODES = ("off", "pressure", "fair")
REASONS = ("drain", "pressure", "fair")
_EPS = 1e-9  # a float product such as 0.07 * 100 lands a hair above the integer it means


@dataclass(frozen=True)
class ReqView:
    """One decoding request as the rebalancer sees it."""

    request_id: str
    tenant: str
    pages: int  # device KV pages the request holds on its node


@dataclass(frozen=True)
class DecodeView:
    """One decode node's snapshot, as the router last heard it."""

    node_id: str
    pages_total: int  # device KV pages of the node
    pages_free: int  # of which free
    draining: bool  # being emptied: its requests leave and none arrive
    requests: tuple[ReqView, ...]  # its largest decoding requests (the list may be truncated)
    tenant_waiting: dict[str, int]  # tenant -> its requests waiting here (parked, queued, deferred hand-offs)
    migrating: int = 0  # migrations in flight from or to this node


@dataclass(frozen=True)
class Move:
    """One migration to start: `request_id` leaves `source` for `target`."""

    request_id: str
    source: str  # node_id it leaves
    target: str  # node_id it goes to
    reason: str  # one of REASONS


@dataclass
class _Recent:
    """The remembered started moves, indexed for one plan call (later starts overwrite earlier)."""

    node_at: dict[str, float] = field(default_factory=dict)  # node -> last start it took part in
    request_at: dict[str, float] = field(default_factory=dict)  # request -> its last start
    request_from: dict[str, str] = field(default_factory=dict)  # request -> source of its last start
    pair_at: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (source, target, reason) -> last start


@dataclass
class _Work:
    """One plan call's running state: pages and migrations as if the moves planned so far had started."""

    views: dict[str, DecodeView]  # node_id -> view, in node_id order
    free: dict[str, int]  # node_id -> free pages after the planned moves
    in_flight: dict[str, int]  # node_id -> view.migrating + planned moves from or to it
    moves: list[Move] = field(default_factory=list)
    planned: set[str] = field(default_factory=set)  # request ids in `moves`

    def add(self, move: Move, pages: int) -> None:
        self.free[move.source] += pages
        self.free[move.target] -= pages
        self.in_flight[move.source] += 1
        self.in_flight[move.target] += 1
        self.moves.append(move)
        self.planned.add(move.request_id)


def _by_size(requests) -> list[ReqView]:
    """Largest first, ties by request_id."""
    return sorted(requests, key=lambda r: (-r.pages, r.request_id))


class Rebalancer:
    """The migration policy of one router. State: the moves started lately, nothing else."""

    def __init__(self, mode: str, *, interval_s: float = 2.0, settle_s: float = 10.0, max_in_flight: int = 1,
                 drain_in_flight: int = 4, gap_frac: float = 0.25, headroom_frac: float = 0.05) -> None:
        if mode not in MODES:
            raise ValueError(f"rebalance mode {mode!r}: expected one of {MODES}")
        for name, v in (("interval_s", interval_s), ("settle_s", settle_s)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for name, v in (("max_in_flight", max_in_flight), ("drain_in_flight", drain_in_flight)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name, v in (("gap_frac", gap_frac), ("headroom_frac", headroom_frac)):
            if not (math.isfinite(v) and 0 <= v < 1):
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        self.mode = mode
        self.interval_s, self.settle_s = float(interval_s), float(settle_s)
        self.max_in_flight, self.drain_in_flight = max_in_flight, drain_in_flight
        self.gap_frac, self.headroom_frac = float(gap_frac), float(headroom_frac)
        # Each limit looks back at most this far; older records can decide nothing.
        self._keep_s = max(self.settle_s, self.interval_s)
        self._records: deque[tuple[float, Move]] = deque()  # (start time, move), oldest first

    @property
    def num_records(self) -> int:
        """Started moves still remembered: those of the last max(settle_s, interval_s) seconds."""
        return len(self._records)

    def started(self, move: Move, now: float) -> None:
        """The caller started `move` at `now`: it counts for the rate limits and ping-pong from here on."""
        if move.reason not in REASONS:
            raise ValueError(f"move reason {move.reason!r}: expected one of {REASONS}")
        self._forget(now)
        self._records.append((now, move))

    def plan(self, nodes: list[DecodeView], now: float) -> list[Move]:
        """The moves to start now: drain moves first (by source node_id), then at most one
        fair or pressure move. Starting none of them is always safe; nothing is recorded until
        `started`."""
        ids = [v.node_id for v in nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate node_id among {sorted(ids)}")
        self._forget(now)
        views = {v.node_id: v for v in sorted(nodes, key=lambda v: v.node_id)}
        work = _Work(views, {k: v.pages_free for k, v in views.items()},
                     {k: v.migrating for k, v in views.items()})
        recent = self._index()
        self._drain(work, recent, now)
        # "fair" falls back to pressure, so it never balances pages worse than "pressure" does.
        if self.mode == "pressure" or (self.mode == "fair" and not self._fair(work, recent, now)):
            self._pressure(work, recent, now)
        return work.moves

    # -- drain ---------------------------------------------------------------------------------

    def _drain(self, work: _Work, recent: _Recent, now: float) -> None:
        targets = [v for v in work.views.values() if not v.draining and v.pages_total > 0]
        for src in (v for v in work.views.values() if v.draining):
            # Largest first: the hardest to place takes its pick while the most room is left.
            for req in _by_size(src.requests):
                if work.in_flight[src.node_id] >= self.drain_in_flight:
                    break
                if req.request_id in work.planned or self._in_flight_from(recent, req, src, now):
                    continue
                fitting = [t for t in targets if self._fits(work, req.pages, t)]
                if fitting:  # else it finishes here, or fails at the drain bound
                    target = min(fitting, key=lambda t: (-work.free[t.node_id], t.node_id))
                    work.add(Move(req.request_id, src.node_id, target.node_id, "drain"), req.pages)

    def _in_flight_from(self, recent: _Recent, req: ReqView, src: DecodeView, now: float) -> bool:
        """A request still listed at the node its move started from within settle_s is taken to be
        on its way (the snapshot predates the hand-over); planning it again would start a second
        copy. Had that move failed, the request is drained again once the record is forgotten."""
        at = recent.request_at.get(req.request_id)
        return at is not None and now - at < self.settle_s and recent.request_from[req.request_id] == src.node_id

    # -- fair ----------------------------------------------------------------------------------

    def _fair(self, work: _Work, recent: _Recent, now: float) -> bool:
        """Plan one fair move if there is one; the most-waited-on victim node goes first."""
        free_to_move = self._balanceable(work, recent, now)
        victims = [v for v in free_to_move if _waiting_tenants(v)]
        victims.sort(key=lambda v: (-sum(n for n in v.tenant_waiting.values() if n > 0), v.node_id))
        for src in victims:
            waiting = _waiting_tenants(src)
            # The heaviest tenant here (pages of its listed requests) that another tenant waits
            # behind: its requests are the whales, largest first. Its own requests waiting too (a
            # whale preempted) does not keep its running ones here.
            held: dict[str, int] = {}
            for r in src.requests:
                held[r.tenant] = held.get(r.tenant, 0) + r.pages
            heavy = next((t for t in sorted(held, key=lambda t: (-held[t], t)) if waiting - {t}), None)
            whales = [r for r in _by_size(src.requests) if r.tenant == heavy and r.pages > 0
                      and r.request_id not in work.planned and not self._settling(recent, r, now)]
            # The largest whale that can go anywhere: one that fits nowhere frees nothing.
            for whale in whales:
                targets = [t for t in free_to_move if t.node_id != src.node_id
                           and not (_waiting_tenants(t) - {whale.tenant})  # no other tenant's minnows there
                           and self._fits(work, whale.pages, t)
                           and not self._ping_pong(recent, src.node_id, t.node_id, now, "fair")]
                if targets:
                    target = min(targets, key=lambda t: (-work.free[t.node_id], t.node_id))
                    work.add(Move(whale.request_id, src.node_id, target.node_id, "fair"), whale.pages)
                    return True
        return False

    # -- pressure ------------------------------------------------------------------------------

    def _pressure(self, work: _Work, recent: _Recent, now: float) -> None:
        """Plan one pressure move if the free fractions are further apart than gap_frac."""
        nodes = self._balanceable(work, recent, now)
        if len(nodes) < 2:
            return
        frac = {v.node_id: work.free[v.node_id] / v.pages_total for v in nodes}
        src = min(nodes, key=lambda v: (frac[v.node_id], v.node_id))
        dst = min(nodes, key=lambda v: (-frac[v.node_id], v.node_id))
        if frac[dst.node_id] - frac[src.node_id] <= self.gap_frac or src is dst:
            return
        if self._ping_pong(recent, src.node_id, dst.node_id, now, "pressure"):
            return
        # Moving p pages changes the difference in free pages by 2p: half the difference evens them.
        half = (work.free[dst.node_id] - work.free[src.node_id]) / 2
        for req in _by_size(src.requests):
            if (0 < req.pages <= half and req.request_id not in work.planned
                    and not self._settling(recent, req, now) and self._fits(work, req.pages, dst)):
                work.add(Move(req.request_id, src.node_id, dst.node_id, "pressure"), req.pages)
                return

    # -- shared checks -------------------------------------------------------------------------

    def _balanceable(self, work: _Work, recent: _Recent, now: float) -> list[DecodeView]:
        """Nodes that may be source or target of a fair or pressure move now, in node_id order."""
        out = []
        for v in work.views.values():
            last = recent.node_at.get(v.node_id)
            if v.draining or v.pages_total <= 0 or work.in_flight[v.node_id] >= self.max_in_flight:
                continue
            if last is None or now - last >= self.interval_s:
                out.append(v)
        return out

    def _fits(self, work: _Work, pages: int, target: DecodeView) -> bool:
        headroom = math.ceil(self.headroom_frac * target.pages_total - _EPS)
        return pages <= work.free[target.node_id] - headroom

    def _settling(self, recent: _Recent, req: ReqView, now: float) -> bool:
        at = recent.request_at.get(req.request_id)
        return at is not None and now - at < self.settle_s

    def _ping_pong(self, recent: _Recent, source: str, target: str, now: float, reason: str) -> bool:
        at = recent.pair_at.get((target, source, reason))
        return at is not None and now - at < self.settle_s

    def _index(self) -> _Recent:
        recent = _Recent()
        for at, m in self._records:
            recent.node_at[m.source] = recent.node_at[m.target] = at
            recent.request_at[m.request_id], recent.request_from[m.request_id] = at, m.source
            recent.pair_at[(m.source, m.target, m.reason)] = at
        return recent

    def _forget(self, now: float) -> None:
        while self._records and now - self._records[0][0] >= self._keep_s:
            self._records.popleft()


def _waiting_tenants(view: DecodeView) -> set[str]:
    return {t for t, n in view.tenant_waiting.items() if n > 0}
