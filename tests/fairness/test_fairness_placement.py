"""Where an inherited request lands (device, host, or deferred at prefill) goes through the
same quota check as admission, counting the pages of arrivals still landing: memfair's
placement applies the per-request cap, the share check of waiting tenants, and every in-flight
reservation."""
from __future__ import annotations

import pytest

from fairness import POLICIES, FairnessConfig, Placement, make_policy
from fairness.interface import Arrival
from sched_sim import make_request, make_scheduler, state


def _memfair_with(parked_b: bool = True, a_pages: int = 21):
    """memfair on 100 device + 100 host pages: tenant a runs a request of `a_pages` pages,
    tenant b has one request parked (below its share, waiting for device pages)."""
    pol = make_policy("memfair")
    sched = make_scheduler(pol, num_pages=100, host_pages=100, budget=512)
    a = make_request(a_pages * 4 - 4, 50, tenant="a", rid="a_run")
    a.num_computed_tokens = a.num_tokens
    a.token_ids.append(7)
    sched.pool.allocate("a_run", a_pages)
    sched.add_running(a)
    if parked_b:
        b = make_request(8, 50, tenant="b", rid="b_parked")
        b.num_computed_tokens = 8
        b.token_ids.append(7)
        sched.host_pool.allocate("b_parked", 3)
        sched.add_parked(b)
    pol.reclaim(sched.running, [*sched.parked, *sched.waiting], sched.state())
    return pol, sched


def test_an_arrival_beyond_its_share_does_not_take_the_device_while_another_tenant_waits():
    pol, sched = _memfair_with()
    st = sched.state()
    assert pol.ent == {"a": 50.0, "b": 50.0}
    assert not pol.may_admit(make_request(156, 4, tenant="a"), 40, st)
    assert pol.place_arrival(Arrival("a2", "a", 0, 40, 0.0, 0.0, 160, 10), 1, st) == Placement.HOST
    assert pol.place_arrival(Arrival("a3", "a", 0, 20, 0.0, 0.0, 80, 10), 1, st) == Placement.DEVICE  # 21 + 20 <= 50


def test_a_new_tenant_gets_a_share_not_the_pool():
    pol, sched = _memfair_with()
    st = sched.state()
    # c is not yet known: its entitlement is a third of the pool, and the cap (half) binds too
    assert pol.place_arrival(Arrival("c1", "c", 0, 60, 0.0, 0.0, 240, 10), 1, st) == Placement.HOST
    assert pol.place_arrival(Arrival("c2", "c", 0, 30, 0.0, 0.0, 120, 10), 1, st) == Placement.DEVICE


def test_reserved_pages_of_arrivals_still_landing_count_for_their_tenant():
    pol, sched = _memfair_with(parked_b=True, a_pages=2)
    placed = []
    for k in range(4):  # 18-page arrivals of tenant a, each header in before any payload lands
        where = pol.place_arrival(Arrival(f"a{k}", "a", 0, 18, 0.0, 0.0, 72, 10), 0, sched.state())
        if where is Placement.DEVICE:
            sched.pool.reserve(f"a{k}", 18)  # what the receiver does: RESERVED until the payload lands
        placed.append(where)
    # 2 + 18 + 18 = 38 fit a's 50; a third would make 56 while b waits below its share
    assert placed == [Placement.DEVICE, Placement.DEVICE, Placement.HOST, Placement.HOST]
    assert set(pol.incoming) == {"a0", "a1"}
    sched.pool.free("a0")  # that transfer failed: its reservation no longer counts
    pol.reclaim(sched.running, [*sched.parked, *sched.waiting], sched.state())
    assert set(pol.incoming) == {"a1"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_placement_keeps_class_reservations(name):
    """Every policy's placement (memfair's has its own quota check, which must count them
    too) keeps unused reservations of more urgent classes."""
    cfg = FairnessConfig(class_reservations={0: 0.5})
    pol = make_policy(name, cfg)
    sched = make_scheduler(pol, num_pages=40, host_pages=40)
    busy = make_request(4, 8, tenant="t", rid="busy")  # the pool is not idle (idle, anything that fits goes)
    busy.num_computed_tokens = 4
    sched.pool.allocate("busy", 2)
    sched.add_running(busy)
    pol.reclaim(sched.running, [], sched.state())
    # 38 free pages, 18 of them still reserved for class 0: a class-1 arrival of 30 pages is parked
    assert pol.place_arrival(Arrival("low", "t", 1, 30, 0.0, 0.0), 0, sched.state()) == Placement.HOST
    assert pol.place_arrival(Arrival("high", "t", 0, 30, 0.0, 0.0), 0, sched.state()) == Placement.DEVICE


def test_an_idle_pool_takes_the_oldest_arrival_that_fits_whatever_the_quotas():
    """Work conservation at placement, as at admission. Three tenants' arrivals, each above its
    third of the pool, must not refuse each other's borrowing on an empty pool forever; and an
    idle decode node's view must be current, not its last step's (tenants long gone), or a lone
    arrival over the per-request cap is deferred for the whole hold timeout (120 s in a chaos
    run)."""
    pol = make_policy("memfair")
    sched = make_scheduler(pol, num_pages=64)
    pol.reclaim(sched.running, [], sched.state())
    busy = state(device_total=64, device_free=10)
    for u in ("alice", "bob", "carol"):  # all held while the pool was busy
        assert pol.place_arrival(Arrival(f"r-{u}", u, 0, 25, 0.0, 0.0, 400, 8), 1, busy) == Placement.DEFER
    placed = {u: pol.place_arrival(Arrival(f"r-{u}", u, 0, 25, 0.0, 1.0, 400, 8), 0, sched.state())
              for u in ("alice", "bob", "carol")}
    assert placed["alice"] == Placement.DEVICE  # the oldest, on an idle pool
    sched.pool.reserve("r-alice", 25)
    pol.refresh(sched.running, [], sched.state())
    # bob and carol would both have to borrow: neither blocks the other
    assert pol.place_arrival(Arrival("r-bob", "bob", 0, 25, 0.0, 2.0, 400, 8), 0, sched.state()) == Placement.DEVICE
    # a node whose last step served other tenants, idle since: a lone big arrival gets in
    stale = make_policy("memfair")
    other = make_request(8, 4, tenant="x", rid="gone")
    stale.reclaim([other], [], sched.state())
    stale.refresh([], [], make_scheduler(num_pages=64).state())  # what the decode node does first
    assert stale.place_arrival(Arrival("big", "y", 0, 57, 0.0, 0.0, 900, 8), 0,
                               make_scheduler(num_pages=64).state()) == Placement.DEVICE
