"""The decode node's path, fuzzed with a fake clock and no processes, under every policy:
inherited arrivals offered to `place_arrival` (device: pages RESERVED, committed some ticks
later and adopted running; host: reserved in the host tier, adopted parked; defer: held at the
"prefill side" and offered again every tick), scheduler steps with a fake forward pass, random
aborts anywhere (transfers in flight included). After every step: each tier's free + reserved
+ resident + parked == total, counted from independent records; owners match the queues and
the transfers; reserved pages are exactly the landing transfers'. At the end everything drains."""
from __future__ import annotations

import dataclasses
import random
import sys

import pytest

from fairness import POLICIES, FairnessConfig, Placement
from fairness.config import QUOTA_BY
from fairness.interface import Arrival
from fairness.memfair_settings import QUOTA_SHARES
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from sched_sim import SPEC, FakeClock, apply_step


def configs(rng):
    kw = {}
    if rng.random() < 0.4:
        kw["tenant_weights"] = {"a": rng.choice([0.5, 1, 3]), "b": rng.choice([1, 2])}
    if rng.random() < 0.3:
        kw["class_reservations"] = {0: rng.choice([0.2, 0.5])}
    if rng.random() < 0.3:
        kw["quota_shares"] = "static"
    if rng.random() < 0.3:
        kw["starve_after_s"] = rng.choice([0.05, 0.5, 2.0])
    if rng.random() < 0.2:
        kw["victim"] = rng.choice(["lru", "newest", "least_progress", "footprint"])
    if rng.random() < 0.15:
        kw["tenant_bw_cap"] = SPEC.bytes_per_page * rng.choice([20, 100])
    return kw


def make(name, kw):
    """Policy `name` built from one dict of drawn knobs: the shared ones make its
    FairnessConfig, the rest its own settings where it has them (others' are dropped)."""
    cls = POLICIES[name]
    shared = {f.name for f in dataclasses.fields(FairnessConfig)}
    own = {f.name for f in dataclasses.fields(cls.Settings)}
    config = FairnessConfig(**{k: v for k, v in kw.items() if k in shared})
    return cls(config, cls.Settings(**{k: v for k, v in kw.items() if k in own}))


TIERS = ("", "gold", "std")  # request n's SLO tier: TIERS[n % 3] (no draw: seeds keep their runs)


class Sim:
    def __init__(self, name, seed, dev=None, host=None, quota=None):
        self.rng = rng = random.Random(seed)
        self.clock = FakeClock()
        self.kw = {**configs(rng), **(quota or {})}
        self.pol = make(name, self.kw)
        dev = dev or rng.choice([16, 24, 40])
        host = host if host is not None else rng.choice([0, 4, 12, 40])
        self.sched = Scheduler(SchedulerConfig(rng.choice([3, 8, 64]), rng.choice([8, 32, 64]), 4096),
                               PagePool(SPEC, dev), policy=self.pol,
                               host_pool=PagePool(SPEC, host, tier="host") if host else None, clock=self.clock)
        self.held = {}  # rid -> (seq, first offered tick)   (prefill side keeps them)
        self.landing = {}  # rid -> (seq, tier, tick when it lands)
        self.n = 0
        self.seqs = {}
        self.done = set()
        self.log = []

    def new(self):
        rng = self.rng
        plen, mt = rng.randint(1, 40), rng.randint(1, 20)
        if SPEC.pages_for(plen + mt) > self.sched.pool.num_pages:
            return
        rid = f"q{self.n}"; self.n += 1
        seq = Sequence(rid, [5] * plen + [7], plen, SamplingParams(max_tokens=mt, ignore_eos=True),
                       tenant=rng.choice("abc"), priority=rng.randint(0, 2), num_computed_tokens=plen,
                       slo_tier=TIERS[self.n % 3])
        seq.arrival_time = self.clock.t
        self.seqs[rid] = seq
        if mt == 1:
            return  # finished at prefill
        self.held[rid] = (seq, self.clock.t)

    def offer(self, rid):
        seq, _ = self.held[rid]
        sch, pol = self.sched, self.pol
        st = sch.state()
        a = Arrival(rid, seq.tenant, seq.priority, SPEC.pages_for(seq.num_computed_tokens), st.now, st.now,
                    seq.num_tokens, seq.params.max_tokens - seq.num_output_tokens, slo_tier=seq.slo_tier)
        pol.refresh(sch.running, [*sch.parked, *sch.waiting], st)
        where = pol.place_arrival(a, len(sch.parked) + len(sch.waiting), st)
        pool = None
        if where is Placement.DEVICE:
            pool = sch.pool
        elif where is Placement.HOST and sch.host_pool is not None:
            pol.forget(rid)
            pool = sch.host_pool
        if pool is None:
            return where
        if pool.reserve(rid, a.num_pages) is None:
            return "nopages"
        del self.held[rid]
        self.landing[rid] = (seq, pool.tier, self.tick + self.rng.randint(0, 2))
        return where

    def land(self):
        for rid, (seq, tier, when) in list(self.landing.items()):
            if when > self.tick:
                continue
            del self.landing[rid]
            if tier == "device":
                self.sched.pool.commit(rid)
                self.sched.add_running(seq)
            else:
                self.sched.host_pool.commit(rid)
                self.sched.add_parked(seq)

    def abort_one(self):
        rng = self.rng
        live = [s.request_id for s in self.sched.all_requests()] + list(self.landing) + list(self.held)
        if not live:
            return
        rid = rng.choice(live)
        if rid in self.held:
            del self.held[rid]
            self.pol.forget(rid)
        elif rid in self.landing:
            seq, tier, _ = self.landing.pop(rid)
            (self.sched.pool if tier == "device" else self.sched.host_pool).free(rid)
        else:
            self.sched.abort(rid)
            self.pol.forget(rid)

    def check(self):
        sch = self.sched
        check_conservation_counts(sch)
        for pool in (sch.pool, sch.host_pool):
            if pool is None:
                continue
            pool.check()
        dev_owners = set(sch.pool.owners())
        landing_dev = {r for r, (_, t, _) in self.landing.items() if t == "device"}
        landing_host = {r for r, (_, t, _) in self.landing.items() if t == "host"}
        assert dev_owners == {s.request_id for s in sch.running} | landing_dev, (dev_owners, landing_dev)
        if sch.host_pool:
            assert set(sch.host_pool.owners()) == {s.request_id for s in sch.parked} | landing_host
        assert sch.pool.state_counts()["reserved"] == sum(sch.pool.num_held(r) for r in landing_dev)

    def step(self):
        self.clock.t += 0.05
        self.tick += 1
        for rid in sorted(self.held, key=lambda r: self.held[r][1]):
            self.offer(rid)
        self.land()
        apply_step(self.sched, self.sched.schedule())
        self.check()

    def run(self, ticks=150, drain=8000):
        self.tick = 0
        for _ in range(ticks):
            op = self.rng.random()
            if op < 0.35:
                self.new()
            elif op < 0.42:
                self.abort_one()
            self.step()
        for _ in range(drain):
            if not (self.sched.has_work() or self.held or self.landing):
                return True
            self.step()
        return False


def check_conservation_counts(sch) -> None:
    for pool in (sch.pool, sch.host_pool):
        if pool is None:
            continue
        counts = pool.state_counts()
        owned = sum(len(pool.pages_of(o)) for o in pool.owners())
        assert counts["free"] == pool.num_free and counts["free"] + owned == pool.num_pages, counts
        assert counts["reserved"] + counts["resident"] + counts["parked"] == owned, counts


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_decode_path_conserves_pages_and_drains(name):
    for seed in range(20):
        sim = Sim(name, seed)
        assert sim.run(), (seed, sim.kw, len(sim.sched.running), len(sim.sched.parked), len(sim.sched.waiting),
                           len(sim.held), len(sim.landing))


@pytest.mark.parametrize("shares", QUOTA_SHARES)
@pytest.mark.parametrize("quota_by", QUOTA_BY)
def test_memfair_decode_path_drains_under_every_quota_owner(quota_by, shares):
    """memfair keyed by each quota owner, with dynamic and static shares (static: an owner
    keeps its share 30 s after its last work, 600 ticks here, longer than the arrivals last)."""
    for seed in range(4):
        sim = Sim("memfair", seed, quota={"quota_by": quota_by, "quota_shares": shares})
        assert sim.run(), (seed, sim.kw, len(sim.sched.running), len(sim.sched.parked), len(sim.sched.waiting),
                           len(sim.held), len(sim.landing))
