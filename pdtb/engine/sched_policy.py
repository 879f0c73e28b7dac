"""The questions the scheduler asks a policy, and the default answers (FIFO, newest victim).

The scheduler is mechanism: it allocates, copies and frees pages. Every choice of *order* is
asked here. Policies are pure with respect to the scheduler: they read the sequences and a
`SchedState` snapshot, never mutate them (they may keep their own counters).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from pdtb.engine.sequence import Sequence


@dataclass(frozen=True)
class SchedState:
    """What a policy may see of the node at decision time."""

    now: float  # the clock (seconds); tests pass a fake one
    step: int  # scheduler step counter
    page_size: int  # tokens per page
    page_bytes: int  # bytes of one page (all layers, K and V)
    device_total: int  # pages in the device tier
    device_free: int
    host_total: int  # pages in the host tier (0: no host tier)
    host_free: int
    pages: dict  # request id -> pages it holds in the device tier
    host_pages: dict  # request id -> pages it holds in the host tier
    token_budget: int = 2048  # tokens one step may carry (the chunked-prefill budget)
    # with shared prefix pages: request id -> pages charged to it (the pool's charge rule) and
    # pages only it holds (what evicting it gives back); None: nothing is shared, both == pages
    charged: dict | None = None
    exclusive: dict | None = None
    # with a prefix cache: cached_pages(seq) -> leading pages of a waiting request's prompt this
    # node holds (what admitting it would not prefill); None: no prefix cache
    cached_pages: Callable[[Sequence], int] | None = None
    # step_s(StepShape) -> seconds a step of that shape takes on this node (its own fit of the
    # steps it ran, engine/step_cost.py; the simulator's cost model); None: not known yet
    step_s: Callable | None = None

    @property
    def charge(self) -> dict:
        return self.pages if self.charged is None else self.charged

    @property
    def gain(self) -> dict:
        return self.pages if self.exclusive is None else self.exclusive


class SchedPolicy(Protocol):
    name: str
    strict_order: bool  # stop admitting at the first candidate that does not fit

    def step_order(self, running: list[Sequence], state: SchedState) -> list[Sequence]:
        """Order (and filter: bandwidth caps) of running requests this step; the tail is evicted first."""

    def admission_order(self, candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        """Order in which parked and waiting requests get device pages."""

    def may_admit(self, seq: Sequence, need_pages: int, state: SchedState) -> bool:
        """Quota check for giving `seq` `need_pages` more device pages."""

    def pick_victim(self, candidates: list[Sequence], requester: Sequence, state: SchedState) -> Sequence:
        """Which running request loses its device pages so `requester` can grow; None, for a
        requester still prefilling, has it wait for pages this step instead."""

    def chunk_limit(self, seq: Sequence, budget: int, state: SchedState) -> int:
        """Tokens a prefill chunk (a newly admitted prompt's first, or a later one) may take of the step's remaining budget."""

    def reclaim(self, running: list[Sequence], candidates: list[Sequence], state: SchedState) -> list[Sequence]:
        """Running requests to evict before this step so that waiting/parked ones can be admitted."""

    def on_step(self, chunks: list, state: SchedState) -> None:
        """Told what was served this step (list of ScheduledChunk), to keep counters current."""


class FifoPolicy:
    """Arrival order everywhere; the newest running request is the victim (vLLM's default)."""

    name = "fifo"
    strict_order = True

    def step_order(self, running, state):
        return running

    def admission_order(self, candidates, state):
        return candidates

    def may_admit(self, seq, need_pages, state):
        return True

    def pick_victim(self, candidates, requester, state):
        return candidates[-1]

    def chunk_limit(self, seq, budget, state):
        return budget

    def reclaim(self, running, candidates, state):
        return []

    def on_step(self, chunks, state):
        pass
