"""Page conservation with sharing: a brute-force model of holders against the pool."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool, PageState, PoolError

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
OWNERS = [f"r{i}" for i in range(6)]
HASHES = [1000 + i for i in range(8)]  # a chain: HASHES[:k] is the prefix of k pages


def make_pool(num_pages: int = 10, charge: str = "split") -> PagePool:
    return PagePool(SPEC, num_pages, charge=charge, storage=False)


class SharingMachine(RuleBasedStateMachine):
    """Random allocate / register / share / free / drop against a dict of page tables."""

    def __init__(self):
        super().__init__()
        self.pool = make_pool()
        self.tables: dict[str, list[int]] = {}  # owner -> its page table (the model)
        self.content: dict[int, int] = {}  # page -> hash it was registered with

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(1, 4))
    def allocate(self, owner, n):
        before = {p for t in self.tables.values() for p in t}
        pages = self.pool.allocate(owner, n)
        if pages is None:
            assert self.pool.num_free < n
            return
        assert not set(pages) & before, "a held page was handed out again"
        for p in pages:
            self.content.pop(p, None)  # reused: whatever it cached is gone
        self.tables.setdefault(owner, []).extend(pages)

    @rule(owner=st.sampled_from(OWNERS), k=st.integers(1, len(HASHES)))
    def register(self, owner, k):
        table = self.tables.get(owner)
        if not table:
            return
        self.pool.register(owner, 0, HASHES[:min(k, len(table))])
        for i, p in enumerate(table[:k]):
            if self.pool._hash[p] is not None:
                self.content.setdefault(p, self.pool._hash[p])

    @rule(owner=st.sampled_from(OWNERS), k=st.integers(1, len(HASHES)))
    def share(self, owner, k):
        if self.tables.get(owner):
            with pytest.raises(PoolError):
                self.pool.share(owner, self.pool.match(HASHES[:k]) or [0])
            return
        pages = self.pool.match(HASHES[:k])
        for h, p in zip(HASHES, pages):
            assert self.content.get(p) == h, "a match returned a page that does not hold its hash"
        revived = self.pool.num_revived(pages)
        free = self.pool.num_free
        self.pool.share(owner, pages)
        assert self.pool.num_free == free - revived
        if pages:
            self.tables[owner] = list(pages)

    @rule(owner=st.sampled_from(OWNERS), part=st.booleans())
    def free(self, owner, part):
        table = self.tables.get(owner)
        if not table:
            assert self.pool.free(owner) == 0
            return
        drop = table[len(table) // 2:] if part else list(table)
        self.pool.free(owner, drop)
        rest = [p for p in table if p not in drop]
        if rest:
            self.tables[owner] = rest
        else:
            del self.tables[owner]

    @rule(owner=st.sampled_from(OWNERS), other=st.sampled_from(OWNERS))
    def free_foreign_page(self, owner, other):
        theirs = [p for p in self.tables.get(other, []) if p not in self.tables.get(owner, [])]
        if owner == other or not theirs or owner not in self.tables:
            return
        with pytest.raises(PoolError):
            self.pool.free(owner, theirs[:1])

    @rule()
    def drop_cache(self):
        self.pool.drop_cache()

    @invariant()
    def conserved(self):
        pool = self.pool
        pool.check()
        holders: dict[int, int] = {}
        for t in self.tables.values():
            for p in t:
                holders[p] = holders.get(p, 0) + 1
        for p in range(pool.num_pages):
            assert pool.refcount(p) == holders.get(p, 0)
            state = pool._state[p]
            if holders.get(p):
                assert state == PageState.RESIDENT
            else:
                assert state in (PageState.FREE, PageState.CACHED)
        assert {o: pool.pages_of(o) for o in pool.owners()} == self.tables
        counts = pool.state_counts()
        assert counts["free"] + counts["cached"] == pool.num_free
        charged = pool.charged_counts()
        held_pages = len(holders)
        assert sum(charged.values()) == pytest.approx(held_pages)  # split: every held page counted once
        excl = pool.exclusive_counts()
        for o, t in self.tables.items():
            assert excl[o] == sum(1 for p in t if holders[p] == 1)


TestSharing = SharingMachine.TestCase
TestSharing.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_charge_rules_on_one_shared_page():
    """Three holders of one page, one of them with a private page too."""
    for charge, want in (("split", {"a": 1 + 1 / 3, "b": 1 / 3, "c": 1 / 3}),
                         ("first", {"a": 2, "b": 0, "c": 0}),
                         ("full", {"a": 2, "b": 1, "c": 1})):
        pool = make_pool(4, charge)
        pool.allocate("a", 1)
        pool.register("a", 0, [7])
        pool.allocate("a", 1)
        for o in ("b", "c"):
            pool.share(o, pool.match([7]))
        got = pool.charged_counts()
        assert got == pytest.approx(want), charge
        assert pool.exclusive_counts() == {"a": 1, "b": 0, "c": 0}
        assert pool.shared_counts() == {"a": 1, "b": 1, "c": 1}
        pool.free("a")  # the first holder leaves: the oldest live holder pays under `first`
        if charge == "first":
            assert pool.charged_counts() == {"b": 1, "c": 0}


def test_cached_pages_give_way_least_recently_released_first():
    pool = make_pool(3)
    for o, h in (("x", 1), ("y", 2), ("z", 3)):
        pool.allocate(o, 1)
        pool.register(o, 0, [h])
    for o in ("y", "x", "z"):
        pool.free(o)
    assert pool.num_free == 3 and pool.num_cached == 3
    pool.allocate("w", 1)  # takes y's page: released first
    assert pool.match([2]) == [] and pool.match([1]) and pool.match([3])
    pool.check()


def test_reserved_pages_are_never_matched():
    pool = make_pool(4)
    pool.reserve("t", 2)
    pool.register("t", 0, [5, 6])  # not committed: not registered
    assert pool.match([5]) == []
    pool.commit("t")
    pool.register("t", 0, [5, 6])
    assert len(pool.match([5, 6])) == 2
