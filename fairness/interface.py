"""The declared interface between a fairness policy and the nodes and simulator that run it.

A policy is an object with the methods of `Policy` below. The nodes, the simulator and the
scheduler call nothing else on it, and change none of its state: what a policy remembers, it
changes itself, told through these methods. `fairness.base.BasePolicy` answers every method
with first-come first-served defaults, so a policy overrides only what it changes.

Call order within one scheduler step (pdtb/engine/scheduler.py; tests/fairness/test_call_order.py):

    reclaim (begins the step: a policy refreshes its per-step view here)
      -> step_order
      -> per running row, in that order: chunk_limit (a prompt's chunk), then pick_victim
         (zero or more, while the row's chunk lacks free pages)
      -> admission_order
      -> per candidate, in that order: chunk_limit (a prompt's chunk of more than a token),
         then may_admit (when the pages of that chunk are free), then admitted after a yes
      -> on_step

A candidate's chunk is sized before it is asked in: `may_admit` is asked for the pages of the
chunk `chunk_limit` just gave it. Another engine's adapter (pdtb/integrations/fair_step.py) asks
in the same order, chunk_limit only of the running prompts.

Between steps, on a decode node (and in the simulator's), for each inherited request offered
from the prefill side: refresh -> place_arrival. `forget` when a request is no longer this
node's concern (it ended, was aborted, or an arrival it was holding went elsewhere).

Two methods are optional. `admitted(seq, need_pages, state)`: told right after a yes of
`may_admit` (which has no side effect), so that what a policy books for an admission it books
there. `on_steps(chunks, state, starts)`: the simulator takes runs of identical
decode steps at once (pdtb/sim/coast.py) only for a policy that has it: every running row
decoding one token a step, nothing waiting, parked or held, no page changing tier. In those
steps the policy is not asked (it would reclaim nothing, step every row and admit no one); it
is told instead, before it is next asked anything, that `len(starts)` such steps began at
`starts`, serving `chunks`. `state` is the node as the last of them began, and each row's
sequence is as it was then (the earlier steps' tokens appended, not the last one's). A policy
whose answers depend on every step (BasePolicy with a bandwidth cap) sets it to None.

One attribute besides the methods, optional: `cluster`. A decode or colocated node that is
one of several sets it, with every ping from the router, to a `fairness.cluster.ClusterView`
of what the other nodes hold (None: alone, or not yet told). A policy without the attribute
is not told; memfair derives its shares from it (a tenant's share is cluster-wide).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import Sequence


class Placement(enum.Enum):
    """Where an inherited request's KV goes, the policy's answer to `place_arrival`."""

    DEVICE = "device"  # the device tier: pages reserved now, the request decodes once they land
    HOST = "host"  # the host tier: parked, promoted to the device tier in admission order
    DEFER = "defer"  # not now: the prefill side keeps the pages and offers it again


@dataclass
class Arrival:
    """An inherited request as seen from its transfer header, before any payload."""

    request_id: str
    tenant: str
    priority: int
    num_pages: int  # device pages its KV needs
    first_seen: float  # state.now when first offered (held requests keep their place)
    last_seen: float
    num_tokens: int = 0  # tokens of context it arrives with (0: unknown)
    max_new_tokens: int = 0  # tokens it may still generate (0: unknown)
    slo_tier: str = ""  # its SLO tier ("": none), for quotas by tier


@dataclass(frozen=True)
class QuotaView:
    """What a policy reports of its memory quotas (empty for a policy without quotas)."""

    by_name: dict = field(default_factory=dict)  # entitlement in device pages per tenant / class / tier name
    by_owner: dict = field(default_factory=dict)  # the same keyed by quota owner ("t:alice", fairness/owners.py)


@runtime_checkable
class Policy(Protocol):
    """Every method a node, the simulator or the scheduler calls on a policy."""

    name: str  # shown in logs, stats and results
    strict_order: bool  # True: admission stops at the first candidate that does not fit (FIFO)

    def refresh(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> None:
        """Bring the policy's view of the node up to date (called before a placement, since an
        idle node does not step; every step begins with it through `reclaim`)."""

    def reclaim(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        """Begin a step: running requests to evict now so that candidates can be admitted."""

    def step_order(self, running: list[Sequence], state: SchedState) -> list[Sequence]:
        """Running requests in the order they step (a filtered subset sits the step out); the
        tail is evicted first under pressure."""

    def pick_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        """Which of `candidates` (never empty) gives up its device pages so `requester` can grow;
        None, when `requester` is still prefilling, has its chunk wait for pages this step (keeping
        its own) instead of taking anyone's."""

    def admission_order(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        """The order in which parked and waiting requests get device pages."""

    def may_admit(self, seq: Sequence, need_pages: int, state: SchedState) -> bool:
        """May `seq` take `need_pages` more device pages now? (They are free: the scheduler checked.)"""

    def admitted(self, seq: Sequence, need_pages: int, state: SchedState) -> None:
        """`seq` took `need_pages` device pages on a yes of `may_admit` (which has no side effect:
        what a policy books for an admission, it books here)."""

    def chunk_limit(self, seq: Sequence, budget: int, state: SchedState) -> int:
        """Tokens a prefill chunk of `seq` may take of the step's remaining `budget`."""

    def on_step(self, chunks: list, state: SchedState) -> None:
        """What the step served (a list of `ScheduledChunk`), to keep counters current."""

    def place_arrival(self, arrival: Arrival, queued: int, state: SchedState) -> Placement:
        """Where an inherited request's KV goes (`queued`: requests waiting or parked here)."""

    def waiting_arrivals(self, state: SchedState) -> list[Arrival]:
        """Arrivals deferred here and still offered again: work waiting for this node's pages."""

    def forget(self, request_id: str) -> None:
        """`request_id` is no longer this node's concern as an arrival or a request: it ended,
        was aborted, or went elsewhere; or, as an arrival, it was parked here (it comes back as
        a candidate: keep what a candidate needs)."""

    def quotas(self) -> QuotaView:
        """The policy's current memory entitlements, for stats and metrics."""


# The methods a policy class must have; a class lacking one is refused when it is loaded.
REQUIRED_METHODS = ("refresh", "reclaim", "step_order", "pick_victim", "admission_order", "may_admit",
                    "chunk_limit", "on_step", "place_arrival", "waiting_arrivals", "forget", "quotas")
OPTIONAL_METHODS = ("on_steps", "admitted")  # see the module doc; BasePolicy has both
REQUIRED_ATTRIBUTES = ("name", "strict_order")
OPTIONAL_ATTRIBUTES = ("cluster",)  # set by a node of several when the policy has it (see the module doc)
