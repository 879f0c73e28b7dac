"""`memfair`: memory-fair admission and prefill, with the same defaults at every scale.

A "tenant" below is a quota owner (fairness/owners.py, `quota_by`): a tenant by default, or a
priority class, a request, an SLO tier. Everything here is keyed by it. Long requests are not
limited for being long: each owner is charged for the memory and the step it takes, and gets
its weighted share of both whenever someone else wants theirs.

- Memory shares. Each owner with work is entitled to its weighted share of the device tier
  (static shares, `quota_shares="static"`: every owner seen with work within
  `static_window_s`, an idle owner's share kept for it, nobody beyond its share). On one of
  several decode nodes, told what the others hold (`self.cluster`), a tenant's share is
  cluster-wide: what it may claim here is its share of all the pools less what it holds on
  the others (fairness/cluster.py), so a tenant spread over four nodes does not get four.
- Admission. Candidates of the owners furthest below their share first; nothing waits behind
  a request that does not fit. A prompt is within its owner's share when all of it is (it is
  let in by its first chunk, but the rest follows). An owner may go beyond its share (borrow)
  only while no other owner waits with a request within its own share, and only leaving free
  the pages the running prompts and its own still take, and one typical request's pages (its
  recent requests' mean size) of each other owner with unused share, so that its next request
  does not have to take pages back from the borrower. Growth is admission too: a borrower's
  prompt does not grow into the free pages that requests within their owners' shares, or the
  longest-starving request, wait for (a step grows its running rows before it admits anyone);
  it sits the step out instead, unless it is the oldest running request.
- Reclaim. When a request within its owner's share waits and cannot fit, requests of owners
  beyond their share are demoted to the host tier (never preempted: a share is not worth
  lost work), the most over-share owner and largest footprint first, and only when that
  makes room for all the waiter needs now (a prompt: its first chunk). A request moved
  between tiers stays where it is for `starve_after_s`: a move copies its pages, and moving
  it back at once would copy them for nothing.
- The step. Each step's token budget, less a token per decode row, is split among the prompts
  to prefill when more than one owner has some: each owner gets a quarter of its weighted
  max-min share (PREFILL_FLOOR) for its oldest prompts, and the rest goes to the smallest
  prompts first, whoever's they are. A 2K prompt does not queue behind a 128K one, its
  owner's or another's; the 128K prompt keeps prefilling at its owner's floor at least, and
  with all the step the small ones leave. Decode rows always step, so a long request's
  inter-token time is its own size's cost, not a leftover. The step's time is bounded too: beside
  another owner's decode rows, the prompts' chunks make the step at most an ordinary one, what
  the same rows cost beside a budget of fresh prompt tokens (priced by the node's own fit of its
  steps, `SchedState.step_s`): a chunk deep into a long prompt, whose attention reads all the
  tokens before it, is cut to that price, so a minnow's inter-token time stays what any step of
  the node costs; a chunk gets at least a page whatever the price.
- Victims, when a row cannot grow: the most over-share owner's request; demoted, the largest
  footprint; dropped for recompute, the one with the least computed work. A prompt's next
  chunk drops nobody's work: where no one can be demoted it waits for pages (while someone
  decodes and it is not the oldest request), since a chunk can wait and lost work cannot
  come back.
- No starvation. A request waiting `starve_after_s` for device pages is let in whatever its
  quota, first in line, and while it waits nobody else takes the pages it needs: it gets in
  as pages free up. Nobody is demoted for it (a demotion is only ever for a request within
  its share: two owners beyond theirs would demote each other in turns).

Per-step cost: the owners' usage, shares and waiting needs are found once per step (one pass
over the running and waiting requests); each admission test then costs O(owners).
"""
from __future__ import annotations

import heapq

from fairness import eviction
from fairness.base import BasePolicy
from fairness.cluster import node_shares
from fairness.interface import Placement, QuotaView
from fairness.memfair_settings import MemFairSettings
from fairness.owners import owner_name
from fairness.quotas import entitlements, water_fill
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.step_shape import StepShape
from pdtb.engine.sequence import Sequence


RECLAIM_TRIES = 16  # waiting requests per step that may look for borrowers to demote
# An owner with prompts to prefill gets at least this part of its weighted max-min share of
# every step's tokens; the rest goes to the smallest prompts first. Smallest first keeps a 2K
# prompt from queueing behind a 128K one (whose size is the cost it makes visible); the floor
# keeps owners of small prompts that fill the node from starving the others.
PREFILL_FLOOR = 0.25
SIZE_MEMORY = 8  # an owner's typical request size: the mean of about its last this many requests


class MemFairPolicy(BasePolicy):
    name = "memfair"
    strict_order = False  # a request that does not fit does not block the ones behind it
    Settings = MemFairSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.static = self.settings.quota_shares == "static"  # no lending, no borrowing of shares
        self.use: dict[str, int] = {}  # device pages per quota owner, with arrivals landing (this step)
        self.shares: dict[str, float] = {}  # entitlement per owner with a share (with work; static: seen)
        self.over: dict[str, float] = {}  # use / entitlement
        self._known: dict[str, float] = {}  # static shares: owner -> state.now when last seen with work
        self._since: dict[str, float] = {}  # candidate -> state.now since when it waits for device pages
        self._moved: dict[str, float] = {}  # request -> state.now it last changed tiers (promoted, demoted)
        self._size: dict[str, float] = {}  # owner -> mean pages of its recent requests
        self._within: dict[str, int] = {}  # owner -> waiting requests within its share (this step)
        self._within_pages: dict[str, int] = {}  # owner -> device pages those requests need now
        self._cap: dict[str, int] = {}  # borrower's prompt -> tokens its chunk may take (this step)
        self._growth = 0  # device pages the running prompts take before their prompts are in (this step)
        self._allot: dict[str, int] = {}  # prompt -> tokens it may take this step (empty: no split)
        self._running_ids: set[str] = set()
        self._owners: dict[str, str] = {}  # request -> its quota owner
        self._prompts = 0  # prompts with tokens to prefill (this step)
        self._shares_key: tuple | None = None  # what the shares were last computed from
        self._shares_now: dict[str, float] = {}
        self._shares_view = None
        self._needs: dict[str, int] = {}  # candidate -> pages it needs to step (this step)
        self._parked_ids: set[str] = set()  # candidates in the host tier at the last look
        self._starved: tuple[str, int] = ("", 0)  # the longest-starving candidate and the pages it needs now
        self._pending: tuple[str, int] = ("", 0)  # the candidate chunk_limit last sized, and its chunk
        self._decode: dict[str, tuple[int, int]] = {}  # owner -> (decode rows, their context) this step
        self._added = (0, 0, 0)  # prefill chunks, tokens, query-key pairs given out this step
        self._decode_total = (0, 0)  # all owners' decode rows and their context this step

    @property
    def ent(self) -> dict[str, float]:
        """Entitlement per owner's name (tenant, class, request id or tier, fairness/owners.py),
        as the node reports it."""
        return {owner_name(o): e for o, e in self.shares.items()}

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

    # ---- the view, once per step ----------------------------------------------------------------
    def refresh(self, running, candidates, state):
        super().refresh(running, candidates, state)
        own = self.owner
        held = self.live_held(state)
        use: dict[str, int] = {}  # usage (quotas.usage) and the owners with work, in one pass
        charge, ids, known, pages, ps, growth = state.charge, set(), self._owners, state.pages, state.page_size, 0
        for s in running:
            rid = s.request_id
            o = known.get(rid) or own(s)
            use[o] = use.get(o, 0) + charge.get(rid, 0)
            ids.add(rid)
            if s.num_computed_tokens < s.num_prompt_tokens:
                growth += max(0, -(-s.num_prompt_tokens // ps) - pages.get(rid, 0))
        self._growth = growth
        owners = set(use)
        for o, n in self.incoming_pages(state).items():
            use[o] = use.get(o, 0) + n
        self.use = use
        owners.update(own(s) for s in candidates)
        owners.update(own(h) for h in held)
        key = (frozenset(owners), state.device_total)
        if self.static or key != self._shares_key or self.cluster is not self._shares_view:
            # dynamic shares change only with the owners, the pool or the view of the others
            self._shares_key, self._shares_view = key, self.cluster
            self._shares_now = self._shares(owners, state)
        self.shares = self._shares_now
        self.over = {o: self.use.get(o, 0) / e if e > 0 else (float("inf") if self.use.get(o, 0) else 0.0)
                     for o, e in self.shares.items()}
        for rid in (ids - self._running_ids) & self._parked_ids:  # promoted since the last look
            self._moved[rid] = state.now
        self._running_ids = ids
        self._parked_ids = {c.request_id for c in candidates if state.host_pages.get(c.request_id)} \
            if state.host_pages else set()
        since, within, needs, within_pages = {}, {}, {}, {}
        starved, oldest = None, state.now - self.settings.starve_after_s
        for c in candidates:
            rid = c.request_id
            t = since[rid] = self._since.get(rid, state.now)
            o = own(c)
            if rid not in self._since and not c.num_computed_tokens:
                self._note_size(o, -(-c.num_tokens // state.page_size))
            need = needs[rid] = self._need_now(c, state)
            if self.use.get(o, 0) + need <= self.shares.get(o, 0):
                within[o] = within.get(o, 0) + 1
                within_pages[o] = within_pages.get(o, 0) + need
            if t <= oldest and (starved is None or (t, rid) < (oldest, starved.request_id)):
                oldest, starved = t, c  # the longest waiter past starve_after_s: free pages are kept for it
        for h in self.fresh_held(state):
            o = own(h)
            if self.use.get(o, 0) + h.num_pages <= self.shares.get(o, 0):
                within[o] = within.get(o, 0) + 1
                within_pages[o] = within_pages.get(o, 0) + h.num_pages
        self._since, self._within, self._needs, self._within_pages = since, within, needs, within_pages
        self._starved = (starved.request_id, needs[starved.request_id]) if starved is not None else ("", 0)
        if self._moved:
            horizon = state.now - self.settings.starve_after_s
            self._moved = {r: t for r, t in self._moved.items() if t > horizon}

    def _shares(self, owners: set[str], state: SchedState) -> dict[str, float]:
        """Entitlements: of this node's pool alone, or, told what the other nodes hold (tenant
        quotas, dynamic shares), of the tenants' cluster-wide shares (fairness/cluster.py)."""
        view = self.cluster
        if view is None or self.static or self.cfg.quota_by != "tenant":
            return entitlements(self._sharing(owners, state), self.cfg, state.device_total)
        local = {owner_name(o): o for o in owners}
        got = node_shares(local, self.cfg.weight, view, state.device_total)
        return {o: got[t] for t, o in local.items()}

    def _note_size(self, owner: str, pages: int) -> None:
        prev = self._size.get(owner)
        self._size[owner] = float(pages) if prev is None else prev + (pages - prev) / SIZE_MEMORY

    def _sharing(self, owners: set[str], state: SchedState) -> set[str]:
        """The owners the device tier is split between: those with work (dynamic shares), or
        every owner seen with work within `static_window_s` (static shares: an idle owner's
        share is kept for it, not lent). A request never returns once it left, so under
        request quotas a static share lasts as long as its request is here."""
        if not self.static:
            return owners
        for o in owners:
            self._known[o] = state.now
        by_request = self.cfg.quota_by == "request"
        self._known = {o: t for o, t in self._known.items()
                       if state.now - t <= self.settings.static_window_s and not (by_request and o not in owners)}
        return set(self._known)

    def _starving(self, seq: Sequence, state: SchedState) -> bool:
        return state.now - self._since.get(seq.request_id, state.now) >= self.settings.starve_after_s

    def _held_down(self, rid: str, state: SchedState) -> bool:
        """Moved between tiers within `starve_after_s`: not moved again yet."""
        t = self._moved.get(rid)
        return t is not None and state.now - t < self.settings.starve_after_s

    @staticmethod
    def _need_now(seq: Sequence, state: SchedState) -> int:
        """Device pages `seq` must get to run its next step: parked, all its context; a prompt
        not started, its first chunk's (a 128K prompt is let in chunk by chunk, and making
        room for all of it at once would demote borrowers it then does not reach for)."""
        tokens = seq.num_computed_tokens + 1 if seq.num_computed_tokens else min(seq.num_tokens, state.token_budget)
        return max(1, -(-tokens // state.page_size) - state.pages.get(seq.request_id, 0))

    # ---- reclaim ----------------------------------------------------------------------------------
    def reclaim(self, running, candidates, state):
        super().reclaim(running, candidates, state)  # refreshes the view
        own, ent = self.owner, self.shares
        if not any(n > ent.get(o, 0) for o, n in self.use.items()):
            return []  # nobody beyond its share: nobody to demote
        wants = []  # (owner, pages it needs, not starving, since when it waits)
        for c in candidates:
            wants.append((own(c), self._needs.get(c.request_id) or self._need_now(c, state),
                          not self._starving(c, state), c.arrival_time))
        for h in self.fresh_held(state):  # (one not retried here lately went elsewhere: no room for it)
            wants.append((own(h), h.num_pages + 1, True, h.first_seen))
        # the starving first, then by how far below its share the owner is
        wants.sort(key=lambda w: (w[2], self.over.get(w[0], 0.0), w[3]))
        victims: list[Sequence] = []
        free, use, host_free = state.device_free, dict(self.use), state.host_free
        movable = [s for s in running if s.num_computed_tokens > 0 and not self._held_down(s.request_id, state)]
        tries = 0  # waiting requests that looked for victims this step (bounded: the cost per step)
        for owner, need, _, _ in wants:
            # the page per running request for its next token (BasePolicy.may_admit) comes first:
            # without it the rows that step before admission take the pages freed here
            headroom = len(running) - len(victims)
            if need + headroom <= free:
                free -= need  # it will fit without anyone leaving
                use[owner] = use.get(owner, 0) + need
                continue
            if use.get(owner, 0) + need > ent.get(owner, 0):
                continue  # beyond its own share, starving or not: it waits for free pages, it does not reclaim
            over_share = {o for o, n in use.items() if n > ent.get(o, 0)}
            if not over_share:
                break  # nobody borrows: nothing to reclaim for anyone after this one either
            if tries >= RECLAIM_TRIES:
                break  # the most deserving waiters had their look; the rest get theirs next steps
            tries += 1
            pool = [s for s in movable if own(s) in over_share and s not in victims]
            # demote only when the whole need can be met: a demotion that does not let the
            # waiter in copies a borrower down for nothing
            gain = sum(state.gain.get(s.request_id, 0) for s in pool
                       if 0 < state.pages.get(s.request_id, 0) <= host_free)
            if need + len(running) - len(victims) > free + gain:
                continue
            while need + len(running) - len(victims) > free and pool:
                over = {o: use.get(o, 0) / e if e > 0 else float("inf") for o, e in ent.items()}
                v = eviction.footprint(pool, state, over, own)
                pool.remove(v)
                pages = state.pages.get(v.request_id, 0)  # its whole page table is copied down
                if not 0 < pages <= host_free:
                    continue
                host_free -= pages
                victims.append(v)
                self._moved[v.request_id] = state.now
                use[own(v)] -= state.charge.get(v.request_id, 0)
                free += state.gain.get(v.request_id, 0)  # pages shared with others stay held
            if need + len(running) - len(victims) <= free:
                free -= need
                use[owner] = use.get(owner, 0) + need
        return victims

    # ---- admission and placement ------------------------------------------------------------------
    def admission_order(self, candidates, state):
        first = self._starved[0]
        return sorted(candidates, key=lambda s: (s.request_id != first, self.over.get(self.owner(s), 0.0),
                                                 s.arrival_time))

    def _keeps_room_for_the_starved(self, rid: str, owner: str, need: int, state: SchedState) -> bool:
        """Taking `need` pages leaves the longest-starving request's need free, or is that
        request, or is within its owner's share while the starving one fits beside what the
        other owners hold within their shares: it gets in as the borrowers' pages free up (their
        prompts do not grow into them: `_yield_to_waiters`), without anyone demoted for it. When
        the owners within their shares hold too much for it, everyone else's admissions stop."""
        starved, want = self._starved
        if not starved or rid == starved or state.device_free - need - len(self.running) >= want:
            return True
        if self.use.get(owner, 0) + need > self.shares.get(owner, 0):
            return False  # a borrower waits for the starving request
        so = self._owners.get(starved)
        kept = sum(min(self.use.get(o, 0) + (need if o == owner else 0), e)
                   for o, e in self.shares.items() if o != so)
        return want <= state.device_total - kept

    def may_admit(self, seq, need_pages, state):
        if not super().may_admit(seq, need_pages, state):
            return False
        owner = self.owner(seq)
        if self._allot and self._pending[0] == seq.request_id and seq.request_id not in self._allot:
            return False  # a prompt with no part of this step waits for one
        if not self._keeps_room_for_the_starved(seq.request_id, owner, need_pages, state):
            return False
        if not self._starving(seq, state):
            if self._held_down(seq.request_id, state) and \
                    self.use.get(owner, 0) + need_pages > self.shares.get(owner, 0):
                return False  # demoted lately as a borrower: it does not borrow straight back
            rest = -(-seq.num_prompt_tokens // state.page_size) - state.pages.get(seq.request_id, 0) - need_pages
            if not self._quota_ok(owner, need_pages, state, max(0, rest)):
                return False
        self.use[owner] = self.use.get(owner, 0) + need_pages
        return True

    def _place(self, arrival, queued, state):
        """An arrival goes to the device tier only when `may_admit` would let it in there (the
        same quota check: share, borrowing); otherwise it is parked, or deferred. With static
        shares an arrival held `starve_after_s` goes to the device whatever its quota, as a
        starving request is admitted (without a host tier it would wait at the prefill side for
        as long as the owners it may not borrow from stay in the window)."""
        owner = self.owner(arrival)
        headroom = len(self.running) + self._reserved(arrival, state)  # as may_admit: class reservations too
        fits = arrival.num_pages + headroom <= state.device_free and \
            self._keeps_room_for_the_starved(arrival.request_id, owner, arrival.num_pages, state)
        if arrival.request_id not in self.held:
            self._note_size(owner, arrival.num_pages)
        if fits and self.static and state.now - arrival.first_seen >= self.settings.starve_after_s:
            return Placement.DEVICE
        if fits and self._quota_ok(owner, arrival.num_pages, state):
            self.use[owner] = self.use.get(owner, 0) + arrival.num_pages
            return Placement.DEVICE
        return self.park_or_defer(arrival, state)

    def _quota_ok(self, owner: str, need: int, state: SchedState, prompt: int = 0) -> bool:
        """May `owner` take `need` more device pages? Usage counts the pages reserved for the
        owner's arrivals still landing, and an owner new to this step gets its share carved out
        as if it had been there."""
        ent = self.shares if owner in self.shares else \
            entitlements(set(self.shares) | {owner}, self.cfg, state.device_total)
        if self.use.get(owner, 0) + need + prompt <= ent.get(owner, 0):
            return True
        if self.static:
            return False  # static shares: nobody borrows another owner's share, idle or not
        # Borrowing: only while no other owner waits with a request within its share, leaving
        # free one typical request's pages of each other owner with share to spare, so that
        # its next request does not have to demote the borrower (a ping-pong between tiers).
        if any(n and o != owner for o, n in self._within.items()):
            return False
        reserve = float(self._growth + prompt)  # the pages the running prompts, and its own, still take
        for o, e in ent.items():
            if o != owner:
                reserve += min(max(0.0, e - self.use.get(o, 0)), self._size.get(o, 0.0))
        return state.device_free - need >= reserve

    # ---- the step ---------------------------------------------------------------------------------
    def step_order(self, running, state):
        rows = self._yield_to_waiters(super().step_order(running, state), state)
        self._split_prefill(rows, state)
        # Under-share owners first, the tail (evicted first under pressure) the most over; within
        # each, decode rows before prompts, so that a prompt's chunk never takes their token.
        borrowing = {o for o, v in self.over.items() if v > 1.0}
        if not borrowing and not self._prompts:
            return rows  # decode rows only, nobody borrowing: nothing to reorder
        own = self.owner
        return sorted(rows, key=lambda s: (own(s) in borrowing, s.in_prefill, s.arrival_time))

    def _yield_to_waiters(self, rows: list[Sequence], state: SchedState) -> list[Sequence]:
        """A borrower's prompt does not grow into the free pages that requests within their
        owners' shares wait for (admission comes after the running rows' growth in a step, so
        without this a borrower's chunks take each page as it frees): beyond its own share's
        room, its chunk takes what its pages hold and what the waiters leave free, and the
        prompt sits the step out when that is nothing. The oldest running request always goes
        on (BasePolicy.spare_oldest), and decode rows always step."""
        self._cap = {}
        want = self._starved[1]
        waiting = sum(self._within_pages.values()) + want
        if not waiting:
            return rows
        ps, oldest, out = state.page_size, self.oldest_running(), []
        free = state.device_free - len(rows)  # a page per row for its next token comes first
        for s in rows:
            if not s.in_prefill or s is oldest:
                out.append(s)
                continue
            left = s.num_uncomputed_tokens
            o = self.owner(s)
            others = waiting - self._within_pages.get(o, 0)  # (the starving request's need whoever's it is)
            held = state.pages.get(s.request_id, 0)
            room = max(0, int(self.shares.get(o, 0) - self.use.get(o, 0)), free - others)
            tokens = min(left, state.token_budget, held * ps - s.num_computed_tokens + room * ps)
            if others and tokens <= 0:
                continue  # it waits this step, keeping its pages
            if others:
                self._cap[s.request_id] = tokens
            free -= max(0, -(-(s.num_computed_tokens + tokens) // ps) - held)
            out.append(s)
        return out

    def _split_prefill(self, rows: list[Sequence], state: SchedState) -> None:
        """This step's prefill tokens per prompt (see the module doc). The prompts are the
        running ones with tokens left and the waiting ones that fit the free pages."""
        prompts: list[tuple[str, Sequence, int]] = []  # (owner, request, tokens it wants)
        decode_rows = 0
        decode: dict[str, tuple[int, int]] = {}
        own = self.owner
        for s in rows:
            n = len(s.token_ids)  # (num_uncomputed_tokens and num_output_tokens, inline: every row, every step)
            left = n - s.num_computed_tokens
            if left > 1 or n == s.num_prompt_tokens:
                prompts.append((own(s), s, left))
            else:
                decode_rows += 1
                o = own(s)
                r, c = decode.get(o, (0, 0))
                decode[o] = (r + 1, c + n)
        self._decode, self._added = decode, (0, 0, 0)
        self._decode_total = (sum(r for r, _ in decode.values()), sum(c for _, c in decode.values()))
        free = state.device_free - len(rows)
        for c in self.candidates:
            if c.num_computed_tokens:
                decode_rows += 1  # a parked row comes back to decode
            elif (self._needs.get(c.request_id) or self._need_now(c, state)) <= free:
                prompts.append((self.owner(c), c, c.num_tokens))
        self._prompts = len(prompts)
        demand: dict[str, int] = {}
        for o, _, want in prompts:
            demand[o] = demand.get(o, 0) + want
        if len(demand) < 2:
            self._allot = {}  # one owner prefilling: the whole budget is its own, in step order
            return
        weights = {o: self.cfg.weight(owner_name(o)) for o in demand}
        total = max(len(demand), state.token_budget - decode_rows)
        floor = {o: int(PREFILL_FLOOR * v) for o, v in water_fill(demand, weights, total).items()}
        allot: dict[str, int] = {}
        for o, s, want in sorted(prompts, key=lambda p: (p[1].arrival_time, p[1].request_id)):
            give = min(want, floor.get(o, 0))  # an owner's floor: its oldest prompts first
            if give > 0:
                allot[s.request_id] = give
                floor[o] -= give
        left = total - sum(allot.values())
        # the rest: the smallest prompts first; a heap, since only the first few of a long queue
        # get tokens (sorting all of it every step was most of the policy's time per step)
        heap = [(s.num_tokens, s.arrival_time, s.request_id, want) for _, s, want in prompts]
        heapq.heapify(heap)
        while heap and left > 0:
            _, _, rid, want = heapq.heappop(heap)
            give = min(want - allot.get(rid, 0), left)
            if give > 0:
                allot[rid] = allot.get(rid, 0) + give
                left -= give
        self._allot = allot

    def chunk_limit(self, seq, budget, state):
        """A prompt's chunk is at most its part of this step (a token if it has none), at most
        what its owner may grow into (`_yield_to_waiters`), and at most what keeps the step an
        ordinary one beside the other owners' decode rows."""
        budget = min(budget, self._cap.get(seq.request_id, budget))
        if not self._allot:
            return self._within_step_time(seq, min(budget, seq.num_uncomputed_tokens), state)
        n = max(1, min(budget, seq.num_uncomputed_tokens, self._allot.get(seq.request_id, 0)))  # the scheduler's chunk
        if seq.request_id not in self._running_ids:
            self._pending = (seq.request_id, n)  # a candidate: let in by may_admit only with a part of the step
        return self._within_step_time(seq, n, state)

    def _within_step_time(self, seq, n: int, state) -> int:
        """The largest chunk up to `n` tokens that, with the chunks given out before it this
        step, keeps the step's price within an ordinary step's, its decode rows beside the token
        budget's worth of fresh prompt tokens (a 510-token chunk at offset 1,500 made a 5 ms step
        80 ms on the CPU), when another owner has decode rows in it; at least a page (or `n`)."""
        price = state.step_s
        owner = self.owner(seq)
        if price is None or n <= 0 or not any(o != owner for o in self._decode):
            return n
        rows, ctx = self._decode_total
        chunks, tokens, pairs = self._added
        start = seq.num_computed_tokens

        def cost(k: int) -> float:
            return price(StepShape(rows, ctx, chunks + 1, tokens + k, pairs + k * start + k * (k + 1) // 2))

        t = max(1, state.token_budget - rows)  # an ordinary step: the budget's fresh tokens beside the rows
        k, limit = n, price(StepShape(rows, ctx, 1, t, t * (t + 1) // 2))
        if cost(n) > limit:
            lo, hi = min(n, state.page_size), n  # cost(lo) may be over the limit: a page is the least
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if cost(mid) <= limit else (lo, mid - 1)
            k = lo
        self._added = (chunks + 1, tokens + k, pairs + k * start + k * (k + 1) // 2)
        return k

    def choose_victim(self, candidates, requester, state):
        """The most over-share owner gives pages back: demoted, its largest footprint (no work
        is lost, and fewest moves free the most); dropped for recompute, the request with the
        least computed work (a preempted 128K prompt redoes all of it)."""
        top = max(self.over.get(self.owner(s), 0.0) for s in candidates)
        mine = [s for s in candidates if self.over.get(self.owner(s), 0.0) == top]
        demotable = [s for s in mine if self._demotable(s, state)]
        if demotable:
            return eviction.footprint(demotable, state, self.over, self.owner)
        if self._chunk_waits(requester):
            return None
        return min(mine, key=lambda s: (s.num_computed_tokens, -s.arrival_time))

    def _chunk_waits(self, requester) -> bool:
        """A prompt's next chunk waits for pages rather than drop another request's computed work,
        while some running request decodes (its pages come free as it ends) and the requester is
        not the oldest running one (which always goes on: BasePolicy.spare_oldest)."""
        return requester.in_prefill and requester is not self.oldest_running() \
            and any(not s.in_prefill for s in self.running)
