"""`memfair`: memory-fair admission of inherited pages.

A "tenant" below is a quota owner (fairness/owners.py, `quota_by`): a tenant by default, or a
priority class, a request, an SLO tier. Everything here is keyed by it.

- Entitlement: each tenant with work is entitled to its weighted share of the device tier.
- Static shares (`quota_shares="static"`): each tenant seen with work within `static_window_s`
  is entitled to its weighted share whether or not it has work now; an idle tenant's share is
  not lent, and nobody is admitted or placed beyond its tenant's share (no borrowing). Work
  conservation still holds (with nothing running, the first candidate that fits runs; an idle
  pool takes the oldest arrival), and so does `starve_after_s`, for held arrivals too.
- Admission: candidates of the tenants furthest below their entitlement first; a request may
  take pages beyond its tenant's entitlement (borrowing) only while no other tenant that is
  below its entitlement is waiting. Under contention a request's device pages beyond its cap
  (static, or dynamic: growing with its length) are borrowed too: it is admitted or promoted
  beyond the cap only while no other request within its quota waits, so a cap delays a long
  request but never strands it.
- Reclaim: when a waiting request within its quota cannot fit, requests of tenants above
  their entitlement, and requests that grew beyond their cap while decoding, are demoted to
  the host tier (never preempted: a quota is not worth lost work), most over-quota owner and
  largest footprint first, never pushing a tenant below its share for a borrower.
- No starvation: a request that has waited `starve_after_s` for device pages (a long request
  beyond its cap, a borrower while others keep borrowing) is let in whatever its quota: it
  reclaims other tenants' borrowed and beyond-cap pages like a request within its quota, and
  is not reclaimed itself for `read_turn_steps` steps after it gets in.
- Victims under pressure: footprint-weighted, the same order.
- Long prompts: while another tenant has work (now, or within `active_window_s`: a tenant
  between two requests is still there), a prompt longer than `long_prompt_frac` of the step
  budget prefills in chunks, one such prompt per tenant at a time: of `prefill_share_frac` of
  the budget in a step that carries another tenant's requests (their inter-token gaps stay
  short), of `prefill_idle_frac` of it in a step that carries none (a request of theirs that
  arrives waits for one such step at most, and a whale made of prompt does not crawl at the
  small chunk's cost per token for as long as others come and go). The whale pays for its own
  size with more, smaller steps.
- Read share: KV bandwidth is the other half of memory. While other tenants decode, a tenant's
  decode rows read at most its entitlement of pages per step; its other rows keep their pages
  and take turns (least recently served first, a turn lasting `read_turn_steps`). A borrower
  keeps the memory it borrowed but does not stretch everyone's step with it.
"""
from __future__ import annotations

from fairness import eviction
from fairness.base import BasePolicy
from fairness.interface import Placement, QuotaView
from fairness.memfair_settings import MemFairSettings
from fairness.owners import owner_name
from fairness.quotas import entitlements, request_cap, request_cap_tokens, usage
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


RECLAIM_TRIES = 16  # waiting requests per step that may look for borrowers to demote


class MemFairPolicy(BasePolicy):
    name = "memfair"
    strict_order = False  # a blocked whale does not block the minnows behind it
    Settings = MemFairSettings

    def __init__(self, config=None, settings=None) -> None:
        super().__init__(config, settings)
        self.static = self.settings.quota_shares == "static"  # no lending, no borrowing of shares
        self.use: dict[str, int] = {}  # device pages per quota owner (refreshed each step)
        self.shares: dict[str, float] = {}  # entitlement per owner with a share (with work; static: seen)
        self.over: dict[str, float] = {}  # use / entitlement
        self._turns: dict[str, tuple[frozenset, int]] = {}  # owner -> (rows in its read turn, last step)
        self._seen: dict[str, float] = {}  # owner -> state.now when it last had work here
        self._known: dict[str, float] = {}  # static shares: owner -> state.now when last seen with work
        self._long_chunk: dict[str, int] = {}  # owner -> step its long prompt last got a chunk in
        self._yielded: dict[str, int] = {}  # long prompt -> steps sat out in a row (long_yield_steps)
        self._since: dict[str, float] = {}  # candidate -> state.now since when it waits for device pages
        self._shielded: dict[str, int] = {}  # request let in as starving -> last step it may not be reclaimed

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
        self._shielded.pop(request_id, None)
        self._yielded.pop(request_id, None)

    def _refresh(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> None:
        own = self.owner
        self.use = usage(running, state, own)
        owners = {own(s) for s in running} | {own(s) for s in candidates} | {own(h) for h in self.live_held(state)}
        self.shares = entitlements(self._sharing(owners, state), self.cfg, state.device_total)
        self.over = {o: self.use.get(o, 0) / e for o, e in self.shares.items() if e > 0}
        for t in owners:
            self._seen[t] = state.now
        for t in [t for t, seen in self._seen.items() if state.now - seen > self.settings.active_window_s]:
            del self._seen[t]
        since = {}
        for c in candidates:
            since[c.request_id] = self._since.get(c.request_id, state.now)
        for s in running:  # let in since the last look: shield one that was starving
            if s.request_id in self._since and state.now - self._since[s.request_id] >= self.settings.starve_after_s:
                self._shielded[s.request_id] = state.step + self.settings.read_turn_steps
        self._since = since
        live = {s.request_id for s in running}
        self._shielded = {r: until for r, until in self._shielded.items() if r in live and until >= state.step}

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

    def _others_active(self, owner: str, state: SchedState) -> bool:
        """Another quota owner has work, or had some within `active_window_s`."""
        return any(o != owner and state.now - seen <= self.settings.active_window_s for o, seen in self._seen.items())

    def _long(self, seq: Sequence, state: SchedState) -> bool:
        return seq.num_tokens > self.settings.long_prompt_frac * state.token_budget

    @staticmethod
    def _need_now(seq: Sequence, state: SchedState) -> int:
        """Device pages `seq` must get to run its next step (parked: all its context)."""
        tokens = seq.num_computed_tokens + 1 if seq.num_computed_tokens else seq.num_tokens
        return max(1, -(-tokens // state.page_size) - state.pages.get(seq.request_id, 0))

    def refresh(self, running, candidates, state):
        super().refresh(running, candidates, state)
        self._refresh(running, candidates, state)

    def reclaim(self, running, candidates, state):
        super().reclaim(running, candidates, state)  # refreshes the view
        # Everyone waiting for device pages: local candidates and arrivals held at prefill, with
        # whether the per-request cap would let them in at all (may_admit's test: reclaiming
        # for a request the cap then refuses only moves a borrower for nothing).
        own, ent = self.owner, self.shares
        contended = len(ent) > 1
        wants = []
        for c in candidates:
            need = self._need_now(c, state)
            starving = self._starving(c, state)
            cap_ok = starving or not contended or state.charge.get(c.request_id, 0) + need <= request_cap(c, self.settings, state)
            wants.append((own(c), need, (not starving, c.arrival_time), cap_ok, starving))
        for h in self.fresh_held(state):  # (one not retried here lately went elsewhere: no room for it)
            wants.append((own(h), h.num_pages + 1, (True, h.first_seen),
                          not contended or h.num_pages <= self._cap_of(h, state), False))
        # the starving first, then by how far below its share the owner is
        wants.sort(key=lambda w: (w[2][0], self.over.get(w[0], 0.0), w[2][1]))
        victims: list[Sequence] = []
        free, use, host_free = state.device_free, dict(self.use), state.host_free
        # who could give pages back, found once: running with computed KV, not shielded; and
        # which of them are beyond their cap
        movable = [s for s in running if s.num_computed_tokens > 0 and s.request_id not in self._shielded]
        capped = {s.request_id for s in movable
                  if contended and state.charge.get(s.request_id, 0) > request_cap(s, self.settings, state)}
        tries = 0  # waiting requests that looked for victims this step (bounded: the cost per step)
        for owner, need, _, cap_ok, starving in wants:
            # the page per running request for its next token (BasePolicy.may_admit) comes first:
            # without it the rows that step before admission take the pages freed here
            headroom = len(running) - len(victims)
            if need + headroom <= free:
                free -= need  # it will fit without anyone leaving
                use[owner] = use.get(owner, 0) + need
                continue
            if not starving and (not cap_ok or use.get(owner, 0) + need > ent.get(owner, 0)):
                continue  # beyond its cap or its own share: it waits for free pages, it does not reclaim
            # Reclaim demotes borrowers to the host tier; it never drops computed KV for
            # recompute (a quota is not worth lost work, and a borrower preempted for a
            # candidate that is then not admitted would redo its prefill again and again).
            over_share = {o for o, n in use.items() if n > ent.get(o, 0)}
            if not over_share and not capped:
                break  # nobody borrows: nothing to reclaim for anyone after this one either
            if tries >= RECLAIM_TRIES:
                break  # the most deserving waiters had their look; the rest get theirs next steps
            tries += 1
            pool = [s for s in movable if (own(s) in over_share or s.request_id in capped)
                    and not (starving and own(s) == owner) and s not in victims]
            while need + len(running) - len(victims) > free and pool:
                over = {o: use.get(o, 0) / e for o, e in ent.items() if e > 0}
                v = eviction.footprint(pool, state, over, own)
                pool.remove(v)
                pages = state.pages.get(v.request_id, 0)  # its whole page table is copied down
                if not 0 < pages <= host_free:
                    continue
                host_free -= pages
                victims.append(v)
                use[own(v)] -= state.charge.get(v.request_id, 0)
                free += state.gain.get(v.request_id, 0)  # pages shared with others stay held
            if need + len(running) - len(victims) <= free:
                free -= need
                use[owner] = use.get(owner, 0) + need
        return victims

    def _place(self, arrival, queued, state):
        """An arrival goes to the device tier only when `may_admit` would let it in there (the
        same quota check: cap, share, borrowing); otherwise it is parked, or deferred. With static
        shares an arrival held `starve_after_s` goes to the device whatever its quota, as a
        starving request is admitted (without a host tier it would wait at the prefill side for
        as long as the owners it may not borrow from stay in the window)."""
        headroom = len(self.running) + self._reserved(arrival, state)  # as may_admit: class reservations too
        fits = arrival.num_pages + headroom <= state.device_free
        if fits and self.static and state.now - arrival.first_seen >= self.settings.starve_after_s:
            return Placement.DEVICE
        if fits and self._quota_ok(self.owner(arrival), arrival.request_id, 0, arrival.num_pages,
                                   self._cap_of(arrival, state), state):
            return Placement.DEVICE
        return self.park_or_defer(arrival, state)

    def _cap_of(self, arrival, state: SchedState) -> float:
        """`request_cap` of an arrival (its token count, or its pages' worth if not given)."""
        return request_cap_tokens(arrival.num_tokens or arrival.num_pages * state.page_size, self.settings, state)

    def _one_long_prompt(self, rows: list[Sequence], state: SchedState) -> list[Sequence]:
        """While other owners are active, one long prompt per owner steps (the oldest): two
        of them would double the stretch of everyone's step."""
        later: set[str] = set()
        by_owner: dict[str, list[Sequence]] = {}
        for s in rows:
            if s.in_prefill and self._long(s, state):
                by_owner.setdefault(self.owner(s), []).append(s)
        for t, longs in by_owner.items():
            if len(longs) > 1 and self._others_active(t, state):
                later.update(s.request_id for s in sorted(longs, key=lambda s: s.arrival_time)[1:])
        return [s for s in rows if s.request_id not in later] if later else rows

    def _yield_to_decoders(self, rows: list[Sequence], state: SchedState) -> list[Sequence]:
        """With `long_yield_steps` N > 0: a long prompt sits out a step that carries another
        tenant's decode rows (its chunk would lengthen their inter-token gap), but never more
        than N steps in a row, so it keeps progressing while others always decode."""
        n = self.settings.long_yield_steps
        if n <= 0:
            return rows
        decode_rows = [s for s in rows if not s.in_prefill]
        if state.device_free < len(decode_rows):
            # A prompt that sits out is not scheduled, so it could be the victim when a decode
            # row needs a new page: with few free pages, yielding could cost it its prefill.
            self._yielded = {}
            return rows
        decoding = {self.owner(s) for s in decode_rows}
        yielded: dict[str, int] = {}
        out = []
        for s in rows:
            if s.in_prefill and self._long(s, state) and decoding - {self.owner(s)}:
                k = self._yielded.get(s.request_id, 0)
                if k < n:
                    yielded[s.request_id] = k + 1
                    continue
            out.append(s)
        self._yielded = yielded  # a prompt that stepped (or left) starts counting afresh
        return out

    def _read_share(self, rows: list[Sequence], state: SchedState) -> list[Sequence]:
        """Decode rows that may step now while other tenants decode (see the module doc)."""
        by_owner: dict[str, list[Sequence]] = {}
        for s in rows:
            dec = by_owner.setdefault(self.owner(s), [])
            if not s.in_prefill:
                dec.append(s)
        if not self.settings.read_share or len(by_owner) < 2 or not any(by_owner.values()):
            self._turns.clear()
            return rows
        pages = state.pages
        keep: set[str] = set()
        for t, dec in by_owner.items():
            allow = self.shares.get(t, state.device_total)
            if sum(pages.get(s.request_id, 0) for s in dec) <= allow:
                keep.update(s.request_id for s in dec)
                self._turns.pop(t, None)
                continue
            turn = self._turns.get(t)
            if turn is None or state.step > turn[1] or not turn[0] <= {s.request_id for s in dec}:
                chosen, used = [], 0
                for s in sorted(dec, key=lambda s: (s.last_step, s.arrival_time)):
                    n = pages.get(s.request_id, 0)
                    if not chosen or used + n <= allow:
                        chosen.append(s.request_id)
                        used += n
                turn = self._turns[t] = (frozenset(chosen), state.step + self.settings.read_turn_steps - 1)
            keep.update(turn[0])
        for t in [t for t in self._turns if t not in by_owner]:
            del self._turns[t]
        return [s for s in rows if s.in_prefill or s.request_id in keep]

    def _small_chunk(self, state: SchedState) -> int:
        """The chunk of a long prompt in a step that carries other tenants' requests."""
        return max(state.page_size, int(state.token_budget * self.settings.prefill_share_frac))

    def step_order(self, running, state):
        ordered = self._one_long_prompt(super().step_order(running, state), state)
        ordered = self._read_share(self._yield_to_decoders(ordered, state), state)
        # Under-quota owners first; the tail (evicted first under pressure) is the most over.
        return sorted(ordered, key=lambda s: (self.over.get(self.owner(s), 0.0) > 1.0, s.arrival_time))

    def admission_order(self, candidates, state):
        return sorted(candidates, key=lambda s: (self.over.get(self.owner(s), 0.0), s.arrival_time))

    def may_admit(self, seq, need_pages, state):
        if not super().may_admit(seq, need_pages, state):
            return False
        if self._second_long_prompt(seq, state):
            # One long prompt per tenant steps at a time (_one_long_prompt): a second would only
            # hold pages. Starving or not: let in, it sat out beside the first, whose next chunk
            # could evict it, and then it evicted the first the same way (a livelock).
            return False
        if self._starving(seq, state):
            return True  # waited long enough: its quota delays it no longer
        return self._quota_ok(self.owner(seq), seq.request_id, state.charge.get(seq.request_id, 0), need_pages,
                              request_cap(seq, self.settings, state), state)

    def _quota_ok(self, owner: str, rid: str, holds: int, need: int, cap: float, state: SchedState) -> bool:
        """May request `rid` of quota owner `owner`, holding `holds` device pages, take `need`
        more? Usage counts the pages reserved for the owner's arrivals still landing, and an
        owner new to this step gets its share carved out as if it had been there."""
        use = usage(self.running, state, self.owner)
        for o, n in self.incoming_pages(state).items():
            use[o] = use.get(o, 0) + n
        ent = self.shares if owner in self.shares else \
            entitlements(set(self.shares) | {owner}, self.cfg, state.device_total)
        others = {o for o in ent if o != owner}  # other owners with a share
        over_cap = bool(others) and holds + need > cap  # the per-request cap binds only under contention
        within_share = use.get(owner, 0) + need <= ent.get(owner, 0)
        if not over_cap and within_share:
            return True
        if self.static and not within_share:
            return False  # static shares: nobody borrows another owner's share, idle or not
        # Borrowing (beyond the share, or beyond the request's cap): only while nobody is waiting
        # for pages within their quota, and leaving a reserve free for the others, so that their
        # next arrival does not have to evict a borrower (which would ping-pong the borrower
        # between tiers). A waiting request that would itself have to borrow blocks nobody (else two
        # of them would block each other for as long as anything else ran). Beyond its cap, a
        # request also gives way to its own owner's requests within the share.
        waiting = [(self.owner(s), self._need_now(s, state)) for s in self.candidates if s.request_id != rid]
        waiting += [(self.owner(h), h.num_pages) for h in self.fresh_held(state) if h.request_id != rid]
        if any((o != owner or over_cap) and use.get(o, 0) + need_o <= ent.get(o, 0) for o, need_o in waiting):
            return False
        reserve = int(self.settings.borrow_reserve_frac * state.device_total) if others else 0
        return state.device_free - need >= reserve

    def chunk_limit(self, seq, budget, state):
        """A long prompt does not stretch other owners' steps (see the module doc)."""
        owner = self.owner(seq)
        if not (self._long(seq, state) and self._others_active(owner, state)):
            return budget
        if self._long_chunk.get(owner) == state.step or self._others_prompt_waiting(owner, state):
            return 1  # a token, not a chunk: one long chunk per owner per step, after others' prompts
        self._long_chunk[owner] = state.step
        if any(self.owner(s) != owner for s in self.running):
            return min(budget, self._small_chunk(state))
        return min(budget, max(state.page_size, int(state.token_budget * self.settings.prefill_idle_frac)))

    def _second_long_prompt(self, seq: Sequence, state: SchedState) -> bool:
        """A long prompt not started yet while its owner's other long prompt is in prefill and
        another owner is active: not admitted (may_admit), and so not waited for either."""
        if seq.num_computed_tokens or not self._long(seq, state):
            return False
        owner = self.owner(seq)
        return self._others_active(owner, state) and \
            any(self.owner(s) == owner and s.in_prefill and self._long(s, state) for s in self.running)

    def _others_prompt_waiting(self, owner: str, state: SchedState) -> bool:
        """Another owner's prompt waits for its first chunk and fits the free pages: this step
        is for it (the step's length is what that request's other rows, and everyone's next
        token, wait for). One that cannot get in yet does not hold the long prompts back (they
        crawled at a token a step behind a prompt waiting for room)."""
        free = state.device_free - len(self.running)
        busy = None  # owners with a long prompt in prefill: `_second_long_prompt`'s scan, done once
        for c in self.candidates:
            if self.owner(c) == owner or c.num_computed_tokens or self._need_now(c, state) > free:
                continue
            if self._long(c, state) and self._others_active(self.owner(c), state):
                if busy is None:
                    busy = {self.owner(s) for s in self.running if s.in_prefill and self._long(s, state)}
                if self.owner(c) in busy:
                    continue  # a second long prompt of its owner: it waits, and is not waited for
            return True
        return False

    def choose_victim(self, candidates, requester, state):
        return eviction.footprint(candidates, state, self.over, self.owner)
