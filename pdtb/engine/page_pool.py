r"""Paged KV pool: one tensor of pages plus a per-page ownership state machine.

Page states (see DESIGN.md):

    FREE --reserve--> RESERVED --commit--> RESIDENT|PARKED --free--> FREE
      |                   \--cancel--> FREE
      \--allocate--> RESIDENT (device tier) | PARKED (host tier)
    RESIDENT (registered) --last holder frees--> CACHED --share--> RESIDENT
                                                  \--taken for new pages--> FREE

The pool is mechanism only: it never decides who gets pages. `check()` verifies that the
states add up to the pool size and that every held page has as many holders as page tables
listing it.
"""
from __future__ import annotations

import enum

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where storage is made or moved: a pool without storage needs no torch)
    import torch

from pdtb.engine import host_memory, shared_memory
from pdtb.engine.kv_spec import KVSpec


class PageState(enum.IntEnum):
    FREE = 0
    RESERVED = 1  # a transfer may still write into it; cannot be handed on
    RESIDENT = 2  # device tier, held by one request or more
    PARKED = 3  # host tier, held by one request
    CACHED = 4  # device tier, held by nobody: a full page kept for its hash until its memory is needed


CHARGES = ("split", "first", "full")  # how a page held by several requests counts against quotas


class PoolError(RuntimeError):
    """A caller broke the ownership rules (freeing pages it does not own, ...)."""


class PagePool:
    """Fixed-size pool of KV pages for one tier of one node.

    Prefix cache (device tier): a full page whose tokens are computed may be registered under
    its chained hash (prefix_hash.py). Other requests whose prompts start the same way `share`
    it read-only; a page's reference count is the number of its holders. A registered page
    whose last holder lets go stays CACHED, reusable by hash, and is taken back (least
    recently released first) only when free pages run out; `num_free` counts it as free.
    Unregistered pages are private: one holder, freed on release.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: str | torch.device = "cpu",
                 tier: str = "device", pin_memory: bool = False, storage: bool = True,
                 charge: str = "split", shared: bool = False) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        if tier not in ("device", "host"):
            raise ValueError("tier must be 'device' or 'host'")
        if charge not in CHARGES:
            raise ValueError(f"charge must be one of {CHARGES}")
        self.spec = spec
        self.num_pages = num_pages
        self.tier = tier
        self.charge = charge
        self.shared = None
        self.kv = None  # ownership only (pdtb sim: storage=False): the same state machine at any size, no bytes
        if storage or shared:
            self._allocate(device, pin_memory, storage, shared)
        self._owned_state = PageState.RESIDENT if tier == "device" else PageState.PARKED
        self._state = [PageState.FREE] * num_pages
        self._holders: list[list[str]] = [[] for _ in range(num_pages)]  # in order of taking
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._by_owner: dict[str, list[int]] = {}
        self._hash: list[int | None] = [None] * num_pages  # registered pages only
        self._by_hash: dict[int, int] = {}  # hash -> its page
        self._lru: dict[int, None] = {}  # CACHED pages, least recently released first
        self._shared: set[int] = set()  # pages with two holders or more
        self.version = 0  # bumped by every change of ownership (lets callers cache snapshots)

    def _allocate(self, device, pin_memory: bool, storage: bool, shared: bool) -> None:
        import torch

        spec, num_pages, tier = self.spec, self.num_pages, self.tier
        pin = pin_memory and torch.cuda.is_available()
        # where peers may map kv: shared_memory.SharedBuffer (host memory) or
        # cuda_ipc.CudaSharedBuffer (a GPU pool, exported once it is allocated below)
        cuda = torch.device(device).type == "cuda"
        if shared and not cuda:  # a one-sided sender on this host writes straight into these pages
            if torch.device(device).type != "cpu" or pin:
                raise ValueError("a shared pool lives in host memory (device='cpu', no pinning) or on a CUDA device")
            self.shared = shared_memory.SharedBuffer(spec.bytes_per_page * num_pages, f"pdtb-kv-{tier}")
            self.kv = self.shared.tensor(spec.page_shape(num_pages), spec.torch_dtype)
        elif not storage:
            self.kv = None
        elif torch.device(device).type == "cpu" and not pin:  # scattered page reads: huge pages help
            self.kv = host_memory.zeros(spec.page_shape(num_pages), spec.torch_dtype)
        else:
            self.kv = torch.zeros(spec.page_shape(num_pages), dtype=spec.torch_dtype, device=device, pin_memory=pin)
        if shared and cuda:  # one-sided device copies into these pages, over CUDA IPC
            from pdtb.engine.cuda_ipc import CudaSharedBuffer

            self.shared = CudaSharedBuffer(self.kv)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages a caller can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Registered pages nobody holds (kept for reuse, counted in num_free)."""
        return len(self._lru)

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    @property
    def num_shared(self) -> int:
        """Pages with two holders or more (none: every charge rule counts held pages)."""
        return len(self._shared)

    @property
    def bytes_per_page(self) -> int:
        return self.spec.bytes_per_page

    def pages_of(self, owner: str) -> list[int]:
        """Pages held by `owner` in allocation order (its page table in this pool)."""
        return list(self._by_owner.get(owner, ()))

    def num_held(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def held_counts(self) -> dict[str, int]:
        """Pages each owner's page table holds, shared ones counted in full."""
        return {o: len(p) for o, p in self._by_owner.items()}

    def charged_counts(self) -> dict[str, float]:
        """Pages charged to each owner under the pool's charge rule: `split` divides a shared
        page evenly among its holders, `first` charges it to its oldest holder, `full` to
        every holder. Without shared pages every rule gives held_counts()."""
        out: dict[str, float] = {o: len(p) for o, p in self._by_owner.items()}
        if self.charge == "full":
            return out
        for p in self._shared:
            hs = self._holders[p]
            if self.charge == "split":
                less = 1.0 - 1.0 / len(hs)
                for h in hs:
                    out[h] -= less
            else:
                for h in hs[1:]:
                    out[h] -= 1
        return out

    def exclusive_counts(self) -> dict[str, int]:
        """Pages each owner alone holds: what releasing it would give back."""
        out = {o: len(p) for o, p in self._by_owner.items()}
        for p in self._shared:
            for h in self._holders[p]:
                out[h] -= 1
        return out

    def shared_counts(self) -> dict[str, int]:
        """Pages each owner holds together with another holder."""
        out: dict[str, int] = {}
        for p in self._shared:
            for h in self._holders[p]:
                out[h] = out.get(h, 0) + 1
        return out

    def refcount(self, page: int) -> int:
        return len(self._holders[page])

    def owners(self) -> list[str]:
        return list(self._by_owner)

    def state_counts(self) -> dict[str, int]:
        counts = {s.name.lower(): 0 for s in PageState}
        for s in self._state:
            counts[s.name.lower()] += 1
        return counts

    # ---- prefix cache ----------------------------------------------------------------------
    def match(self, hashes: list[int]) -> list[int]:
        """Pages holding the leading run of `hashes` (registered and committed), in order."""
        out = []
        by_hash, state = self._by_hash, self._state
        for h in hashes:
            p = by_hash.get(h)
            if p is None or state[p] == PageState.RESERVED:
                break
            out.append(p)
        return out

    def num_revived(self, pages: list[int]) -> int:
        """How many of `pages` are CACHED (sharing them takes them out of num_free)."""
        lru = self._lru
        return sum(1 for p in pages if p in lru)

    def share(self, owner: str, pages: list[int]) -> None:
        """Add `owner` as a holder of registered pages (from `match`), at the start of its page
        table: a request shares only its leading pages, before it takes any of its own."""
        if not pages:
            return
        if self._by_owner.get(owner):
            raise PoolError(f"{owner!r} already holds pages: shared pages lead a page table")
        for p in pages:
            if self._hash[p] is None or self._state[p] not in (PageState.CACHED, PageState.RESIDENT):
                raise PoolError(f"page {p} is not a registered committed page")
        self.version += 1
        for p in pages:
            hs = self._holders[p]
            if owner in hs:
                raise PoolError(f"page {p} listed twice for {owner!r}")
            if not hs:
                del self._lru[p]
                self._state[p] = PageState.RESIDENT
            hs.append(owner)
            if len(hs) == 2:
                self._shared.add(p)
        self._by_owner[owner] = list(pages)

    def register(self, owner: str, first: int, hashes: list[int]) -> int:
        """Register `owner`'s pages [first, first + len(hashes)) of its page table under
        `hashes` (their tokens are computed). A page already registered, or a hash already held
        by another page, is left as it is. Returns the pages newly registered."""
        if self.tier != "device":
            return 0
        table = self._by_owner.get(owner, ())
        n = 0
        for i, h in enumerate(hashes, first):
            if i >= len(table):
                break
            p = table[i]
            if self._hash[p] is not None or h in self._by_hash or self._state[p] != PageState.RESIDENT:
                continue
            self._hash[p] = h
            self._by_hash[h] = p
            n += 1
        return n

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to `limit` registered hashes: those of held pages, then cached ones, most
        recently released first. A bounded summary of what this pool can serve."""
        lru = self._lru
        out = [h for h, p in self._by_hash.items() if p not in lru][:limit]
        for p in reversed(lru):
            if len(out) >= limit:
                break
            out.append(self._hash[p])
        return out

    def _unregister(self, p: int) -> None:
        h = self._hash[p]
        if h is not None:
            self._hash[p] = None
            if self._by_hash.get(h) == p:
                del self._by_hash[h]

    def drop_cache(self) -> int:
        """Forget every cached page nobody holds. Returns how many were dropped."""
        n = len(self._lru)
        for p in list(self._lru):
            self._evict_cached(p)
        if n:
            self.version += 1
        return n

    def _evict_cached(self, p: int) -> None:
        del self._lru[p]
        self._unregister(p)
        self._state[p] = PageState.FREE
        self._free.append(p)

    # ---- transitions ---------------------------------------------------------------------
    def _take(self, owner: str, n: int, state: PageState) -> list[int] | None:
        if n < 0:
            raise ValueError("cannot take a negative number of pages")
        free = self._free
        if n > len(free) + len(self._lru):
            return None
        if n == 0:
            return []  # no entry for an owner that holds nothing
        while len(free) < n:  # the least recently released cached pages give way
            self._evict_cached(next(iter(self._lru)))
        pages = free[-n:]
        pages.reverse()  # (the order pop() would give: low ids first)
        del free[-n:]
        self.version += 1
        holders, st = self._holders, self._state
        for p in pages:
            st[p] = state
            holders[p].append(owner)
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
        st, reserved, owned = self._state, PageState.RESERVED, self._owned_state  # (locals: a transfer commits thousands)
        for p in self._by_owner.get(owner, ()):
            if st[p] is reserved:
                st[p] = owned

    def free(self, owner: str, pages: list[int] | None = None) -> int:
        """Release `owner`'s hold on its pages (all, or the given ones). Returns the count.

        A page others still hold stays theirs; a registered page nobody holds any more becomes
        CACHED; any other page is free again. Releasing a page that `owner` does not hold
        raises PoolError: a request can never free another request's pages.
        """
        held = self._by_owner.get(owner)
        if not held:
            if pages:
                raise PoolError(f"{owner!r} holds no pages")
            return 0
        holders = self._holders
        drop = set(held if pages is None else pages)
        if pages is None:  # every page it holds lists it: nothing to check
            del self._by_owner[owner]
        else:
            for p in drop:
                if owner not in holders[p]:
                    raise PoolError(f"page {p} is not owned by {owner!r}")
            rest = [p for p in held if p not in drop]
            if rest:
                self._by_owner[owner] = rest
            else:
                del self._by_owner[owner]
        self.version += 1
        st, hashes, free = self._state, self._hash, self._free  # (locals: a request frees thousands)
        resident, cached, free_state = PageState.RESIDENT, PageState.CACHED, PageState.FREE
        for p in drop:
            hs = holders[p]
            if len(hs) > 1:
                hs.remove(owner)
                if len(hs) == 1:
                    self._shared.discard(p)
                continue
            hs.clear()
            if hashes[p] is not None:
                if st[p] is resident:
                    st[p] = cached
                    self._lru[p] = None
                    continue
                self._unregister(p)
            st[p] = free_state
            free.append(p)
        return len(drop)

    # ---- bytes ---------------------------------------------------------------------------
    def export_pages(self, pages: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the given pages (all layers, K and V) into one contiguous tensor: a new one, or
        `out` (uint8, exactly that many bytes, on the pool's device) viewed as the export."""
        import torch
        idx = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        if out is None:
            return self.kv.index_select(2, idx).contiguous()
        shape = self.spec.page_shape(len(pages))
        if out.dtype != torch.uint8 or out.device != self.kv.device or not out.is_contiguous() or \
                out.numel() != len(pages) * self.spec.bytes_per_page:
            raise ValueError(f"out must be a contiguous uint8 tensor of {len(pages) * self.spec.bytes_per_page} "
                             f"bytes on {self.kv.device}")
        dst = out.view(self.kv.dtype).view(shape)
        torch.index_select(self.kv, 2, idx, out=dst)
        return dst

    def import_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Write a contiguous export (shape spec.page_shape(len(pages))) into `pages`."""
        import torch
        expect = self.spec.page_shape(len(pages))
        if tuple(data.shape) != expect:
            raise ValueError(f"import shape {tuple(data.shape)} != expected {expect}")
        idx = torch.tensor(pages, dtype=torch.long, device=self.kv.device)
        self.kv.index_copy_(2, idx, data.to(device=self.kv.device, dtype=self.kv.dtype))

    def copy_pages_to(self, src_pages: list[int], dst: "PagePool", dst_pages: list[int]) -> int:
        """Copy pages into another pool (tier move: device <-> host). Returns bytes copied."""
        import torch
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
        """Raise PoolError unless every page is free, cached (registered, no holder) or held,
        with as many holders as page tables that list it, and the hash table agrees."""
        count: dict[int, int] = {}
        for owner, pages in self._by_owner.items():
            if len(set(pages)) != len(pages):
                raise PoolError(f"{owner!r} lists a page twice")
            for p in pages:
                count[p] = count.get(p, 0) + 1
                if owner not in self._holders[p] or self._state[p] in (PageState.FREE, PageState.CACHED):
                    raise PoolError(f"page {p} state/owner mismatch")
        free = set(self._free)
        if len(free) != len(self._free):
            raise PoolError("free list has duplicates")
        cached = set(self._lru)
        if free & set(count) or cached & set(count) or free & cached \
                or len(free) + len(cached) + len(count) != self.num_pages:
            raise PoolError("free, cached and held pages do not add up to the pool size")
        for p in range(self.num_pages):
            n = len(self._holders[p])
            if n != count.get(p, 0):
                raise PoolError(f"page {p} has {n} holders, {count.get(p, 0)} page tables list it")
            if (n >= 2) != (p in self._shared):
                raise PoolError(f"page {p} shared set wrong")
        for p in free:
            if self._state[p] != PageState.FREE or self._hash[p] is not None:
                raise PoolError(f"free page {p} has state {self._state[p]}")
        for p in cached:
            if self._state[p] != PageState.CACHED or self._hash[p] is None:
                raise PoolError(f"cached page {p} has state {self._state[p]}")
        for h, p in self._by_hash.items():
            if self._hash[p] != h:
                raise PoolError(f"hash table names page {p} for a hash it does not carry")
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            raise PoolError("a page carries a hash the table does not know")
