"""memfair's rules as pure functions of plain values and the step's frozen view (`StepView`).

fairness/memfair.py wires them to the policy interface; each one here reads what it is given,
changes none of it and returns its answer, so a test can check it against figures worked by
hand (tests/fairness/test_memfair_rules.py). An "owner" is a quota owner (fairness/owners.py).

- Shares (`owner_shares`, `static_window`, `over_share`): each owner with work is entitled to its weighted share
  of the device tier (fairness/quotas.py `entitlements`; on one of several nodes a tenant's
  cluster-wide share, fairness/cluster.py); static shares go to every owner seen with work within
  `static_window_s`, an idle owner's share kept for it.
- Borrowing (`quota_ok`, `borrow_reserve`, `keeps_room_for_starved`): a prompt is within its
  owner's share when all of it is. An owner goes beyond its share only while no other owner waits
  with a request within its own, and only leaving free the pages the running prompts and its own
  still take and one typical request (its recent requests' mean, `typical_size`) of each other
  owner with unused share, so that its next request need not take pages back from the borrower.
  A request waiting `starve_after_s` is let in whatever its quota, and while it waits nobody
  else takes the pages it needs: it gets in as pages free up.
- Growth is admission too (`growth_caps`): a borrower's prompt does not grow into the free pages
  that requests within their owners' shares, or the longest-starving request, wait for (a step
  grows its running rows before it admits anyone); it sits the step out instead, unless it is
  the oldest running request. Without a host tier a prompt gets in only with room for all of it
  (`need_on`) beside what the running prompts of owners within their shares still take
  (`promised`): a borrower's prompt yields its growth, the others' is theirs.
- Reclaim (`reclaim_wants`, `reclaim_victims`): a waiter within its share that cannot fit demotes requests of
  owners beyond their share to the host tier (by default never preempts: a share is not worth
  lost work), the most over-share owner and largest footprint first, and only when that makes
  room for all the waiter needs now (a prompt: its first chunk, `need_now`). With no host room
  the setting reclaim_drop may drop borrowers for recompute instead (`_drop_for`): prompts that
  streamed nothing first, the least computed first, never leaving their owner below its share.
- The prefill split (`plan_prefill`, `split_prefill`): when more than one owner has prompts,
  the step's budget less a token per decode row is split: each owner gets PREFILL_FLOOR of its
  weighted max-min share for its oldest prompts, and the rest goes to the smallest prompts first.
- The chunk bound (`chunk_within_step_time`): beside another owner's decode rows, the prompts'
  chunks keep the step's price (`SchedState.step_s`) within an ordinary step's, the same rows
  beside a budget of fresh prompt tokens; a chunk gets at least a page whatever the price.
- Victims (`choose_victim`): the most over-share owner's request; demoted, the largest
  footprint; dropped for recompute, the least computed work. A prompt's chunk drops nobody's
  work while it can wait for pages instead.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Iterable, Mapping, NamedTuple

from fairness import eviction
from fairness.cluster import node_shares
from fairness.config import FairnessConfig
from fairness.owners import owner_name
from fairness.quotas import entitlements, water_fill
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence
from pdtb.engine.step_shape import StepShape

RECLAIM_TRIES = 16  # waiting requests per step that may look for borrowers to demote
# An owner with prompts to prefill gets at least this part of its weighted max-min share of
# every step's tokens; the rest goes to the smallest prompts first. Smallest first keeps a 2K
# prompt from queueing behind a 128K one (whose size is the cost it makes visible); the floor
# keeps owners of small prompts that fill the node from starving the others.
PREFILL_FLOOR = 0.25
SIZE_MEMORY = 8  # an owner's typical request size: the mean of about its last this many requests


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(frozen=True)
class StepView:
    """What memfair knows of the node for one step: built once by `refresh`, never changed."""

    running_ids: frozenset = frozenset()  # requests running when the view was built
    parked_ids: frozenset = frozenset()  # candidates then in the host tier
    use: Mapping[str, float] = field(default_factory=dict)  # device pages per owner, arrivals landing included
    shares: Mapping[str, float] = field(default_factory=dict)  # entitlement per owner with a share
    over: Mapping[str, float] = field(default_factory=dict)  # use / share
    growth: int = 0  # device pages the running prompts take before their prompts are in
    needs: Mapping[str, int] = field(default_factory=dict)  # candidate -> device pages it needs to step
    within: Mapping[str, int] = field(default_factory=dict)  # owner -> waiting requests within its share
    within_pages: Mapping[str, int] = field(default_factory=dict)  # owner -> device pages those need now
    starved: str = ""  # the longest-starving candidate ("": none past starve_after_s)
    starved_need: int = 0  # device pages it needs now
    starved_owner: str | None = None


# ---- the view -------------------------------------------------------------------------------------
def usage(running: Iterable[Sequence], charge: Mapping, pages: Mapping, page_size: int,
          owner_of: Callable) -> tuple[dict, set, dict]:
    """(device pages charged per owner, the running ids, owner -> the pages its running prompts
    still take to hold all their prompt), in one pass."""
    use: dict = {}
    ids, growth = set(), {}
    for s in running:
        rid = s.request_id
        o = owner_of(s)
        use[o] = use.get(o, 0) + charge.get(rid, 0)
        ids.add(rid)
        if s.num_computed_tokens < s.num_prompt_tokens:
            growth[o] = growth.get(o, 0) + max(0, pages_for(s.num_prompt_tokens, page_size) - pages.get(rid, 0))
    return use, ids, growth


def promised(growth: Mapping, use: Mapping, shares: Mapping) -> int:
    """Without a host tier: the pages the running prompts of owners within their share still
    take. A prompt gets in only beside them (`need_on`); a borrower's prompt is not promised its
    growth: it yields it to waiters within their shares (`growth_caps`)."""
    return sum(n for o, n in growth.items() if use.get(o, 0) <= shares.get(o, 0))


def over_share(use: Mapping, shares: Mapping) -> dict[str, float]:
    """use / share per owner with a share (a zero share: infinite if it holds pages, else 0)."""
    return {o: use.get(o, 0) / e if e > 0 else (float("inf") if use.get(o, 0) else 0.0) for o, e in shares.items()}


def need_now(seq: Sequence, held: int, token_budget: int, page_size: int, whole: bool = False) -> int:
    """Device pages `seq` must get to run its next step, `held` being those it has: parked, all
    its context; a prompt not started, its first chunk's (a 128K prompt is let in chunk by
    chunk, and making room for all of it at once would demote borrowers it does not reach for),
    or with `whole` all of it (`need_on`)."""
    if whole and not seq.num_computed_tokens:
        return max(1, pages_for(seq.num_tokens, page_size) - held)
    tokens = seq.num_computed_tokens + 1 if seq.num_computed_tokens else min(seq.num_tokens, token_budget)
    return max(1, pages_for(tokens, page_size) - held)


def need_on(seq: Sequence, state: SchedState) -> int:
    """`need_now` on `state`'s node. Without a host tier a prompt not started needs all of its
    prompt: reclaim has nowhere to move a borrower for its later chunks, and a prompt let in by
    its first chunk that then cannot grow sits on the pages it holds (on vLLM's CPU build, six
    such prompts held most of the pool while four rows decoded)."""
    return need_now(seq, state.pages.get(seq.request_id, 0), state.token_budget, state.page_size,
                    whole=not state.host_total)


def typical_size(prev: float | None, pages: int) -> float:
    """An owner's typical request size in pages, after a request of `pages`: a running mean
    over about its last SIZE_MEMORY requests."""
    return float(pages) if prev is None else prev + (pages - prev) / SIZE_MEMORY


def static_window(known: Mapping[str, float], owners: AbstractSet[str], now: float, window_s: float,
                  by_request: bool) -> dict[str, float]:
    """Static shares' owners (owner -> when last seen with work): those with work now and those
    seen within `window_s`. A request never returns once it left, so under request quotas a
    static share lasts as long as its request is here."""
    seen = dict(known)
    for o in owners:
        seen[o] = now
    return {o: t for o, t in seen.items() if now - t <= window_s and not (by_request and o not in owners)}


def waiting_since(candidates: list[Sequence], before: Mapping[str, float], now: float) -> tuple[dict, list]:
    """(candidate -> since when it waits for device pages, the prompts not seen waiting before)."""
    since, new = {}, []
    for c in candidates:
        rid = c.request_id
        since[rid] = before.get(rid, now)
        if rid not in before and not c.num_computed_tokens:
            new.append(c)
    return since, new


def with_grants(use: Mapping, granted: list[tuple[str, int]]) -> Mapping:
    """Device pages per owner after the pages `granted` (owner, pages), in their order."""
    if not granted:
        return use
    use = dict(use)
    for o, n in granted:
        use[o] = use.get(o, 0) + n
    return use


def within_share(waiting: Iterable[tuple[str, int]], use: Mapping, shares: Mapping) -> tuple[dict, dict]:
    """Of the waiting requests, (owner, pages it needs now) each: (owner -> how many are within
    its share, owner -> the pages those need)."""
    within: dict = {}
    within_pages: dict = {}
    for o, need in waiting:
        if use.get(o, 0) + need <= shares.get(o, 0):
            within[o] = within.get(o, 0) + 1
            within_pages[o] = within_pages.get(o, 0) + need
    return within, within_pages


def longest_starving(since: Mapping[str, float], horizon: float) -> str | None:
    """The candidate waiting longest, since `horizon` or before (ties: the smaller id); None: none."""
    starved, oldest = None, horizon
    for rid, t in since.items():
        if t <= oldest and (starved is None or (t, rid) < (oldest, starved)):
            oldest, starved = t, rid
    return starved


def owner_shares(owners: AbstractSet[str], cfg: FairnessConfig, total: int, cluster) -> dict[str, float]:
    """Entitlements: of this node's pool alone, or, told what the other nodes hold (`cluster`,
    tenant quotas), of the tenants' cluster-wide shares (fairness/cluster.py)."""
    if cluster is None or cfg.quota_by != "tenant":
        return entitlements(owners, cfg, total)
    local = {owner_name(o): o for o in owners}
    got = node_shares(local, cfg.weight, cluster, total)
    return {o: got[t] for t, o in local.items()}


def build_view(running_ids: set, candidates: list[Sequence], held: list, use: dict, shares: dict, growth: int,
               since: Mapping[str, float], horizon: float, state: SchedState, owner_of: Callable) -> StepView:
    """The step's view from the usage and shares found, the candidates (waiting since `since`,
    starving since `horizon` or before) and the arrivals `held` at the prefill side."""
    needs = {c.request_id: need_on(c, state) for c in candidates}
    within, within_pages = within_share([(owner_of(c), needs[c.request_id]) for c in candidates]
                                        + [(owner_of(h), h.num_pages) for h in held], use, shares)
    parked = {c.request_id for c in candidates if state.host_pages.get(c.request_id)} if state.host_pages else ()
    starved = longest_starving(since, horizon)
    return StepView(
        running_ids=frozenset(running_ids), parked_ids=frozenset(parked), use=use, shares=shares,
        over=over_share(use, shares), growth=growth, needs=needs, within=within, within_pages=within_pages,
        starved=starved or "", starved_need=needs[starved] if starved is not None else 0,
        starved_owner=None if starved is None else owner_of(next(c for c in candidates if c.request_id == starved)))


# ---- borrowing --------------------------------------------------------------------------------------
def borrow_reserve(owner: str, ent: Mapping, use: Mapping, size: Mapping, pages: int) -> float:
    """Free pages a borrower must leave: `pages` (what the running prompts and its own still
    take) and one typical request of each other owner with unused share."""
    reserve = float(pages)
    for o, e in ent.items():
        if o != owner:
            reserve += min(max(0.0, e - use.get(o, 0)), size.get(o, 0.0))
    return reserve


def quota_ok(owner: str, need: int, ent: Mapping, use: Mapping, free: int, *, prompt: int = 0,
             static: bool, within: Mapping, growth: int, size: Mapping) -> bool:
    """May `owner` take `need` more device pages (its prompt taking `prompt` more after them)?
    Within its share, yes; beyond it (borrowing, never with static shares) only while no other
    owner waits within its share, leaving `borrow_reserve` free."""
    if use.get(owner, 0) + need + prompt <= ent.get(owner, 0):
        return True
    if static:
        return False
    if any(n and o != owner for o, n in within.items()):
        return False
    return free - need >= borrow_reserve(owner, ent, use, size, growth + prompt)


def keeps_room_for_starved(view: StepView, rid: str, owner: str, need: int, use: Mapping, free: int,
                           total: int) -> bool:
    """Taking `need` pages of `free` (free already less a page per running row) leaves the
    longest-starving request's need free, or is that request, or is within its owner's share
    while the starving one fits beside what the other owners hold within their shares: it gets
    in as the borrowers' pages free up, without anyone demoted for it."""
    if not view.starved or rid == view.starved or free - need >= view.starved_need:
        return True
    if use.get(owner, 0) + need > view.shares.get(owner, 0):
        return False  # a borrower waits for the starving request
    kept = sum(min(use.get(o, 0) + (need if o == owner else 0), e)
               for o, e in view.shares.items() if o != view.starved_owner)
    return view.starved_need <= total - kept


def recently_moved(moved_at: float | None, now: float, hold_s: float) -> bool:
    """Moved between tiers within `hold_s`: a move copies its pages, and moving it back at once
    would copy them for nothing."""
    return moved_at is not None and now - moved_at < hold_s


# ---- reclaim ----------------------------------------------------------------------------------------
class Want(NamedTuple):
    """A request waiting for device pages, as reclaim sees it."""

    owner: str
    need: int  # device pages it needs now
    patient: bool  # not starving (the starving go first)
    since: float  # arrival (or first offer, for a held arrival)


def reclaim_wants(candidates: list[Sequence], held: list, view: StepView, state: SchedState, owner_of: Callable,
                  patient: Callable[[Sequence], bool]) -> list[Want]:
    """The requests waiting for device pages, in the order reclaim serves them: the starving
    first, then by how far below its share the owner is, then the oldest. A held arrival needs
    a page more (for its next token); one not retried here lately went elsewhere."""
    wants = [Want(owner_of(c), view.needs.get(c.request_id) or need_on(c, state), patient(c), c.arrival_time)
             for c in candidates]
    wants += [Want(owner_of(h), h.num_pages + 1, True, h.first_seen) for h in held]
    wants.sort(key=lambda w: (w.patient, view.over.get(w.owner, 0.0), w.since))
    return wants


@dataclass
class _Room:
    """A reclaim pass's own tally of the pages: device free, host free, use per owner."""

    free: int
    host_free: int
    use: dict


def unstarted(seq: Sequence) -> bool:
    """A prompt that has streamed nothing yet: taking its pages costs only the prefill it
    computed, and nobody sees a stream stall."""
    return seq.num_output_tokens == 0


def reclaim_victims(wants: list[Want], movable: list[Sequence], use: Mapping, shares: Mapping,
                    state: SchedState, rows: int, owner_of: Callable, drop: str = "off") -> list[Sequence]:
    """Requests to take pages from now, for the waiters in `wants` (in their order) within their
    share that cannot fit; `rows` running requests each keep a page for their next token. A
    borrower is demoted where the host tier has room. Where it has none (no host tier, or a full
    one), `drop` (the setting reclaim_drop) says which borrowers are dropped for recompute
    instead: none ("off": the waiter waits for free pages), prompts that streamed nothing
    ("prompts"), or any ("any", those first). A drop wastes the work it throws away where a
    demotion copies it, hence off by default."""
    droppable = {"any": lambda s: True, "prompts": unstarted, "off": lambda s: False}[drop]
    room, victims, tries = _Room(state.device_free, state.host_free, dict(use)), [], 0
    for w in wants:
        if w.need + rows - len(victims) <= room.free:
            _take(room, w)  # it fits without anyone leaving
            continue
        if room.use.get(w.owner, 0) + w.need > shares.get(w.owner, 0):
            continue  # beyond its own share, starving or not: it waits for free pages
        over_share = {o for o, n in room.use.items() if n > shares.get(o, 0)}
        if not over_share or tries >= RECLAIM_TRIES:
            break  # nobody borrows, or the most deserving waiters had their look this step
        tries += 1
        pool = [s for s in movable if owner_of(s) in over_share and s not in victims]
        gain = sum(state.gain.get(s.request_id, 0) for s in pool
                   if 0 < state.pages.get(s.request_id, 0) <= room.host_free or droppable(s))
        if w.need + rows - len(victims) > room.free + gain:
            continue  # taking all it could would not let it in: move or drop nobody for nothing
        _demote_for(w.need + rows, list(pool), victims, room, shares, state, owner_of)
        _drop_for(w.need + rows, [s for s in pool if droppable(s)], victims, room, shares, state, owner_of)
        if w.need + rows - len(victims) <= room.free:
            _take(room, w)
    return victims


def _take(room: _Room, w: Want) -> None:
    room.free -= w.need
    room.use[w.owner] = room.use.get(w.owner, 0) + w.need


def _demote_for(want: int, pool: list, victims: list, room: _Room, shares: Mapping, state: SchedState,
                owner_of: Callable) -> None:
    """Demote from `pool` until `want` less the victims fits `room.free`: the most over-share
    owner and the largest footprint first (its whole page table is copied down, and what
    evicting it frees is its exclusive pages)."""
    while want - len(victims) > room.free and pool:
        over = {o: room.use.get(o, 0) / e if e > 0 else float("inf") for o, e in shares.items()}
        v = eviction.footprint(pool, state, over, owner_of)
        pool.remove(v)
        pages = state.pages.get(v.request_id, 0)
        if not 0 < pages <= room.host_free:
            continue
        room.host_free -= pages
        victims.append(v)
        room.use[owner_of(v)] -= state.charge.get(v.request_id, 0)
        room.free += state.gain.get(v.request_id, 0)


def _drop_for(want: int, pool: list, victims: list, room: _Room, shares: Mapping, state: SchedState,
              owner_of: Callable) -> None:
    """Drop from `pool` for recompute until `want` less the victims fits `room.free`: prompts
    that streamed nothing before streams (no stream stalls), then the most over-share owner's,
    then the least computed (the least to redo). Only what was lent comes back: a drop that
    would leave its owner below its share is not made (the owner would reclaim in turn, and
    two owners would drop each other's work in turn). Nobody is dropped unless the drops
    together make the room: a drop that lets no one in only throws work away."""
    use, free, picked = dict(room.use), room.free, []
    left = [s for s in pool if s not in victims]
    while want - len(victims) - len(picked) > free:
        left = [s for s in left if use.get(owner_of(s), 0) - state.charge.get(s.request_id, 0)
                >= shares.get(owner_of(s), 0)]
        if not left:
            return
        over = {o: use.get(o, 0) / e if e > 0 else float("inf") for o, e in shares.items()}
        v = min(left, key=lambda s: (not unstarted(s), -over.get(owner_of(s), 0.0), s.num_computed_tokens,
                                     -s.arrival_time))
        left.remove(v)
        picked.append(v)
        use[owner_of(v)] -= state.charge.get(v.request_id, 0)
        free += state.gain.get(v.request_id, 0)
    victims.extend(picked)
    room.use, room.free = use, free


# ---- the step ---------------------------------------------------------------------------------------
def growth_caps(rows: list[Sequence], waiting: int, view: StepView, use: Mapping, state: SchedState,
                oldest: Sequence | None, owner_of: Callable) -> tuple[list[Sequence], dict[str, int]]:
    """(the rows that step, prompt -> tokens its chunk may take) while `waiting` pages are
    waited for: beyond its owner's share's room, a prompt's chunk takes what its pages hold and
    what the waiters leave free, and it sits the step out when that is nothing. The oldest
    running request always goes on, and decode rows always step."""
    ps, caps, out = state.page_size, {}, []
    free = state.device_free - len(rows)  # a page per row for its next token comes first
    for s in rows:
        if not s.in_prefill or s is oldest:
            out.append(s)
            continue
        o = owner_of(s)
        others = waiting - view.within_pages.get(o, 0)  # (the starving request's need whoever's it is)
        held = state.pages.get(s.request_id, 0)
        room = max(0, int(view.shares.get(o, 0) - use.get(o, 0)), free - others)
        tokens = min(s.num_uncomputed_tokens, state.token_budget, held * ps - s.num_computed_tokens + room * ps)
        if others and tokens <= 0:
            continue  # it waits this step, keeping its pages
        if others:
            caps[s.request_id] = tokens
        free -= max(0, pages_for(s.num_computed_tokens + tokens, ps) - held)
        out.append(s)
    return out, caps


class Prompt(NamedTuple):
    """A prompt with tokens to prefill this step."""

    owner: str
    request_id: str
    arrival: float
    size: int  # its tokens in all (smallest first)
    want: int  # tokens it has left to prefill


def step_prompts(rows: list[Sequence], candidates: list[Sequence], needs: Mapping, state: SchedState,
                 owner_of: Callable, promised: int = 0) -> tuple[list[Prompt], int, dict[str, tuple[int, int]]]:
    """(the prompts to prefill, the decode rows, owner -> (its decode rows, their context)):
    the running prompts with tokens left, the waiting ones that fit the free pages less those
    `promised` (what the running prompts still take, where a prompt gets in only beside it);
    a parked row comes back to decode."""
    prompts: list[Prompt] = []
    decode: dict[str, tuple[int, int]] = {}
    decode_rows = 0
    for s in rows:
        n = len(s.token_ids)  # (num_uncomputed_tokens and num_output_tokens, inline: every row, every step)
        left = n - s.num_computed_tokens
        if left > 1 or n == s.num_prompt_tokens:
            prompts.append(Prompt(owner_of(s), s.request_id, s.arrival_time, s.num_tokens, left))
        else:
            decode_rows += 1
            o = owner_of(s)
            r, c = decode.get(o, (0, 0))
            decode[o] = (r + 1, c + n)
    free = state.device_free - len(rows) - promised
    for c in candidates:
        if c.num_computed_tokens:
            decode_rows += 1
        elif (needs.get(c.request_id) or need_on(c, state)) <= free:
            prompts.append(Prompt(owner_of(c), c.request_id, c.arrival_time, c.num_tokens, c.num_tokens))
    return prompts, decode_rows, decode


def owner_demand(prompts: list[Prompt]) -> dict[str, int]:
    """Tokens each owner's prompts want this step."""
    demand: dict[str, int] = {}
    for p in prompts:
        demand[p.owner] = demand.get(p.owner, 0) + p.want
    return demand


def split_prefill(prompts: list[Prompt], demand: Mapping, weights: Mapping, total: int) -> dict[str, int]:
    """Prompt -> tokens it may take of `total`: each owner's floor (PREFILL_FLOOR of its weighted
    max-min share of `demand`) to its oldest prompts, then the rest to the smallest prompts first."""
    floor = {o: int(PREFILL_FLOOR * v) for o, v in water_fill(demand, weights, total).items()}
    allot: dict[str, int] = {}
    for p in sorted(prompts, key=lambda p: (p.arrival, p.request_id)):
        give = min(p.want, floor.get(p.owner, 0))
        if give > 0:
            allot[p.request_id] = give
            floor[p.owner] -= give
    left = total - sum(allot.values())
    # a heap, since only the first few of a long queue get tokens (sorting all of it every step
    # was most of the policy's time per step)
    heap = [(p.size, p.arrival, p.request_id, p.want) for p in prompts]
    heapq.heapify(heap)
    while heap and left > 0:
        _, _, rid, want = heapq.heappop(heap)
        give = min(want - allot.get(rid, 0), left)
        if give > 0:
            allot[rid] = allot.get(rid, 0) + give
            left -= give
    return allot


@dataclass(frozen=True)
class PrefillPlan:
    """A step's prefill tokens, found once by `plan_prefill` (the step's order is set)."""

    allot: Mapping[str, int] = field(default_factory=dict)  # prompt -> tokens it may take (empty: no split)
    decode: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # owner -> (its decode rows, their context)
    decode_total: tuple[int, int] = (0, 0)  # all owners' decode rows and their context
    prompts: int = 0  # prompts with tokens to prefill


def plan_prefill(rows: list[Sequence], candidates: list[Sequence], needs: Mapping, state: SchedState,
                 owner_of: Callable, weight_of: Callable[[str], float], promised: int = 0) -> PrefillPlan:
    """The step's prefill split (`split_prefill`) when more than one owner has prompts; one
    owner prefilling has the whole budget, in step order. A waiting prompt takes part only if
    it can get in (`step_prompts`): one that cannot would take the running prompts' tokens
    for nothing."""
    prompts, decode_rows, decode = step_prompts(rows, candidates, needs, state, owner_of, promised)
    total = (sum(r for r, _ in decode.values()), sum(c for _, c in decode.values()))
    demand = owner_demand(prompts)
    allot: dict[str, int] = {}
    if len(demand) > 1:
        weights = {o: weight_of(o) for o in demand}
        allot = split_prefill(prompts, demand, weights, max(len(demand), state.token_budget - decode_rows))
    return PrefillPlan(allot, decode, total, len(prompts))


# ---- the chunk bound --------------------------------------------------------------------------------
def chunk_within_step_time(price: Callable[[StepShape], float], n: int, start: int, rows: int, ctx: int,
                           added: tuple[int, int, int], token_budget: int, page_size: int) -> int:
    """The largest chunk up to `n` tokens, starting at token `start`, that with the chunks
    `added` before it (chunks, tokens, query-key pairs) keeps the step's price within an
    ordinary step's: its `rows` decode rows (`ctx` context) beside the budget's worth of fresh
    prompt tokens. At least a page (or `n`)."""
    chunks, tokens, pairs = added

    def cost(k: int) -> float:
        return price(StepShape(rows, ctx, chunks + 1, tokens + k, pairs + k * start + k * (k + 1) // 2))

    t = max(1, token_budget - rows)
    k, limit = n, price(StepShape(rows, ctx, 1, t, t * (t + 1) // 2))
    if cost(n) > limit:
        lo, hi = min(n, page_size), n  # cost(lo) may be over the limit: a page is the least
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= limit else (lo, mid - 1)
        k = lo
    return k


def with_chunk(added: tuple[int, int, int], k: int, start: int) -> tuple[int, int, int]:
    """The step's (chunks, tokens, query-key pairs) with a chunk of `k` tokens from `start` added."""
    chunks, tokens, pairs = added
    return chunks + 1, tokens + k, pairs + k * start + k * (k + 1) // 2


# ---- victims ----------------------------------------------------------------------------------------
def choose_victim(candidates: list[Sequence], over: Mapping, owner_of: Callable, state: SchedState,
                  demotable: Callable[[Sequence, SchedState], bool],
                  chunk_waits: Callable[[], bool]) -> Sequence | None:
    """The most over-share owner gives pages back: demoted, its largest footprint (no work is
    lost, and fewest moves free the most); else None when the requester's chunk waits
    (`chunk_waits()`); else dropped for recompute, its request with the least computed work."""
    top = max(over.get(owner_of(s), 0.0) for s in candidates)
    mine = [s for s in candidates if over.get(owner_of(s), 0.0) == top]
    movable = [s for s in mine if demotable(s, state)]
    if movable:
        return eviction.footprint(movable, state, over, owner_of)
    if chunk_waits():
        return None
    return min(mine, key=lambda s: (s.num_computed_tokens, -s.arrival_time))
