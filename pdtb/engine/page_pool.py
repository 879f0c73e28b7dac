r"""Paged KV pool: one tensor of pages plus a per-page ownership state machine.

Page states (see DESIGN.md):

    FREE --reserve--> RESERVED --commit--> RESIDENT|PARKED --free--> FREE
      |                   \--cancel--> FREE
      \--allocate--> RESIDENT (device tier) | PARKED (host tier)

The pool is mechanism only: it never decides who gets pages. `check()` verifies that the
states add up to the pool size and that every owned page belongs to exactly one owner.
"""
from __future__ import annotations

import enum

import torch

from pdtb.engine import host_memory
from pdtb.engine.kv_spec import KVSpec


class PageState(enum.IntEnum):
    FREE = 0
    RESERVED = 1  # a transfer may still write into it; cannot be handed on
    RESIDENT = 2  # device tier, owned by one request
    PARKED = 3  # host tier, owned by one request


class PoolError(RuntimeError):
    """A caller broke the ownership rules (freeing pages it does not own, ...)."""


class PagePool:
    """Fixed-size pool of KV pages for one tier of one node."""

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu",
                 tier: str = "device", pin_memory: bool = False, storage: bool = True) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        if tier not in ("device", "host"):
            raise ValueError("tier must be 'device' or 'host'")
        self.spec = spec
        self.num_pages = num_pages
        self.tier = tier
        pin = pin_memory and torch.cuda.is_available()
        if not storage:  # ownership only (pdtb sim): the same state machine at any pool size, no bytes
            self.kv = None
        elif torch.device(device).type == "cpu" and not pin:  # scattered page reads: huge pages help
            self.kv = host_memory.zeros(spec.page_shape(num_pages), spec.torch_dtype)
        else:
            self.kv = torch.zeros(spec.page_shape(num_pages), dtype=spec.torch_dtype, device=device, pin_memory=pin)
        self._owned_state = PageState.RESIDENT if tier == "device" else PageState.PARKED
        self._state = [PageState.FREE] * num_pages
        self._owner: list[str | None] = [None] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._by_owner: dict[str, list[int]] = {}
        self.version = 0  # bumped by every change of ownership (lets callers cache snapshots)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_page(self) -> int:
        return self.spec.bytes_per_page

    def pages_of(self, owner: str) -> list[int]:
        """Pages held by `owner` in allocation order (its page table in this pool)."""
        return list(self._by_owner.get(owner, ()))

    def num_held(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def held_counts(self) -> dict[str, int]:
        """Pages held per owner (a snapshot for policies)."""
        return {o: len(p) for o, p in self._by_owner.items()}

    def owners(self) -> list[str]:
        return list(self._by_owner)

    def state_counts(self) -> dict[str, int]:
        counts = {s.name.lower(): 0 for s in PageState}
        for s in self._state:
            counts[s.name.lower()] += 1
        return counts

    # ---- transitions ---------------------------------------------------------------------
    def _take(self, owner: str, n: int, state: PageState) -> list[int] | None:
        if n < 0:
            raise ValueError("cannot take a negative number of pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []  # no entry for an owner that holds nothing
        pages = [self._free.pop() for _ in range(n)]
        self.version += 1
        for p in pages:
            self._state[p] = state
            self._owner[p] = owner
        self._by_owner.setdefault(owner, []).extend(pages)
        return pages

    def allocate(self, owner: str, n: int) -> list[int] | None:
        """Give `owner` n more pages (owned state of this tier), or None if they do not fit."""
        return self._take(owner, n, self._owned_state)

    def reserve(self, owner: str, n: int) -> list[int] | None:
        """Reserve n pages for an incoming transfer into `owner`; None if they do not fit."""
        return self._take(owner, n, PageState.RESERVED)

    def commit(self, owner: str) -> None:
        """The transfer into `owner`'s reserved pages is done: they become owned."""
        self.version += 1
        for p in self._by_owner.get(owner, ()):
            if self._state[p] == PageState.RESERVED:
                self._state[p] = self._owned_state

    def free(self, owner: str, pages: list[int] | None = None) -> int:
        """Return `owner`'s pages (all, or the given ones) to the free list. Returns the count.

        Freeing a page that `owner` does not hold raises PoolError: a request can never free
        another request's pages.
        """
        held = self._by_owner.get(owner)
        if not held:
            if pages:
                raise PoolError(f"{owner!r} holds no pages")
            return 0
        if pages is None:
            pages = list(held)
        drop = set(pages)
        for p in drop:
            if self._owner[p] != owner:
                raise PoolError(f"page {p} is not owned by {owner!r}")
        self.version += 1
        for p in drop:
            self._state[p] = PageState.FREE
            self._owner[p] = None
            self._free.append(p)
        rest = [p for p in held if p not in drop]
        if rest:
            self._by_owner[owner] = rest
        else:
            del self._by_owner[owner]
        return len(drop)

    # ---- bytes ---------------------------------------------------------------------------
    def export_pages(self, pages: list[int]) -> torch.Tensor:
        """Copy the given pages (all layers, K and V) into one contiguous tensor."""
        idx = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        return self.kv.index_select(2, idx).contiguous()

    def import_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Write a contiguous export (shape spec.page_shape(len(pages))) into `pages`."""
        expect = self.spec.page_shape(len(pages))
        if tuple(data.shape) != expect:
            raise ValueError(f"import shape {tuple(data.shape)} != expected {expect}")
        idx = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, idx, data.to(device=self.kv.device, dtype=self.kv.dtype))

    def copy_pages_to(self, src_pages: list[int], dst: "PagePool", dst_pages: list[int]) -> int:
        """Copy pages into another pool (tier move: device <-> host). Returns bytes copied."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("page lists differ in length")
        if dst.spec != self.spec:
            raise ValueError("pools of different page geometry")
        if self.kv is None or dst.kv is None:  # a pool without storage moves ownership, not bytes
            return len(src_pages) * self.bytes_per_page
        src = torch.tensor(src_pages, dtype=torch.long, device=self.kv.device)
        idx = torch.tensor(dst_pages, dtype=torch.long, device=dst.kv.device)
        dst.kv.index_copy_(2, idx, self.kv.index_select(2, src).to(dst.kv.device, non_blocking=True))
        return len(src_pages) * self.bytes_per_page

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Raise PoolError unless every page is free or owned by exactly one live owner."""
        seen: set[int] = set()
        for owner, pages in self._by_owner.items():
            for p in pages:
                if p in seen:
                    raise PoolError(f"page {p} listed twice")
                seen.add(p)
                if self._owner[p] != owner or self._state[p] == PageState.FREE:
                    raise PoolError(f"page {p} state/owner mismatch")
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolError("free list has duplicates")
        if free & seen or len(free) + len(seen) != self.num_pages:
            raise PoolError("free and owned pages do not add up to the pool size")
        for p in free:
            if self._state[p] != PageState.FREE or self._owner[p] is not None:
                raise PoolError(f"free page {p} has state {self._state[p]}")
