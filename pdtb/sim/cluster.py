"""A simulated cluster: nodes, the router's placement, the links between them, and the client's
records. One `EventLoop` drives everything.

    client (pdtb/sim/client.py) --client latency--> router: placement on the nodes' last ping
    answers (pdtb/router/node_state.py: pick_prefill, pick_most_free; placement.py: fallbacks, pending pages)
    --rpc latency--> entry node ... tokens --rpc + client latency--> the request's record

With router costs (`router_request_s`, `router_token_s`) each router process is a server with a
FIFO of CPU work (pdtb/sim/routers.py): a request is placed once its router has parsed it, a
token goes on to the client once its router has relayed it. Without them the routers keep up
and cost nothing (no queue at all: the same events as a cluster without routers to charge).

KV payloads leave a prefill node one after another (its link is a FIFO: a transfer starts when
the previous one has left), each taking `cost.transfer_s(bytes)`. Headers and answers take the rpc latency.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdtb.figures.records import OK, RequestRecord, RequestSpec
from pdtb.client.load import cut_off
from pdtb.client.prefix import PROMPT_ROLES, prompt_ids
from kv_transport.fail_codes import FailCode
from pdtb.engine.kv_spec import KVSpec
from pdtb.nodes.protocol import Earlier, GenerateRequest, NodeStats, Params, Target
from pdtb.router.config import NodeSpec
from pdtb.router.fair_route import D2lpmRouter, RouteCandidate
from pdtb.sim.client import SimClient
from pdtb.router.dispatch import FALLBACKS
from pdtb.router.node_state import NodeState, load_order, pick_most_free, pick_prefill
from pdtb.sim.cost import CostModel
from pdtb.sim.events import EventLoop
from pdtb.sim.faults import Faults
from pdtb.sim.node import TOKEN, VOCAB, NodeShape, SimNode
from pdtb.sim.observe import Observer
from pdtb.sim.routers import RouterCost, Routers
from pdtb.sim.roles import SimColocated, SimDecode, SimPrefill

ROLES = {"colocated": SimColocated, "prefill": SimPrefill, "decode": SimDecode}
PROMPT_ID = 5  # placeholder prompt token


@dataclass(frozen=True)
class ClusterShape:
    nodes: tuple[NodeShape, ...]
    rpc_latency_s: float = 1e-4  # one message between two processes (router <-> node, node <-> node)
    client_latency_s: float = 5e-4  # client <-> router, each way (HTTP, SSE)
    dispatch_s_per_token: float = 0.0  # a new request's message to its node: this much longer per prompt token
    ping_interval_s: float = 0.5  # the router's view of the nodes is this old at most
    sample_interval_s: float = 0.5  # cluster samples (pages per tenant, top-5% share)
    tenant_tiers: dict = field(default_factory=dict)  # router --tenant-tier defaults
    route: str = "load"  # router --route: "load" or "d2lpm" (the router sees no node's cache: "cache" is load)
    routers: int = 1  # router processes behind one port (pdtb/sim/routers.py)
    router_request_s: float = 0.0  # a router's CPU work per request (parse, tokenize, dispatch)
    router_token_s: float = 0.0  # a router's CPU work per token it relays
    coast: bool = True  # runs of identical decode steps taken at once (pdtb/sim/coast.py); False: every step an event
    prefix_cache: bool = False  # prefill and colocated nodes cache prompt pages (prompts built from their blocks)
    kills: tuple = ()  # faults.Kill: a node's process gone at a time (pdtb/sim/faults.py)
    health_timeout_s: float = 3.0  # router --health-timeout: silent this long, a node is lost
    recompute_retries: int = 2  # router --recompute-retries
    transfer_timeout_s: float = 30.0  # the transport's: a longer transfer fails with TIMEOUT

    def __post_init__(self) -> None:
        roles = {n.role for n in self.nodes}
        if not self.nodes or not ({"prefill", "decode"} <= roles or "colocated" in roles):
            raise ValueError("a cluster needs colocated nodes, or prefill and decode nodes")
        if min(self.rpc_latency_s, self.client_latency_s, self.dispatch_s_per_token) < 0 or self.ping_interval_s <= 0:
            raise ValueError("latencies must be >= 0 and the ping interval > 0")
        if min(self.router_request_s, self.router_token_s) < 0:
            raise ValueError("the routers' work per request and per token must be >= 0")
        if self.routers < 1:
            raise ValueError(f"routers must be at least 1, got {self.routers}")
        if self.health_timeout_s <= 0 or self.recompute_retries < 0 or self.transfer_timeout_s <= 0:
            raise ValueError("the health and transfer timeouts must be > 0 and recompute retries >= 0")
        if self.route not in ("load", "d2lpm"):
            raise ValueError(f"route must be load or d2lpm, got {self.route!r}")


class SimCluster:
    def __init__(self, shape: ClusterShape, spec: KVSpec, cost: CostModel) -> None:
        self.shape, self.spec, self.cost = shape, spec, cost
        self.loop = EventLoop()
        self.nodes: dict[str, SimNode] = {}
        for i, ns in enumerate(shape.nodes):
            nid = f"{ns.role}-{i}"
            self.nodes[nid] = ROLES[ns.role](nid, ns, spec, cost, self.loop, self)
        self.states = {nid: NodeState(NodeSpec(n.shape.role, f"sim://{nid}")) for nid, n in self.nodes.items()}
        self.records: dict[str, RequestRecord] = {}  # by the id of each request's attempt in flight
        self.klass: dict[str, str] = {}
        self.entry: dict[str, str] = {}
        self.attempt: dict[str, str] = {}  # request (its first id) -> the id of its attempt in flight
        self.root: dict[str, str] = {}  # an attempt's id -> its request's first id
        self.reqs: dict[str, GenerateRequest] = {}  # by attempt
        self.landed: set[str] = set()  # attempts handed off to their decode node
        self._specs: dict[str, tuple[int, RequestSpec]] = {}  # request -> (its index, its spec)
        self._link_free: dict[str, float] = {}
        self.observer = Observer(self)
        self._open = 0
        self.d2lpm = D2lpmRouter() if shape.route == "d2lpm" else None
        self._latency = shape.rpc_latency_s + shape.client_latency_s  # node -> router -> client
        self.faults = Faults(self, shape.kills, shape.health_timeout_s, shape.recompute_retries)
        self.routers = self.charged_routers()  # None: the routers cost nothing
        self._synced_at = -1.0  # when sync last brought every node up to the clock (charged routers)

    def charged_routers(self) -> Routers | None:
        """The routers as servers, where they have work to charge."""
        sh = self.shape
        if not (sh.router_request_s or sh.router_token_s):
            return None
        return Routers(RouterCost(sh.router_request_s, sh.router_token_s), sh.routers, self.loop)

    # ---- run -----------------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec], horizon_s: float | None = None, concurrency: int | None = None,
            max_concurrency: int | None = None) -> list[RequestRecord]:
        """Simulate `specs`; every request ends (finished, failed, or cut off at `horizon_s`,
        by default an hour after the last arrival). The client sends them open loop, or as
        `concurrency` and `max_concurrency` say (pdtb/sim/client.py)."""
        self.client = SimClient(self, concurrency, max_concurrency)
        if horizon_s is None:
            horizon_s = self.client.horizon(specs)
        self._open = len(specs)
        self._ping()
        self.observer.start()
        self.faults.start()
        out = self.client.start(specs)
        if not self.loop.run(until=horizon_s) and any(n.coast is not None for n in self.nodes.values()):
            self.loop.now = horizon_s
            self.sync()  # the steps of runs in progress that ended by the horizon
        if self.routers is not None:
            self.routers.commit()  # (their tokens, where the routers relayed them by then)
        for rec in out:
            if rec.end_time is None:
                cut_off(rec, self.loop.now)
        return out

    def sync(self) -> None:
        """Every node as it stands now (a run of decode steps in progress brought up to date);
        then the routers serve what reached them by now (routers.py: in order of arrival)."""
        for n in self.nodes.values():
            if n.coast is not None:
                n.sync()
        if self.routers is not None:
            self._synced_at = self.loop.now
            self.routers.commit()

    def _commit(self) -> None:
        """The routers serve what reached them by now, every node's run brought up to now first
        (a second sync at the same time would find nothing new: a run begun since ends later)."""
        if self._synced_at == self.loop.now:
            self.routers.commit()
        else:
            self.sync()

    def _ping(self) -> None:
        """The router's ping: every node's stats as it would answer now."""
        self.sync()
        self.faults.on_ping(self.loop.now)
        for nid, n in self.nodes.items():
            if n.dead:
                continue  # the router keeps what it last answered
            sch, host = n.scheduler, n.host_pool
            self.states[nid].stats = NodeStats(nid, n.shape.role, 0, n.pool.num_pages, n.pool.num_free,
                                               host.num_pages if host else 0, host.num_free if host else 0,
                                               len(sch.running), len(sch.waiting) + len(sch.parked), sch.queued_tokens(), kv_addr=nid)
        self._tell_cluster()
        if self._open:
            self.loop.after(self.shape.ping_interval_s, self._ping)

    def _tell_cluster(self) -> None:
        """What the router's ping tells each decode or colocated node: what the others hold
        (fairness/cluster.py), as it is now."""
        from fairness.cluster import views

        pool = {}
        for nid, n in self.nodes.items():
            if n.shape.role in ("decode", "colocated") and not n.dead:
                tenants: dict[str, int] = {}
                for seq in n.scheduler.all_requests():
                    held = n.pool.num_held(seq.request_id)
                    if held:
                        tenants[seq.tenant] = tenants.get(seq.tenant, 0) + held
                pool[nid] = (n.pool.num_pages, tenants)
        for nid, view in views(pool).items():
            if hasattr(self.nodes[nid].policy, "cluster"):
                self.nodes[nid].policy.cluster = view

    # ---- the router ------------------------------------------------------------------------------
    def _fits(self, role: str, tokens: int) -> list[NodeState]:
        lost = self.faults.lost
        return [s for s in self.states.values() if s.spec.role == role
                and self.spec.pages_for(tokens) <= s.stats.pages_total and s.node_id not in lost]

    def _entry(self, nodes: list[NodeState], s: RequestSpec, by_load) -> NodeState | None:
        """The router's prefill or colocated node for `s`: by load, or by D2LPM credit (no overlap)."""
        if self.d2lpm is None or not nodes:
            return by_load(nodes)
        i = self.d2lpm.choose(s.tenant, s.prompt_len, [RouteCandidate(n.spec.address, 0, load_order(n)) for n in nodes])
        return nodes[i]

    def submit(self, i: int, s: RequestSpec) -> None:
        """Request i reaches the router."""
        rid = f"sim-{i}"
        self._specs[rid] = (i, s)
        self.attempt[rid] = self.root[rid] = rid
        self.klass[rid] = s.klass
        if self.routers is None:
            return self._route(rid, s, self._prompt(i, s), s.output_len)
        self.routers.request(rid, self._dispatch, rid, s, self._prompt(i, s), s.output_len)
        self._commit()

    def _dispatch(self, rid: str, s: RequestSpec, prompt: list[int], max_tokens: int, t: float) -> None:
        """Its router parsed request `rid` by `t` (now): it goes to a node."""
        self._route(rid, s, prompt, max_tokens)

    def resubmit(self, root: str, old: str, rid: str, done: int, left: int) -> None:
        """Recompute a request whose node was lost (pdtb/sim/faults.py): attempt `rid`, its
        prompt followed by the `done` tokens it streamed, for the `left` still to come."""
        rec = self.records.pop(old)  # what the old attempt still sends is not this request's
        for st in self.states.values():
            st.pending_pages.pop(old, None)
        self.records[rid], self.attempt[root], self.root[rid] = rec, rid, root
        self.klass[rid] = self.klass[root]
        i, s = self._specs[root]
        t0, tt = rec.send_time, rec.token_times  # (the client's times: the router's are a leg later)
        earlier = Earlier(self.loop.now - t0, done, tt[0] - t0 if done else -1.0, tt[done - 1] - t0 if done else -1.0)
        self._route(rid, s, self._prompt(i, s) + [TOKEN] * done, left, earlier)

    def _route(self, rid: str, s: RequestSpec, prompt: list[int], max_tokens: int,
               earlier: Earlier | None = None) -> None:
        now, prompt_len = self.loop.now, len(prompt)
        peak = prompt_len + max_tokens
        prefill, decode = self._entry(self._fits("prefill", prompt_len), s, pick_prefill), \
            pick_most_free(self._fits("decode", peak))
        entry = prefill if (prefill and decode) else self._entry(self._fits("colocated", peak), s, pick_most_free)
        if entry is None:
            need = self.spec.pages_for(peak)
            return self.on_failed(rid, f"request needs up to {need} KV pages; no node's pool holds it")
        decode = decode if entry is prefill else None
        tier = s.slo_tier if s.slo_tier is not None else self.shape.tenant_tiers.get(s.tenant, "")
        req = GenerateRequest(rid, prompt, Params(max_tokens=max_tokens, ignore_eos=True),
                              tenant=s.tenant, priority=s.priority or 0, slo_tier=tier, router_id="router",
                              arrival_time=now, earlier=earlier)
        if decode is not None:
            req.decode_node = req.decode_kv_addr = decode.node_id
            others = sorted((n for n in self._fits("decode", peak) if n is not decode), key=lambda n: -n.free_pages_estimate())
            req.fallbacks = [Target(n.node_id, n.node_id) for n in others[:FALLBACKS]]
        (decode or entry).pending_pages[rid] = self.spec.pages_for(prompt_len + 1)
        self.entry[rid], self.reqs[rid] = entry.node_id, req
        node = self.nodes[entry.node_id]
        self.loop.after(self.shape.rpc_latency_s + self.shape.dispatch_s_per_token * prompt_len, node.deliver,
                        node.on_generate, req)

    def _prompt(self, i: int, s: RequestSpec) -> list[int]:
        """Request i's prompt: placeholders; with a prefix cache, its blocks' tokens as the client
        builds them (pdtb/client/prefix.py), and otherwise a first token of its own, so that
        only what the workload shares is shared."""
        if not self.shape.prefix_cache:
            return [PROMPT_ID] * s.prompt_len
        if s.blocks:
            return prompt_ids(0, i, s, 1, VOCAB)
        return [1 + i % (VOCAB - 1)] + [PROMPT_ID] * (s.prompt_len - 1)

    def prefix_figures(self) -> dict | None:
        """Prompt tokens the prompt nodes looked up in their caches and found there (the real
        run's achieved hit rate: pdtb/client/prefix.py)."""
        if not self.shape.prefix_cache:
            return None
        q = h = 0
        for n in self.nodes.values():
            if n.shape.role in PROMPT_ROLES:
                q, h = q + n.scheduler.prefix.query_tokens, h + n.scheduler.prefix.hit_tokens
        return {"query_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else None}

    # ---- node -> router -> client ------------------------------------------------------------------
    def on_token(self, node: SimNode, rid: str, finished: bool, timing: dict | None) -> None:
        """A token leaves `node`: relayed by its router after the CPU work it costs, in order;
        then it counts."""
        if self.routers is None:
            return self._token_arrives(node, rid, finished, timing, self.loop.now)
        self.routers.token(self.root[rid], self.loop.now, self._token_arrives, node, rid, finished, timing)
        self._commit()

    def _token_arrives(self, node: SimNode, rid: str, finished: bool, timing: dict | None, t: float) -> None:
        """A token of attempt `rid` relayed by its router at `t` (<= now) goes on to the client."""
        rec = self.records.get(rid)
        if rec is None or rec.end_time is not None:
            return  # it failed while this token was on its way (or was recomputed): the client saw that already
        times = rec.token_times
        t = round(t + self._latency, 6)  # (simulated: microseconds are exact enough)
        times.append(t)
        if len(times) == 1:
            rec.first_token_time = t
        elif len(times) == 2 and node.shape.role == "decode":  # its pages show in the node's stats now
            self.states[node.node_id].pending_pages.pop(rid, None)
        if finished:
            rec.status, rec.server_timing = OK, self.faults.timing(self.root[rid], timing or {})
            self._end(rid, t)

    def on_tokens(self, node: SimNode, rids: list[str], times: list[float]) -> None:
        """Decode tokens of a run of steps (pdtb/sim/coast.py): each of `rids` one per step,
        the steps ending at `times`, none of them a request's last; as `_token_arrives` each.
        With charged routers each joins its router's queue at its time, served at the next
        commit (routers.py: every node brought up to now first)."""
        if self.routers is not None:
            for rid in rids:
                self.routers.tokens(self.root[rid], times, self._token_arrives, node, rid, False, None)
            return
        states = None
        arrive = [round(t + self._latency, 6) for t in times]
        for rid in rids:
            rec = self.records.get(rid)
            if rec is None or rec.end_time is not None:
                continue
            tt = rec.token_times
            n = len(tt)
            tt.extend(arrive)
            if n == 0:
                rec.first_token_time = tt[0]
            if n < 2 <= len(tt) and node.shape.role == "decode":
                states = states or self.states[node.node_id]
                states.pending_pages.pop(rid, None)

    def on_failed(self, rid: str, reason: str, retry: bool = False) -> None:
        """A node ended attempt `rid` with an error. `retry` (a node's error event marked so):
        the router, one message later, recomputes it as for a lost node (pdtb/router/completions.py)."""
        if retry:
            self.loop.after(self.shape.rpc_latency_s, self._retried, rid, reason)
            return
        rec = self.records.get(rid)
        if rec is not None and rec.end_time is None:
            rec.error = reason
            self._end(rid, self.loop.now + self.shape.rpc_latency_s + self.shape.client_latency_s)

    def _retried(self, rid: str, reason: str) -> None:
        rec = self.records.get(rid)
        if rec is not None and rec.end_time is None and self.attempt.get(self.root[rid]) == rid:
            self.faults.recompute(self.root[rid], rid, reason)

    def _end(self, rid: str, t: float) -> None:
        rec = self.records[rid]
        rec.end_time, rec.output_tokens = t, len(rec.token_times)
        if self.d2lpm is not None and rid in self.entry:
            self.d2lpm.charge_output(rec.tenant, self.states[self.entry[rid]].spec.address, rec.output_tokens)
        for st in self.states.values():
            st.pending_pages.pop(rid, None)
        self._open -= 1
        self.client.ended(t)

    # ---- node <-> node -------------------------------------------------------------------------------
    def send_header(self, src: SimPrefill, h) -> None:
        dst = self.nodes[h.req.decode_node]
        self.loop.after(self.shape.rpc_latency_s, dst.deliver, dst.on_header, src, h, h.transfer_id)

    def answer(self, src: SimPrefill, h, tid: str, landed: bool, code, reason: str) -> None:
        self.loop.after(self.shape.rpc_latency_s, src.deliver, src.on_transfer_end, h, tid, landed, code, reason)

    def send_payload(self, src: SimPrefill, dst: SimDecode, h, tid: str, target, nbytes: int) -> None:
        now = self.loop.now
        start = max(now, self._link_free.get(src.node_id, 0.0))
        end = start + self.cost.transfer_s(nbytes)
        if end - now > self.shape.transfer_timeout_s:  # both sides give up: the link is free again then
            end = self._link_free[src.node_id] = now + self.shape.transfer_timeout_s
            self.loop.at(end, dst.deliver, dst.on_transfer_failed, src, h, tid, target, FailCode.TIMEOUT,
                         f"not done within the transfer timeout ({self.shape.transfer_timeout_s:g} s)")
            return
        self._link_free[src.node_id] = end
        self.observer.on_transfer(h.seq.request_id, nbytes, end - now)
        self.loop.at(end, dst.deliver, dst.on_landed, src, h, tid, target, nbytes)

    def on_adopted(self, node: SimDecode, seq) -> None:
        self.landed.add(seq.request_id)
        self.observer.on_adopted(node, seq)

    def observe_step(self, node: SimNode, out, t0: float, t1: float) -> None:
        self.observer.on_step(node, out, t0, t1)

    def is_done(self) -> bool:
        return self._open == 0

