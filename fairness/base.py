"""`BasePolicy` answers every method of the declared interface (fairness/interface.py, where
the call order is) with first-come first-served defaults; each policy file overrides only
what it changes. Policies take the clock from `SchedState`. It composes the mechanism every
policy shares: a bandwidth cap (fairness/bandwidth.py), the inherited arrivals' book and the
idle-pool rule (fairness/arrivals.py), the progress guarantee (fairness/eviction.py).

Hooks a subclass may override besides the interface's methods: `choose_victim` (the victim
among candidates after the progress guarantee), `_place` (an arrival's placement after the
idle-pool rule), `victim` (a function of fairness/eviction.py), `Settings` (its own settings).
"""
from __future__ import annotations

from fairness import eviction
from fairness.arrivals import ArrivalBook, park_or_defer
from fairness.bandwidth import BandwidthBucket
from fairness.config import FairnessConfig
from fairness.interface import Arrival, Placement, QuotaView
from fairness.owners import quota_owner
from fairness.settings import NoSettings, PolicySettings
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


class BasePolicy:
    name = "base"
    strict_order = True  # FIFO admission: nothing overtakes the head
    victim = staticmethod(eviction.lru)
    Settings: type[PolicySettings] = NoSettings  # the policy's own settings (--policy-arg)
    cluster = None  # ClusterView of the other nodes, set by the node (fairness/cluster.py; None: alone)

    def __init__(self, config: FairnessConfig | None = None, settings: PolicySettings | None = None) -> None:
        self.cfg = config or FairnessConfig()
        self.settings = settings if settings is not None else type(self).Settings()
        if not isinstance(self.settings, type(self).Settings):
            raise TypeError(f"{type(self).__name__} takes {type(self).Settings.__name__}, "
                            f"got {type(self.settings).__name__}")
        self.bw = None if self.cfg.tenant_bw_cap is None else BandwidthBucket(self.cfg.tenant_bw_cap,
                                                                              self.cfg.bw_window_s)
        self.arrivals = ArrivalBook()
        self.held, self.incoming = self.arrivals.held, self.arrivals.incoming  # by request id
        self.running: list[Sequence] = []
        self.candidates: list[Sequence] = []
        if self.bw is not None:
            self.on_steps = None  # the cap's bucket is read every step: no run is taken at once

    def reclaim(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        self.refresh(running, candidates, state)
        return []

    def refresh(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> None:
        """Bring the policy's view of the node up to date. Every step begins with it (through
        `reclaim`); the decode node also calls it before placing an arrival, since an idle node
        does not step and its view would be that of its last step (tenants long gone)."""
        self.running, self.candidates = running, candidates
        self.arrivals.adopted(running, candidates, state)

    def step_order(self, running: list[Sequence], state: SchedState) -> list[Sequence]:
        """Running rows in order, within each tenant's bandwidth budget when a cap is set."""
        return running if self.bw is None else self.bw.rows(running, state)

    def chunk_limit(self, seq: Sequence, budget: int, state: SchedState) -> int:
        return budget

    def admission_order(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        return sorted(candidates, key=lambda s: s.arrival_time)

    def may_admit(self, seq: Sequence, need_pages: int, state: SchedState) -> bool:
        # Watermark: leave a page per running request for its next token, so that admitting
        # one request does not force an eviction on the very next step (admit/evict thrash).
        headroom = len(self.running) + self._reserved(seq, state)
        need_pages = eviction.recompute_pages(seq, need_pages, state)
        if need_pages + headroom > state.device_free:
            return False
        return self.bw is None or self.bw.fits(seq.tenant, self.bw.first_read(seq, need_pages, state), state)

    def admitted(self, seq: Sequence, need_pages: int, state: SchedState) -> None:
        """With a bandwidth cap, the admitted request's first read is charged to its tenant."""
        if self.bw is not None:
            need_pages = eviction.recompute_pages(seq, need_pages, state)
            self.bw.spend(seq.tenant, self.bw.first_read(seq, need_pages, state))

    def pick_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        candidates = eviction.spare_oldest(candidates, self.running, state)
        if self.cfg.victim is not None:  # the victim choice, swapped in by name (--victim)
            return eviction.named(self.cfg, candidates, self.running, self.candidates, state, self.owner)
        return self.choose_victim(candidates, requester, state)

    def choose_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        """The policy's victim among `candidates` (never empty)."""
        return self.victim(candidates, state)

    def oldest_running(self) -> Sequence | None:  # (eviction.spare_oldest spares it)
        return eviction.oldest(self.running)

    _demotable = staticmethod(eviction.demotable)

    def on_step(self, chunks: list, state: SchedState) -> None:
        if self.bw is not None:
            self.bw.charge(chunks, state)

    def on_steps(self, chunks: list, state: SchedState, starts: list[float]) -> None:
        """Runs of decode steps taken at once (fairness/interface.py): nothing to count here."""

    def place_arrival(self, arrival: Arrival, queued: int, state: SchedState) -> Placement:
        """DEVICE, HOST (parked until admitted in policy order) or DEFER (the prefill side retries;
        kept in `held`): an idle pool takes the oldest that fits, else `_place` decides."""
        self.arrivals.offered(arrival)
        busy = bool(self.running or self.candidates)
        where = Placement.DEVICE if self.arrivals.idle_takes(arrival, queued, busy, state) else \
            self._place(arrival, queued, state)
        self.arrivals.placed(arrival, where)
        return where

    def incoming_pages(self, state: SchedState) -> dict[str, int]:
        return self.arrivals.incoming_pages(self.owner, state)

    def _place(self, arrival: Arrival, queued: int, state: SchedState) -> Placement:
        headroom = len(self.running) + self._reserved(arrival, state)  # a page per running request
        older_held = any(h.first_seen < arrival.first_seen and h.request_id != arrival.request_id
                         for h in self.fresh_held(state))
        if queued == 0 and not older_held and arrival.num_pages + headroom <= state.device_free:
            return Placement.DEVICE
        return self.park_or_defer(arrival, state)

    park_or_defer = staticmethod(park_or_defer)

    def waiting_arrivals(self, state: SchedState) -> list[Arrival]:
        return self.fresh_held(state)

    def forget(self, request_id: str) -> None:
        self.held.pop(request_id, None)  # (`incoming`: left to `refresh`, reserved until the transfer ends)

    def quotas(self) -> QuotaView:
        return QuotaView()

    def _reserved(self, req, state: SchedState) -> int:
        """Free pages `req` (a Sequence or an Arrival) may not take: more urgent classes' reservations."""
        from fairness.quotas import reserved_for_others

        return reserved_for_others(req, self.running, self.cfg, state) if self.cfg.class_reservations else 0

    def live_held(self, state: SchedState) -> list[Arrival]:
        return self.arrivals.live(state)

    def fresh_held(self, state: SchedState) -> list[Arrival]:
        return self.arrivals.fresh(state)

    def owner(self, req) -> str:
        """The quota owner of `req` (a Sequence or an Arrival): fairness/owners.py."""
        return quota_owner(req, self.cfg)
