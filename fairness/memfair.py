"""`memfair`: memory-fair admission and prefill, with the same defaults at every scale.

Rule card (an "owner" is a quota owner, fairness/owners.py: a tenant by default):
- Shares: each owner with work is entitled to its weighted share of the device tier (static shares:
  each seen with work within static_window_s); on one of several nodes, its share of all the pools.
- Admission: the longest-starving request first, then the owners furthest below their share; a
  request that does not fit blocks nobody. One waiting starve_after_s gets in whatever its quota.
  Without a host tier a prompt gets in only when all of it fits beside what the running prompts
  of owners within their shares still take (a prompt let in on its first chunk sat on its pages).
- Borrowing beyond a share: only while no other owner waits within its own, leaving free the pages
  the running prompts still take and one typical request of each owner with unused share.
- Reclaim: a waiter within its share demotes the most over-share owner's largest requests, only
  if all it needs then fits (without host room, reclaim_drop may drop them for recompute instead,
  least computed first); a request moved between tiers stays put starve_after_s.
- The step: decode rows always step; prompts split the rest (a quarter of each owner's max-min share
  to its oldest, then smallest first), each chunk within an ordinary step's price.
- Victims: the most over-share owner's, demoted largest first, else dropped least-computed first.

Each rule is a pure function of fairness/memfair_rules.py, told in full there; this class builds the
step's frozen view once, in `refresh` (O(requests)), and asks them (an admission test: O(owners)).
"""
from __future__ import annotations

from fairness import memfair_rules as rules
from fairness.base import BasePolicy
from fairness.interface import Placement, QuotaView
from fairness.memfair_rules import PrefillPlan, StepView, pages_for
from fairness.memfair_settings import MemFairSettings
from fairness.owners import owner_name
from fairness.quotas import entitlements
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


class MemFairPolicy(BasePolicy):
    name = "memfair"
    strict_order = False  # a request that does not fit does not block the ones behind it
    Settings = MemFairSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.static = self.settings.quota_shares == "static"  # no lending, no borrowing of shares
        self.view = StepView()  # the step's view, built by `refresh`
        self._granted: list[tuple[str, int]] = []  # (owner, device pages) granted since the view, in order
        # memory across steps
        self._known: dict[str, float] = {}  # static shares: owner -> state.now when last seen with work
        self._since: dict[str, float] = {}  # candidate -> state.now since when it waits for device pages
        self._moved: dict[str, float] = {}  # request -> state.now it last changed tiers (promoted, demoted)
        self._size: dict[str, float] = {}  # owner -> its typical request size in pages
        self._owners: dict[str, str] = {}  # request -> its quota owner
        # dynamic shares, and what they were last computed from (owners and pool; the other nodes)
        self._shares_now, self._shares_key, self._shares_cluster = {}, None, None
        # this step's plan, from step_order, and what chunk_limit gave out of it
        self._caps: dict[str, int] = {}  # borrower's prompt -> tokens its chunk may take
        self._plan = PrefillPlan()
        self._added = (0, 0, 0)  # prefill chunks, tokens, query-key pairs given out this step
        self._pending: tuple[str, int] = ("", 0)  # the candidate chunk_limit last sized, and its chunk
        # without a host tier: pages promised to prompts, those running within their owners' shares
        # (rules.promised) and those let in since the view
        self._promised = 0

    shares = property(lambda self: self.view.shares, doc="Entitlement per owner with a share.")
    over = property(lambda self: self.view.over, doc="Use / entitlement per owner with a share.")

    ent = property(lambda self: {owner_name(o): e for o, e in self.shares.items()},
                   doc="Entitlement per owner's name (tenant, class, request id or tier), as the node reports it.")

    def quotas(self) -> QuotaView:
        return QuotaView(self.ent, dict(self.shares))

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._since.pop(request_id, None)
        self._moved.pop(request_id, None)
        self._owners.pop(request_id, None)

    def owner(self, req) -> str:
        """The quota owner, remembered per request (asked many times a step)."""
        o = self._owners.get(req.request_id)
        if o is None:
            o = self._owners[req.request_id] = super().owner(req)
        return o

    # ---- the view, once per step ------------------------------------------------------------------
    def refresh(self, running, candidates, state):
        super().refresh(running, candidates, state)
        own, now, prev = self.owner, state.now, self.view
        use, ids, growth_by = rules.usage(running, state.charge, state.pages, state.page_size, own)
        growth = sum(growth_by.values())
        owners = set(use)  # the owners with work: running, waiting, parked or held (not only landing)
        for o, n in self.incoming_pages(state).items():
            use[o] = use.get(o, 0) + n
        owners.update(own(s) for s in candidates)
        owners.update(own(h) for h in self.live_held(state))
        shares = self._shares(owners, state)
        for rid in (ids - prev.running_ids) & prev.parked_ids:  # promoted since the last look
            self._moved[rid] = now
        since, new = rules.waiting_since(candidates, self._since, now)
        for c in new:  # a request first seen waiting: its size is its owner's typical one
            o = own(c)
            self._size[o] = rules.typical_size(self._size.get(o), pages_for(c.num_tokens, state.page_size))
        horizon = now - self.settings.starve_after_s
        self.view = rules.build_view(ids, candidates, self.fresh_held(state), use, shares, growth, since, horizon,
                                     state, own)
        self._since, self._granted = since, []
        self._promised = 0 if state.host_total else rules.promised(growth_by, use, shares)
        if self._moved:
            self._moved = {r: t for r, t in self._moved.items() if t > horizon}

    def _shares(self, owners: set[str], state: SchedState) -> dict[str, float]:
        """Entitlements (rules.owner_shares). Dynamic shares change only with the owners, the
        pool or the view of the other nodes; static ones go to every owner in the window, each
        a share of this node's pool."""
        if self.static:  # an idle owner's share is kept for it, not lent
            self._known = rules.static_window(self._known, owners, state.now, self.settings.static_window_s,
                                              self.cfg.quota_by == "request")
            return rules.owner_shares(set(self._known), self.cfg, state.device_total, None)
        key = (frozenset(owners), state.device_total)
        if key != self._shares_key or self.cluster is not self._shares_cluster:
            self._shares_key, self._shares_cluster = key, self.cluster
            self._shares_now = rules.owner_shares(owners, self.cfg, state.device_total, self.cluster)
        return self._shares_now

    def _use(self) -> dict[str, float]:
        """Device pages per owner now: the view's, and the pages granted since (admissions, arrivals)."""
        return rules.with_grants(self.view.use, self._granted)

    def _starving(self, seq: Sequence, state: SchedState) -> bool:
        return state.now - self._since.get(seq.request_id, state.now) >= self.settings.starve_after_s

    def _held_down(self, rid: str, state: SchedState) -> bool:
        return rules.recently_moved(self._moved.get(rid), state.now, self.settings.starve_after_s)

    # ---- reclaim ----------------------------------------------------------------------------------
    def reclaim(self, running, candidates, state):
        super().reclaim(running, candidates, state)  # refreshes the view
        v, own = self.view, self.owner
        if not any(n > v.shares.get(o, 0) for o, n in v.use.items()):
            return []  # nobody beyond its share: nobody to demote
        wants = rules.reclaim_wants(candidates, self.fresh_held(state), v, state, own,
                                    lambda c: not self._starving(c, state))
        movable = [s for s in running if s.num_computed_tokens > 0 and not self._held_down(s.request_id, state)]
        victims = rules.reclaim_victims(wants, movable, self._use(), v.shares, state, len(running), own,
                                        self.settings.reclaim_drop)
        for s in victims:
            self._moved[s.request_id] = state.now
        return victims

    # ---- admission and placement ------------------------------------------------------------------
    def admission_order(self, candidates, state):
        first, over, own = self.view.starved, self.view.over, self.owner
        return sorted(candidates, key=lambda s: (s.request_id != first, over.get(own(s), 0.0), s.arrival_time))

    def may_admit(self, seq, need, state):
        """Asked after `chunk_limit` sized the candidate's chunk (the scheduler's order); no side
        effect: a yes is booked by `admitted`."""
        if not super().may_admit(seq, need, state):
            return False
        rid, owner = seq.request_id, self.owner(seq)
        if self._plan.allot and self._pending[0] == rid and rid not in self._plan.allot:
            return False  # a prompt with no part of this step waits for one
        if not self._fits_whole(seq, state):
            return False
        use = self._use()
        if not self._keeps_room(rid, owner, need, use, state):
            return False
        if self._starving(seq, state):
            return True
        if self._held_down(rid, state) and use.get(owner, 0) + need > self.view.shares.get(owner, 0):
            return False  # demoted lately as a borrower: it does not borrow straight back
        rest = pages_for(seq.num_prompt_tokens, state.page_size) - state.pages.get(rid, 0) - need
        return self._quota_ok(owner, need, use, state, max(0, rest))

    def _place(self, arrival, queued, state):
        """The device tier when `may_admit` would let it in there, else parked or deferred; with
        static shares, an arrival held `starve_after_s` as a starving request (without a host tier
        it would wait at the prefill side while the owners it may not borrow from are in the window)."""
        owner, pages, use = self.owner(arrival), arrival.num_pages, self._use()
        headroom = len(self.running) + self._reserved(arrival, state)  # as may_admit: class reservations too
        fits = pages + headroom <= state.device_free and \
            self._keeps_room(arrival.request_id, owner, pages, use, state)
        if arrival.request_id not in self.held:
            self._size[owner] = rules.typical_size(self._size.get(owner), pages)
        if fits and self.static and state.now - arrival.first_seen >= self.settings.starve_after_s:
            return Placement.DEVICE
        if fits and self._quota_ok(owner, pages, use, state):
            self._granted.append((owner, pages))
            return Placement.DEVICE
        return self.park_or_defer(arrival, state)

    def admitted(self, seq, need_pages, state):
        """The pages granted to the owner until the next view (the scheduler checked they fit)."""
        super().admitted(seq, need_pages, state)
        self._granted.append((self.owner(seq), need_pages))
        if not state.host_total and not seq.num_computed_tokens:
            self._promised += max(0, rules.need_on(seq, state) - need_pages)

    def _fits_whole(self, seq: Sequence, state: SchedState) -> bool:
        """Without a host tier, a prompt gets in only when all of it fits beside what the running
        prompts within their owners' shares still take (rules.need_on, rules.promised), and the
        prompts let in since the view: one let in on its first chunk could sit on its pages."""
        if state.host_total or seq.num_computed_tokens:
            return True
        return rules.need_on(seq, state) + len(self.running) + self._promised <= state.device_free

    def _keeps_room(self, rid: str, owner: str, need: int, use: dict, state: SchedState) -> bool:
        return rules.keeps_room_for_starved(self.view, rid, owner, need, use, state.device_free - len(self.running),
                                            state.device_total)

    def _quota_ok(self, owner: str, need: int, use: dict, state: SchedState, prompt: int = 0) -> bool:
        """An owner new to this step gets its share carved out as if it had been there."""
        shares = self.view.shares
        ent = shares if owner in shares else entitlements(set(shares) | {owner}, self.cfg, state.device_total)
        return rules.quota_ok(owner, need, ent, use, state.device_free, prompt=prompt, static=self.static,
                              within=self.view.within, growth=self.view.growth, size=self._size)

    # ---- the step ---------------------------------------------------------------------------------
    def step_order(self, running, state):
        rows, v = super().step_order(running, state), self.view
        waiting = sum(v.within_pages.values()) + v.starved_need
        self._caps = {}
        if waiting:  # a borrower's prompt does not grow into the pages waiters need
            rows, self._caps = rules.growth_caps(rows, waiting, v, self._use(), state, self.oldest_running(),
                                                 self.owner)
        self._plan = rules.plan_prefill(rows, self.candidates, v.needs, state, self.owner,
                                        lambda o: self.cfg.weight(owner_name(o)), self._promised)
        self._added = (0, 0, 0)
        # Under-share owners first, the tail (evicted first under pressure) the most over; within
        # each, decode rows before prompts, so that a prompt's chunk never takes their token.
        borrowing = {o for o, x in v.over.items() if x > 1.0}
        if not borrowing and not self._plan.prompts:
            return rows  # decode rows only, nobody borrowing: nothing to reorder
        own = self.owner
        return sorted(rows, key=lambda s: (own(s) in borrowing, s.in_prefill, s.arrival_time))

    def chunk_limit(self, seq, budget, state):
        """At most the prompt's part of this step (a token if it has none), what its owner may grow
        into, and what keeps the step an ordinary one beside the other owners' decode rows."""
        rid = seq.request_id
        budget, allot = min(budget, self._caps.get(rid, budget)), self._plan.allot
        if not allot:
            return self._within_step_time(seq, min(budget, seq.num_uncomputed_tokens), state)
        n = max(1, min(budget, seq.num_uncomputed_tokens, allot.get(rid, 0)))  # the scheduler's chunk
        if rid not in self.view.running_ids:
            self._pending = (rid, n)  # a candidate: let in by may_admit only with a part of the step
        return self._within_step_time(seq, n, state)

    def _within_step_time(self, seq: Sequence, n: int, state: SchedState) -> int:
        """`n` bounded by the step's price when another owner has decode rows in the step."""
        price, owner = state.step_s, self.owner(seq)
        if price is None or n <= 0 or not any(o != owner for o in self._plan.decode):
            return n
        rows, ctx = self._plan.decode_total
        start = seq.num_computed_tokens
        k = rules.chunk_within_step_time(price, n, start, rows, ctx, self._added, state.token_budget,
                                         state.page_size)
        self._added = rules.with_chunk(self._added, k, start)
        return k

    def choose_victim(self, candidates, requester, state):
        return rules.choose_victim(candidates, self.view.over, self.owner, state, self._demotable,
                                   lambda: self._chunk_waits(requester))

    def _chunk_waits(self, requester) -> bool:
        """A prompt's next chunk waits for pages rather than drop another request's computed work,
        while some running request decodes (its pages come free as it ends) and the requester is
        not the oldest running one (which always goes on: eviction.spare_oldest)."""
        return requester.in_prefill and requester is not self.oldest_running() \
            and any(not s.in_prefill for s in self.running)
