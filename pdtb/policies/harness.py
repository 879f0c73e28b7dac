"""The conformance run: two decode nodes on the real scheduler and placement, arrivals, aborts,
prefix sharing, a node lost.

The conformance run: a policy driven through the real scheduler and the decode node's
placement rule (decode_node/placement.py), with a fake clock, a fake forward pass and no
processes, under memory pressure.

Two decode nodes, each with its own instance of the policy behind `Guarded`. Every tick:

    new requests (seeded draws): inherited ones, offered from a "prefill side" to a node
        (placed DEVICE: reserved, landing 0-2 ticks later, adopted running; HOST: reserved in
        the host tier, adopted parked; DEFER: held and offered again next tick), and local
        ones sharing a system prompt (prefix pages shared through the prefix cache)
    random aborts anywhere (held, landing, queued, running)
    one scheduler step per live node (preemption, demotion and promotion between tiers)
    node loss: at a drawn tick one node dies; its requests are sent anew to the other (as
        the router does), and it comes back empty some ticks later

After every step each live node's pages are checked against independent records (free +
reserved + resident + parked == total per tier; owners match queues and transfers).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from decode_node.placement import Inherited, place
from kv_transport.admission import Verdict
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.engine.scheduler import Scheduler, SchedulerConfig
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from pdtb.policies.guard import Guarded

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
TICK_S = 0.05
TENANTS = ("whale", "m1", "m2", "m3")
SYSTEM_PROMPT = [3] * 8  # two full pages every local request shares


@dataclass(frozen=True)
class RunShape:
    """One run's node shape and seed."""

    seed: int
    device_pages: int = 48
    host_pages: int = 16
    ticks: int = 300  # ticks with arrivals; then the run drains
    budget: int = 32  # tokens per step
    max_num_seqs: int = 16


class Broken(Exception):
    """A property failed; `prop` names it."""

    def __init__(self, prop: str, detail: str) -> None:
        super().__init__(detail)
        self.prop = prop


@dataclass
class Node:
    sched: Scheduler
    policy: Guarded
    landing: dict = field(default_factory=dict)  # rid -> (seq, tier, tick it lands)
    down_until: int = -1  # dead until this tick (-1: alive)


class Harness:
    def __init__(self, make_policy, shape: RunShape, bound: int) -> None:
        self.make_policy, self.shape, self.bound = make_policy, shape, bound
        self.rng = random.Random(shape.seed)
        self.t, self.tick = 0.0, 0
        self.trace: list = []
        self.violations: list[str] = []
        self.nodes = [self._node(), self._node()]
        self.held: dict[str, tuple[Sequence, int]] = {}  # at the prefill side: rid -> (seq, target node)
        self.born: dict[str, int] = {}  # rid -> tick it arrived
        self.open: dict[str, int] = {}  # rid -> tick it arrived, of those not ended (in arrival order)
        self.longest = 0  # most ticks any request took to end
        self.steps = 0
        self.answers = 0
        self.seen: dict[str, int] = {}  # what the run exercised: tier moves, verdicts, prefix hits, node loss
        self._n = 0

    def clock(self) -> float:
        return self.t

    def _node(self) -> Node:
        sh = self.shape
        sched = Scheduler(SchedulerConfig(sh.max_num_seqs, sh.budget, 4096), PagePool(SPEC, sh.device_pages),
                          host_pool=PagePool(SPEC, sh.host_pages, tier="host") if sh.host_pages else None,
                          clock=self.clock)
        sched.prefix_ns = "check"
        sched.policy = Guarded(self.make_policy(), self.trace, self.violations)
        return Node(sched, sched.policy)

    # ---- requests ---------------------------------------------------------------------------------
    def _new(self) -> None:
        rng = self.rng
        tenant = rng.choice(TENANTS)
        whale = tenant == "whale"
        plen = rng.randint(24, 60) if whale else rng.randint(2, 14)
        mt = rng.randint(8, 24) if whale else rng.randint(2, 10)
        rid = f"q{self._n}"
        self._n += 1
        local = rng.random() < 0.3
        prompt = SYSTEM_PROMPT + [5 + self._n % 7] * plen if local else [5] * plen
        seq = Sequence(rid, list(prompt), len(prompt), SamplingParams(max_tokens=mt, ignore_eos=True),
                       tenant=tenant, priority=rng.randint(0, 2), slo_tier=("", "gold", "std")[self._n % 3])
        seq.arrival_time = self.t
        self.born[rid] = self.open[rid] = self.tick
        target = rng.randrange(2)
        if local:
            self._local(seq, target)
        else:
            seq.token_ids.append(7)  # its first token, sampled at the prefill side
            seq.num_computed_tokens = len(prompt)
            self.held[rid] = (seq, target)

    def _local(self, seq: Sequence, target: int) -> None:
        node = self._live(target)
        node.sched.add(seq)
        self.trace.append(("local", self.tick, seq.request_id))

    def _live(self, i: int) -> Node:
        node = self.nodes[i]
        return node if node.down_until < 0 else self.nodes[1 - i]

    def _offer(self, rid: str) -> None:
        seq, target = self.held[rid]
        node = self._live(target)
        req = Inherited(rid, seq.tenant, seq.priority, seq.slo_tier, SPEC.pages_for(seq.num_computed_tokens),
                        seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens, seq.params.max_tokens)
        verdict = place(req, node.sched, node.policy, can_park=True)
        self.trace.append(("verdict", self.tick, rid, verdict.verdict.name))
        self._saw(verdict.verdict.name.lower())
        if verdict.verdict is Verdict.REFUSE:
            del self.held[rid]
            self._end(rid, "refused: " + verdict.reason)
            return
        pool = {Verdict.ACCEPT: node.sched.pool, Verdict.PARK: verdict.pool}.get(verdict.verdict)
        if pool is None or pool.reserve(rid, req.num_pages) is None:
            return  # deferred (or no pages after all): offered again next tick
        del self.held[rid]
        node.landing[rid] = (seq, pool.tier, self.tick + self.rng.randint(0, 2))

    def _land(self, node: Node) -> None:
        for rid, (seq, tier, when) in list(node.landing.items()):
            if when > self.tick:
                continue
            del node.landing[rid]
            if tier == "device":
                node.sched.pool.commit(rid)
                node.sched.add_running(seq)
            else:
                node.sched.host_pool.commit(rid)
                node.sched.add_parked(seq)

    def _saw(self, what: str, n: int = 1) -> None:
        self.seen[what] = self.seen.get(what, 0) + n

    def _end(self, rid: str, how: str) -> None:
        self.open.pop(rid, None)
        self.longest = max(self.longest, self.tick - self.born[rid])
        self.trace.append(("end", self.tick, rid, how))

    def _abort_one(self) -> None:
        live = sorted(self.held) + [r for n in self.nodes for r in sorted(n.landing)] + \
            [s.request_id for n in self.nodes for s in n.sched.all_requests()]
        if not live:
            return
        rid = self.rng.choice(live)
        self.held.pop(rid, None)
        for node in self.nodes:
            if rid in node.landing:
                _, tier, _ = node.landing.pop(rid)
                (node.sched.pool if tier == "device" else node.sched.host_pool).free(rid)
            node.sched.abort(rid)
            node.policy.forget(rid)
        self._end(rid, "aborted")

    # ---- node loss --------------------------------------------------------------------------------
    def _kill(self, i: int, down: int) -> None:
        """Node i dies: what it held is sent anew to the other node from scratch (recompute)."""
        node = self.nodes[i]
        lost = [s for s, _, _ in node.landing.values()] + node.sched.all_requests()
        self.trace.append(("kill", self.tick, i, sorted(s.request_id for s in lost)))
        self._saw("node loss")
        self._saw("prefix hit tokens", node.sched.prefix.hit_tokens)
        fresh = self._node()
        fresh.down_until = self.tick + down
        self.nodes[i] = fresh
        for s in sorted(lost, key=lambda s: s.request_id):
            again = Sequence(s.request_id, s.token_ids[:s.num_prompt_tokens], s.num_prompt_tokens, s.params,
                             tenant=s.tenant, priority=s.priority, slo_tier=s.slo_tier)
            again.arrival_time = self.t
            self._local(again, 1 - i)

    # ---- a tick -----------------------------------------------------------------------------------
    def _step(self, node: Node) -> None:
        sch = node.sched
        out = sch.schedule()
        self.steps += 1
        for m in out.moves:
            self._saw(m.kind)
        node.policy.quotas()  # what a node's stats ask of it after steps
        node.policy.waiting_arrivals(sch.state())
        for c in out.chunks:
            c.seq.num_computed_tokens += c.num_new_tokens
            sch.register_computed(c.seq)
            if c.wants_logits:
                c.seq.token_ids.append(7)
                if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                    sch.finish(c.seq, SeqStatus.FINISHED_LENGTH, "length")
                    node.policy.forget(c.seq.request_id)
                    self._end(c.seq.request_id, "finished")
        check_pages(node)

    def _tick(self, arrivals: bool) -> None:
        self.t += TICK_S
        self.tick += 1
        rng = self.rng
        if arrivals:
            for _ in range(2):  # about 1.1 arrivals a tick: more than the nodes hold at once
                if rng.random() < 0.55:
                    self._new()
            if rng.random() < 0.03:
                self._abort_one()
            if self.tick == self.kill_at:
                self._kill(self.kill_node, rng.randint(10, 40))
        for node in self.nodes:
            if 0 <= node.down_until <= self.tick:
                node.down_until = -1
        for rid in sorted(self.held, key=lambda r: (self.born[r], r)):
            self._offer(rid)
        for node in self.nodes:
            if node.down_until < 0:
                self._land(node)
                self._step(node)
        self._check_bound()

    def _check_bound(self) -> None:
        rid, born = next(iter(self.open.items()), (None, self.tick))  # the oldest not ended
        if self.tick - born > self.bound:
            raise Broken("every request ends", f"request {rid} ({self._where(rid)}) has not ended "
                                               f"{self.bound} steps after it arrived")

    def _where(self, rid: str) -> str:
        if rid in self.held:
            return f"tenant {self.held[rid][0].tenant}, deferred at the prefill side"
        for node in self.nodes:
            for s in node.sched.all_requests():
                if s.request_id == rid:
                    return f"tenant {s.tenant}, {s.status.name.lower()}"
        return "landing"

    def run(self) -> None:
        self.kill_at = self.rng.randint(self.shape.ticks // 3, 2 * self.shape.ticks // 3)
        self.kill_node = self.rng.randrange(2)
        for _ in range(self.shape.ticks):
            self._tick(arrivals=True)
        while self.held or any(n.landing or n.sched.has_work() or n.down_until >= 0 for n in self.nodes):
            self._tick(arrivals=False)
        self.answers = sum(n.policy.answers for n in self.nodes)
        self._saw("prefix hit tokens", sum(n.sched.prefix.hit_tokens for n in self.nodes))


def check_pages(node: Node) -> None:
    """Page conservation on each tier from independent records; raises Broken."""
    sch = node.sched
    try:
        for pool in (sch.pool, sch.host_pool):
            if pool is None:
                continue
            pool.check()
            counts = pool.state_counts()
            held = set().union(*(pool.pages_of(o) for o in pool.owners()))  # a shared page once
            assert counts["free"] + counts["cached"] == pool.num_free, counts
            assert pool.num_free + len(held) == pool.num_pages, (counts, len(held))
            assert counts["reserved"] + counts["resident"] + counts["parked"] == len(held), (counts, len(held))
        landing = {t: {r for r, (_, tier, _) in node.landing.items() if tier == t} for t in ("device", "host")}
        dev = set(sch.pool.owners())
        want = {s.request_id for s in sch.running} | landing["device"]
        assert dev == want, f"device pages held by {sorted(dev)}, running or landing {sorted(want)}"
        reserved = sum(sch.pool.num_held(r) for r in landing["device"])
        assert sch.pool.state_counts()["reserved"] == reserved, "reserved pages are not the landing transfers'"
        if sch.host_pool is not None:
            host = set(sch.host_pool.owners())
            assert host == {s.request_id for s in sch.parked} | landing["host"], \
                f"host pages {sorted(host)} against parked and landing"
        for s in sch.running:
            assert sch.pool.num_held(s.request_id) >= SPEC.pages_for(s.num_computed_tokens), \
                f"{s.request_id} computed {s.num_computed_tokens} tokens beyond its pages"
    except AssertionError as e:
        raise Broken("page conservation", f"step {sch.num_steps}: {e}") from None
