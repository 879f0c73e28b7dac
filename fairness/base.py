"""`BasePolicy` answers every method of the declared interface (fairness/interface.py, where
the call order is) with first-come first-served defaults; each policy file overrides only
what it changes. Policies take the clock from `SchedState`.

Hooks a subclass may override besides the interface's methods: `choose_victim` (the victim
among candidates after the progress guarantee), `_place` (an arrival's placement after the
idle-pool rule), `victim` (a function of fairness/eviction.py), `Settings` (its own settings).
"""
from __future__ import annotations

from fairness import eviction
from fairness.config import FairnessConfig
from fairness.interface import Arrival, Placement, QuotaView
from fairness.owners import quota_owner
from fairness.settings import NoSettings, PolicySettings
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


HELD_TTL_S = 5.0  # a deferred arrival not retried within this long is forgotten
# A deferred arrival keeps its place in line (later arrivals wait behind it) only while it is
# retried here: the prefill side retries a refused hand-off within 0.1 s, at this node or, with
# fallbacks, at the next one, where it may be taken. One that landed elsewhere must not make this
# node defer every later arrival (each of which then lands elsewhere too, leaving this node idle).
HELD_ORDER_S = 1.0


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
        self._bw: dict[str, tuple[float, float]] = {}  # tenant -> (bucket bytes, when last charged): the cap
        self._bw_left: dict[str, float] = {}  # tenant -> bytes it may still read this step (with a cap)
        self.held: dict[str, Arrival] = {}  # arrivals deferred to the prefill side, by request id
        self.incoming: dict[str, Arrival] = {}  # placed on the device tier, pages RESERVED, not yet adopted
        self.running: list[Sequence] = []
        self.candidates: list[Sequence] = []
        if self.cfg.tenant_bw_cap is not None:
            self.on_steps = None  # the cap's bucket is read every step: no run is taken at once

    # ---- per step --------------------------------------------------------------------------
    def reclaim(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        self.refresh(running, candidates, state)
        return []

    def refresh(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> None:
        """Bring the policy's view of the node up to date. Every step begins with it (through
        `reclaim`); the decode node also calls it before placing an arrival, since an idle node
        does not step and its view would be that of its last step (tenants long gone)."""
        self.running, self.candidates = running, candidates
        if self.incoming:  # adopted (now running or parked) or failed (its pages are gone)
            known = {s.request_id for s in running} | {s.request_id for s in candidates}
            self.incoming = {r: a for r, a in self.incoming.items() if r not in known and r in state.pages}

    def step_order(self, running: list[Sequence], state: SchedState) -> list[Sequence]:
        """Running rows in order, within each tenant's bandwidth budget when a cap is set.

        The budget is a token bucket per tenant: it refills at the cap (bytes/s) up to one
        window's worth, and every row that steps costs the bytes its attention reads. A row
        steps only if its cost fits the bucket, or, for a row costing more than a whole window,
        when the bucket is full (the bucket then goes negative and refills before the tenant
        reads again). Over any stretch a tenant reads at most the cap, plus one window of burst."""
        if self.cfg.tenant_bw_cap is None:
            return running
        self._bw_left = {}
        out = []
        for s in running:
            if self._bw_take(s.tenant, state.pages.get(s.request_id, 0) * state.page_bytes, state):
                out.append(s)
        return out

    def _bw_take(self, tenant: str, nbytes: int, state: SchedState) -> bool:
        """Reserve `nbytes` of `tenant`'s bucket for this step; False if it does not fit."""
        if not self._bw_fits(tenant, nbytes, state):
            return False
        self._bw_left[tenant] -= nbytes
        return True

    def _bw_fits(self, tenant: str, nbytes: int, state: SchedState) -> bool:
        """Whether `nbytes` fit `tenant`'s bucket this step (its level is read once a step)."""
        burst = self.cfg.tenant_bw_cap * self.cfg.bw_window_s
        left = self._bw_left.get(tenant)
        if left is None:
            left = self._bw_left[tenant] = self._bw_level(tenant, state)
        return nbytes <= left or (nbytes > burst and left >= burst)

    def _bw_level(self, tenant: str, state: SchedState) -> float:
        """The tenant's bucket now: refilled at the cap since it was last charged, at most a window."""
        burst = self.cfg.tenant_bw_cap * self.cfg.bw_window_s
        level, since = self._bw.get(tenant, (burst, state.now))
        return min(burst, level + self.cfg.tenant_bw_cap * max(0.0, state.now - since))

    def chunk_limit(self, seq: Sequence, budget: int, state: SchedState) -> int:
        return budget

    def admission_order(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        return sorted(candidates, key=lambda s: s.arrival_time)

    def may_admit(self, seq: Sequence, need_pages: int, state: SchedState) -> bool:
        # Watermark: leave a page per running request for its next token, so that admitting
        # one request does not force an eviction on the very next step (admit/evict thrash).
        headroom = len(self.running) + self._reserved(seq, state)
        need_pages = self._admit_pages(seq, need_pages, state)
        if need_pages + headroom > state.device_free:
            return False
        if self.cfg.tenant_bw_cap is not None:  # its first step reads its pages too
            return self._bw_fits(seq.tenant, (state.pages.get(seq.request_id, 0) + need_pages) * state.page_bytes, state)
        return True

    def admitted(self, seq: Sequence, need_pages: int, state: SchedState) -> None:
        """With a bandwidth cap, the admitted request's first read is charged to its tenant."""
        if self.cfg.tenant_bw_cap is not None:
            need_pages = self._admit_pages(seq, need_pages, state)
            self._bw_left[seq.tenant] -= (state.pages.get(seq.request_id, 0) + need_pages) * state.page_bytes

    @staticmethod
    def _admit_pages(seq: Sequence, need_pages: int, state: SchedState) -> int:
        """A recompute starts only when its whole context fits: admitted chunk by chunk, it would
        be the first victim again before its prefill ends, and the work is lost."""
        if seq.num_preemptions and not seq.num_computed_tokens:
            return max(need_pages, -(-(seq.num_tokens + 1) // state.page_size))
        return need_pages

    def pick_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        candidates = self.spare_oldest(candidates, state)
        if self.cfg.victim is not None:  # the victim choice, swapped in by name (--victim)
            return self._named_victim(candidates, state)
        return self.choose_victim(candidates, requester, state)

    def _named_victim(self, candidates: list[Sequence], state: SchedState) -> Sequence:
        from fairness.quotas import entitlements, usage

        if self.cfg.victim != "footprint":
            return eviction.VICTIMS[self.cfg.victim](candidates, state)
        owners = {self.owner(s) for s in self.running} | {self.owner(s) for s in self.candidates}
        ent = entitlements(owners, self.cfg, state.device_total)
        use = usage(self.running, state, self.owner)
        return eviction.footprint(candidates, state, {o: use.get(o, 0) / e for o, e in ent.items() if e > 0},
                                  self.owner)

    def choose_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        """The policy's victim among `candidates` (never empty)."""
        return self.victim(candidates, state)

    def spare_oldest(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        """The progress guarantee every policy keeps: the oldest running request is not dropped
        for recompute while another candidate can go instead (it may still be demoted, which
        loses no work). Without it two requests that fit only one at a time can preempt each
        other forever, each redoing its prefill and losing it again (memfair did, by
        footprint). With it the oldest always finishes, and then the next oldest."""
        if len(candidates) < 2 or not self.running:
            return candidates
        oldest = self.oldest_running()
        if oldest not in candidates or self._demotable(oldest, state):
            return candidates
        return [c for c in candidates if c is not oldest]

    def oldest_running(self) -> Sequence | None:
        """The running request every policy lets go on (spare_oldest): the first to arrive."""
        return min(self.running, key=lambda s: (s.arrival_time, s.request_id), default=None)

    @staticmethod
    def _demotable(seq: Sequence, state: SchedState) -> bool:
        """Evicting `seq` now would demote it to the host tier (scheduler.evict), not preempt it."""
        n = state.pages.get(seq.request_id, 0)
        return 0 < n <= state.host_free and seq.num_computed_tokens > 0

    def on_step(self, chunks: list, state: SchedState) -> None:
        if self.cfg.tenant_bw_cap is None:
            return
        spent: dict[str, int] = {}
        for c in chunks:  # attention reads every page of the request once per step
            spent[c.seq.tenant] = spent.get(c.seq.tenant, 0) + state.pages.get(c.seq.request_id, 0) * state.page_bytes
        for t, nbytes in spent.items():
            self._bw[t] = (self._bw_level(t, state) - nbytes, state.now)

    def on_steps(self, chunks: list, state: SchedState, starts: list[float]) -> None:
        """Runs of decode steps taken at once (fairness/interface.py): nothing to count here."""

    # ---- arrivals of inherited requests (decode side) ---------------------------------------------
    def place_arrival(self, arrival: Arrival, queued: int, state: SchedState) -> Placement:
        """Where an inherited request's pages go: DEVICE, HOST (parked until admitted in
        policy order) or DEFER (the prefill side keeps them and retries; the arrival is
        remembered in `held` so that policies can make room for it)."""
        prev = self.held.get(arrival.request_id)
        if prev is not None:  # a retry keeps its place in line
            arrival.first_seen = prev.first_seen
        others_held = [h for h in self.fresh_held(state) if h.request_id != arrival.request_id]
        idle = queued == 0 and not self.running and not self.candidates and \
            not [r for r in self.incoming if r != arrival.request_id]
        if idle and arrival.num_pages <= state.device_free and \
                not any(h.first_seen < arrival.first_seen for h in others_held):
            # Work conservation, as in admission: an idle pool takes the oldest arrival that
            # fits whatever the quotas say (otherwise held arrivals each above their share
            # refuse each other's borrowing on an empty pool, forever).
            where = Placement.DEVICE
        else:
            where = self._place(arrival, queued, state)
        if where is Placement.DEVICE:
            self.held.pop(arrival.request_id, None)
            self.incoming[arrival.request_id] = arrival  # its reserved pages count for its quota owner
        else:
            self.held[arrival.request_id] = arrival
        return where

    def incoming_pages(self, state: SchedState) -> dict[str, int]:
        """Device pages reserved per quota owner for arrivals placed there but not yet adopted:
        they are the owner's as surely as its running requests' pages."""
        out: dict[str, int] = {}
        for rid, a in self.incoming.items():
            o = self.owner(a)
            out[o] = out.get(o, 0) + max(state.pages.get(rid, 0), a.num_pages)
        return out

    def _place(self, arrival: Arrival, queued: int, state: SchedState) -> Placement:
        headroom = len(self.running) + self._reserved(arrival, state)  # a page per running request
        older_held = any(h.first_seen < arrival.first_seen and h.request_id != arrival.request_id
                         for h in self.fresh_held(state))
        if queued == 0 and not older_held and arrival.num_pages + headroom <= state.device_free:
            return Placement.DEVICE
        return self.park_or_defer(arrival, state)

    @staticmethod
    def park_or_defer(arrival: Arrival, state: SchedState) -> Placement:
        """HOST if the host tier has room for the arrival, else DEFER."""
        return Placement.HOST if arrival.num_pages <= state.host_free else Placement.DEFER

    def waiting_arrivals(self, state: SchedState) -> list[Arrival]:
        return self.fresh_held(state)

    def forget(self, request_id: str) -> None:
        # (`incoming` is left to `refresh`: an aborted arrival's pages stay reserved until its
        # transfer ends, and count for its owner until then)
        self.held.pop(request_id, None)

    def quotas(self) -> QuotaView:
        return QuotaView()

    def _reserved(self, req, state: SchedState) -> int:
        """Free pages `req` (a Sequence or an Arrival: its priority) may not take: the unused
        reservations of more urgent classes."""
        from fairness.quotas import reserved_for_others

        return reserved_for_others(req, self.running, self.cfg, state) if self.cfg.class_reservations else 0

    def live_held(self, state: SchedState) -> list[Arrival]:
        """Deferred arrivals still being retried (expired ones are dropped)."""
        for rid in [r for r, h in self.held.items() if state.now - h.last_seen > HELD_TTL_S]:
            del self.held[rid]
        return list(self.held.values())

    def fresh_held(self, state: SchedState) -> list[Arrival]:
        """Deferred arrivals retried here within HELD_ORDER_S: those later arrivals queue behind."""
        return [h for h in self.live_held(state) if state.now - h.last_seen <= HELD_ORDER_S]

    # ---- helpers --------------------------------------------------------------------------------
    def owner(self, req) -> str:
        """The quota owner of `req` (a Sequence or an Arrival): fairness/owners.py."""
        return quota_owner(req, self.cfg)
