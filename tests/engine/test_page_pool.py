"""Allocator properties against a brute-force model of page ownership."""
from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdtb.engine.kv_export import export_request, import_request
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool, PageState, PoolError

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
OWNERS = [f"r{i}" for i in range(5)]


def make_pool(num_pages: int = 12, tier: str = "device") -> PagePool:
    return PagePool(SPEC, num_pages, tier=tier)


class PoolMachine(RuleBasedStateMachine):
    """Drives two pools (A exports into B) and a dict model of who owns what."""

    def __init__(self):
        super().__init__()
        self.a, self.b = make_pool(), make_pool(9)
        self.model = {"a": {}, "b": {}}  # pool -> owner -> [pages]

    def _pool(self, name):
        return self.a if name == "a" else self.b

    @rule(pool=st.sampled_from("ab"), owner=st.sampled_from(OWNERS), n=st.integers(0, 6))
    def allocate(self, pool, owner, n):
        got = self._pool(pool).allocate(owner, n)
        held = sum(len(v) for v in self.model[pool].values())
        if held + n > self._pool(pool).num_pages:
            assert got is None
        else:
            assert got is not None and len(got) == n
            if n:
                self.model[pool].setdefault(owner, []).extend(got)

    @rule(pool=st.sampled_from("ab"), owner=st.sampled_from(OWNERS), n=st.integers(1, 4))
    def reserve_then_commit_or_cancel(self, pool, owner, n):
        p = self._pool(pool)
        if owner in self.model[pool]:
            return  # reservations are for fresh owners (an incoming transfer)
        got = p.reserve(owner, n)
        if got is None:
            return
        assert all(p._state[i] == PageState.RESERVED for i in got)
        assert p.allocate("someone-else", 0) == []
        if n % 2:
            p.commit(owner)
            self.model[pool][owner] = list(got)
        else:
            p.free(owner)

    @rule(pool=st.sampled_from("ab"), owner=st.sampled_from(OWNERS), k=st.integers(0, 3))
    def free_some(self, pool, owner, k):
        held = self.model[pool].get(owner, [])
        drop = held[:k]
        self._pool(pool).free(owner, drop if k < len(held) else None)
        rest = held[k:] if k < len(held) else []
        if rest:
            self.model[pool][owner] = rest
        else:
            self.model[pool].pop(owner, None)

    @rule(owner=st.sampled_from(OWNERS), thief=st.sampled_from(OWNERS))
    def cannot_free_others_pages(self, owner, thief):
        held = self.model["a"].get(owner, [])
        if held and thief != owner:
            with pytest.raises(PoolError):
                self.a.free(thief, held[:1])

    @precondition(lambda self: self.model["a"])
    @rule(data=st.data())
    def export_to_b(self, data):
        owner = data.draw(st.sampled_from(sorted(self.model["a"])))
        pages = self.model["a"][owner]
        self.a.kv[:, :, pages] = torch.rand(SPEC.page_shape(len(pages)))
        ntok = len(pages) * SPEC.page_size - data.draw(st.integers(0, SPEC.page_size - 1))
        if ntok <= 0 or owner in self.model["b"]:
            return
        exp = export_request(self.a, owner, ntok)
        got = import_request(self.b, exp)
        if got is None:
            assert sum(map(len, self.model["b"].values())) + exp.header.num_pages > self.b.num_pages
            return
        self.model["b"][owner] = got
        assert torch.equal(self.b.kv[:, :, got], self.a.kv[:, :, pages[: len(got)]])

    @invariant()
    def matches_model(self):
        for name in "ab":
            p = self._pool(name)
            p.check()
            for owner, pages in self.model[name].items():
                assert p.pages_of(owner) == pages
            assert set(p.owners()) == set(self.model[name])
            assert p.num_free == p.num_pages - sum(map(len, self.model[name].values()))

    def teardown(self):
        for p in (self.a, self.b):
            for owner in p.owners():
                p.free(owner)
            p.check()
            assert p.num_free == p.num_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_host_tier_pages_are_parked():
    pool = make_pool(4, tier="host")
    pages = pool.allocate("x", 2)
    assert pool.state_counts() == {"free": 2, "reserved": 0, "resident": 0, "parked": 2, "cached": 0}
    pool.free("x")
    assert pool.num_free == 4 and pages


def test_import_rejects_mismatched_spec():
    a = make_pool()
    other = PagePool(KVSpec(2, 1, 2, 8, "float32"), 4)
    a.allocate("r", 2)
    exp = export_request(a, "r", 5)
    with pytest.raises(ValueError, match="spec"):
        import_request(other, exp)
