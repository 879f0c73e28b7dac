"""A token bucket per tenant on the KV bytes its attention reads (`--tenant-bw-cap`): which
rows step, and what an admission's first read costs.

The bucket refills at the cap (bytes/s) up to one window's worth (`bw_window_s`); every row
that steps costs the bytes its attention reads (its pages). A row steps only if its cost fits
the bucket or, for a row costing more than a whole window, when the bucket is full (it then goes
negative and refills before the tenant reads again). Over any stretch a tenant reads at most
the cap, plus one window of burst. The level is read once a step, and charged when it ends.
"""
from __future__ import annotations

from pdtb.engine.sched_policy import SchedState


class BandwidthBucket:
    """The buckets of every tenant under a cap of `cap` bytes/s, a window of `window_s`."""

    def __init__(self, cap: float, window_s: float) -> None:
        self.cap, self.burst = cap, cap * window_s
        self.level: dict[str, tuple[float, float]] = {}  # tenant -> (bucket bytes, when last charged)
        self.left: dict[str, float] = {}  # tenant -> bytes it may still read this step

    def rows(self, running: list, state: SchedState) -> list:
        """The rows that step this step, in order: each whose read fits its tenant's bucket."""
        self.left = {}
        return [s for s in running if self.take(s.tenant, state.pages.get(s.request_id, 0) * state.page_bytes, state)]

    def fits(self, tenant: str, nbytes: int, state: SchedState) -> bool:
        left = self.left.get(tenant)
        if left is None:
            left = self.left[tenant] = self.now(tenant, state)
        return nbytes <= left or (nbytes > self.burst and left >= self.burst)

    @staticmethod
    def first_read(seq, need_pages: int, state: SchedState) -> int:
        """Bytes an admitted request's first step reads: its pages and the `need_pages` it takes."""
        return (state.pages.get(seq.request_id, 0) + need_pages) * state.page_bytes

    def spend(self, tenant: str, nbytes: int) -> None:
        """Charge `nbytes` to this step's allowance (after `fits` read the tenant's level)."""
        self.left[tenant] -= nbytes

    def take(self, tenant: str, nbytes: int, state: SchedState) -> bool:
        """Reserve `nbytes` of `tenant`'s bucket for this step; False if it does not fit."""
        if not self.fits(tenant, nbytes, state):
            return False
        self.spend(tenant, nbytes)
        return True

    def now(self, tenant: str, state: SchedState) -> float:
        """The tenant's bucket now: refilled at the cap since it was last charged, at most a window."""
        level, since = self.level.get(tenant, (self.burst, state.now))
        return min(self.burst, level + self.cap * max(0.0, state.now - since))

    def charge(self, chunks: list, state: SchedState) -> None:
        """The step served `chunks`: attention read every page of each request once."""
        spent: dict[str, int] = {}
        for c in chunks:
            spent[c.seq.tenant] = spent.get(c.seq.tenant, 0) + state.pages.get(c.seq.request_id, 0) * state.page_bytes
        for t, nbytes in spent.items():
            self.level[t] = (self.now(t, state) - nbytes, state.now)
