"""`NodeConfig`, `NodeBase`: step loop, stats, events, SIGTERM drain, KV transport settings.

What every node process shares: config, engine, control socket, metrics, the step loop,
stats for the router, and a graceful drain on SIGTERM.

Loop (one asyncio loop per process): the control task receives router messages between
engine steps; the engine task runs `poll_io()` (transfers in and out), one `engine.step()`
when there is work, hands the step's tokens to `on_step_events`, flushes the events, and
yields. With no work it waits on a wake event with a bounded timeout.
"""
from __future__ import annotations

import asyncio
import logging
import math
import secrets
import signal
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdtb.common import host_port
from pdtb.nodes.control import ControlServer, EventSink
from pdtb.nodes.node_metrics import NodeMetrics, start_http
from pdtb.nodes.step_log import StepLog
from fairness.config import FairnessConfig
from kv_transport.config import FaultConfig, TransportConfig
from pdtb.nodes.protocol import (AbortRequest, Drain, GenerateRequest, Migrate, MigrationReport, NodeDown, NodeStats,
                                 Ping, SetFaults, TokenEvent)
from pdtb.engine.config import EngineConfig
from pdtb.engine.engine import LLMEngine
from pdtb.engine.scheduler import StepEvent
from pdtb.engine.sequence import Sequence, SeqStatus

CONSERVATION_EVERY = 64  # steps between page-conservation checks (every step with --check-pages)
FINAL_LINGER_MS = 2000  # at shutdown: how long queued control messages may take to leave
LOST_MEMORY_S = 300.0  # how long a node remembers the requests it ended for a router that went away
LOST_MAX = 10000  # ... and at most this many per router
LEASE_CHECK_S = 0.5  # how often the routers' leases are checked
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    role: str  # "prefill" | "decode" | "colocated"
    node_id: str
    engine: EngineConfig
    host: str = "127.0.0.1"  # interface every socket binds to
    ctrl_port: int = 0  # 0: ephemeral (the address is written to addr_file)
    metrics_port: int = 0
    kv_port: int = 0  # decode: KV transport receiver port
    transport: str = "zmq"  # "zmq" | "torch" | "shm" (one-sided, same host) | "auto" (shm where it can, else zmq)
    policy: str = "fcfs"  # admission policy: a name or module:Class / file.py:Class (fairness/registry.py)
    policy_args: tuple = ()  # the policy's own settings, (key, value) pairs as --policy-arg gives them
    drain_timeout_s: float = 30.0  # SIGTERM: finish in-flight work within this bound
    hold_timeout_s: float = 120.0  # prefill: how long a refused hand-off keeps retrying
    migration_timeout_s: float = 5.0  # decode: each phase of a live migration out (decode_node/migration.py)
    check_pages: bool = False  # run pool.check() after every step (tests)
    step_log: str | None = None  # append one JSON line per engine step here (pdtb/nodes/step_log.py)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    curve_dir: str | None = None  # ZeroMQ CURVE keys for every socket (pdtb/security.py)
    transfer_timeout_s: float = 30.0  # a whole KV transfer, on both sides (TransportConfig)
    router_lease_s: float = 10.0  # a router silent this long (no ping, no message) is gone: its requests end here
    transport_faults: FaultConfig = field(default_factory=FaultConfig)  # chaos runs: faults on KV sends
    dist_init_method: str | None = None  # torch transport: init_process_group's init_method (file:// or tcp://)
    dist_rank: int = -1  # torch transport: this node's rank in the group of all prefill and decode nodes
    dist_world_size: int = 0  # torch transport: prefill + decode nodes
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"unknown role {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}")
        if self.transport == "torch" and self.role != "colocated" and not (
                self.dist_init_method and 0 <= self.dist_rank < self.dist_world_size):
            raise ValueError("--transport torch needs --dist-init-method URL, --dist-rank R and --dist-world-size N "
                             "(one rank per prefill and decode node; scripts/launch_cluster.sh sets them)")
        if not self.transfer_timeout_s > 0 or not math.isfinite(self.transfer_timeout_s):
            raise ValueError("transfer_timeout_s must be positive and finite")
        if not 0 < self.router_lease_s < math.inf:
            raise ValueError("router_lease_s must be positive and finite")
        if not (0 <= self.drain_timeout_s < math.inf and 0 < self.hold_timeout_s < math.inf):
            raise ValueError("drain and hold timeouts must be finite, the hold timeout positive")
        for name in ("ctrl_port", "metrics_port", "kv_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name.replace('_', '-')} must be in [0, 65535], got {getattr(self, name)}")

    def transport_config(self, **kw) -> TransportConfig:
        """This node's KV transport settings (`kw`: the endpoint and other per-instance fields)."""
        if self.transport == "torch":
            keep_gloo_on_loopback(self.host)
        t = self.transfer_timeout_s
        return TransportConfig(backend=self.transport, curve_dir=self.curve_dir, transfer_timeout_s=t,
                               idle_timeout_s=min(TransportConfig.idle_timeout_s, t), faults=self.transport_faults,
                               dist_init_method=self.dist_init_method, dist_rank=self.dist_rank,
                               dist_world_size=self.dist_world_size, **kw)


TRANSPORTS = ("zmq", "torch", "shm", "auto")


def keep_gloo_on_loopback(host: str) -> None:
    """gloo listens on the address the machine's hostname resolves to (often a LAN address),
    whatever --host says. A node bound to loopback (the default) sets GLOO_SOCKET_IFNAME to the
    loopback interface, unless the user set it; a node given another --host (several hosts)
    leaves gloo's own choice. NCCL's bootstrap is steered the same way by NCCL_SOCKET_IFNAME."""
    import os

    if host not in ("127.0.0.1", "localhost", "::1") or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address in ("127.0.0.1", "::1") for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


class NodeBase:
    """What every role shares. A role is a subclass: it may wrap the admission policy
    (`make_policy`) and says whether it moves KV between nodes (`moves_kv`)."""

    moves_kv = False  # True: joins the KV transport's process group at start-up (torch backend)

    def __init__(self, config: NodeConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.policy = self.make_policy(config)
        self.engine = engine or LLMEngine(config.engine, policy=self.policy)
        self.metrics = NodeMetrics(config.role, config.node_id)
        self.policy_info = self.describe_policy(config)
        self._policy_json = self.policy_info.to_json()  # once: every ping would rebuild it
        self.metrics.set_policy(self.policy_info.name, self.policy_info.source, self.policy_info.settings)
        from pdtb.nodes.accounting import NodeAccounting

        self.acct = NodeAccounting(self)
        self.stop = asyncio.Event()
        self.num_steps = 0  # engine steps run
        self.wake = asyncio.Event()
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self.draining = False
        self.ctx = zmq.asyncio.Context()
        if ":" in config.host:  # an IPv6 address (--host ::1); only then: an IPv4 bind would report ::ffff: addresses
            self.ctx.setsockopt(zmq.IPV6, 1)
        from pdtb.security import CurveKeys

        self.keys = CurveKeys.load(config.curve_dir) if config.curve_dir else None
        self._auth = None
        self.ctrl = ControlServer(self.ctx, f"tcp://{host_port(config.host, config.ctrl_port)}", self._on_message, self.keys)
        self.sink = EventSink(self.ctrl, config.node_id, on_gone=self._router_gone)
        self.routes: dict[str, str] = {}  # request id -> router identity
        self._lost: dict[str, tuple[float, list[str]]] = {}  # router id -> (when, requests ended by _router_gone)
        self._heard: dict[str, float] = {}  # router id -> when its last message came (monotonic)
        self._lease_checked = 0.0
        self._faults_timer: asyncio.TimerHandle | None = None  # ends a SetFaults window
        self.seqs: dict[str, Sequence] = {}  # live requests on this node
        self.metrics_addr = ""
        self.kv_addr = ""
        self.incarnation = secrets.token_hex(8)  # in every NodeStats: a router sees a restart
        self._http = None

    # ---- messages -------------------------------------------------------------------------

    def make_policy(self, config: NodeConfig):
        """The policy that orders and admits this node's requests (fairness/registry.py)."""
        from fairness import make_policy

        return make_policy(config.policy, config.fairness, config.policy_args)

    def policy_label(self) -> str:
        """The policy's name in stats (`extra.policy`): the class's own `name`, else its reference."""
        return self.policy_info.name

    @staticmethod
    def describe_policy(config: NodeConfig):
        """The policy as the node's stats, metrics and results files name it. From the
        reference, not `self.policy`: a role may wrap the policy (the prefill node's
        PrefillOrder), and every node of a cluster should name the policy it was given."""
        from fairness import policy_info

        return policy_info(config.policy, config.policy_args)

    def _on_message(self, ident: bytes, msg) -> None:
        router = ident.decode(errors="replace")
        self._heard[router] = time.monotonic()
        if self._lost:
            self._tell_lost(router)
        if isinstance(msg, Ping):
            if msg.other_pages > 0 and self.config.role in ("decode", "colocated") and hasattr(self.policy, "cluster"):
                from fairness.cluster import ClusterView

                self.policy.cluster = ClusterView(msg.other_pages, dict(msg.elsewhere))
            asyncio.get_running_loop().create_task(self.ctrl.send(ident, self.stats(msg.seq)))
        elif isinstance(msg, GenerateRequest):
            if msg.request_id in self.seqs or msg.request_id in self.routes:
                log.warning("request %s: duplicate request id from %r dropped", msg.request_id, ident[:32])
                return  # (its events would mix with the live request's; routers use unique ids)
            self.routes[msg.request_id] = msg.router_id or router
            if self.draining:
                self.fail(msg.request_id, "node is draining", retry=True)
            else:
                self.on_generate(msg)
            self.wake.set()
        elif isinstance(msg, AbortRequest):
            live = msg.request_id in self.seqs
            if msg.final:
                self._final_timing(msg.request_id)
            self.on_abort(msg.request_id, msg.reason)
            if live and msg.request_id not in self.seqs:  # ended here: "stop" (a stop string), else "abort"
                self.metrics.count_finished("stop" if msg.final else "abort")
            self.wake.set()
        elif isinstance(msg, NodeDown):
            self.on_node_down(msg.node_id, msg.reason)
            self.wake.set()
        elif isinstance(msg, Migrate):
            self.on_migrate(msg, router)
            self.wake.set()
        elif isinstance(msg, SetFaults):
            self.set_faults(msg)
        elif isinstance(msg, Drain):
            if not self.draining:
                log.warning("node %s drains: %s", self.config.node_id, msg.reason or "asked by a router")
            self.draining = True  # new work is refused; a router moves a decode node's requests away
            self.wake.set()
        else:
            log.warning("unexpected %s on control socket", type(msg).__name__)

    def on_generate(self, req: GenerateRequest) -> None:
        raise NotImplementedError

    def set_faults(self, msg: SetFaults) -> None:
        """Faults on this node's KV sends for `msg.for_s` seconds, then those it started with."""
        from kv_transport.config import fault_config_from

        senders = getattr(self, "senders", None)
        try:
            faults = fault_config_from(msg.faults)
        except ValueError as e:
            log.warning("fault injection refused: %s", e)
            return
        if senders is None or not 0 < msg.for_s < math.inf:
            log.warning("fault injection refused: %s", "this node sends no KV" if senders is None
                        else f"for_s must be positive and finite, got {msg.for_s}")
            return
        log.warning("fault injection for %.1f s: %s", msg.for_s, faults)
        senders.set_faults(faults)
        if self._faults_timer is not None:
            self._faults_timer.cancel()
        self._faults_timer = asyncio.get_running_loop().call_later(
            msg.for_s, senders.set_faults, self.config.transport_faults)

    def on_node_down(self, node_id: str, reason: str) -> None:
        """A router says decode node `node_id` stopped answering (prefill nodes act on it)."""

    def on_migrate(self, msg: Migrate, router_id: str) -> None:
        """Move a decoding request to another decode node (decode nodes only)."""
        self.sink.migration(router_id, MigrationReport(msg.migration_id, msg.request_id, self.config.node_id,
                                                       msg.target.node_id, False,
                                                       f"a {self.config.role} node does not migrate requests"))

    def on_abort(self, request_id: str, reason: str) -> None:
        seq = self.engine.scheduler.abort(request_id, f"abort: {reason}")
        if seq is not None:
            self._end(seq)

    def _final_timing(self, request_id: str) -> None:
        """A request the router ended (stop string): send its last event, with the timeline,
        before it is aborted here. Nothing if this node does not hold it."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        ev = TokenEvent(request_id, [], True, "stop", timing=self.acct.final_timing(seq))
        self.sink.add(self.routes.get(request_id, ""), ev)

    def _router_gone(self, router_id: str) -> None:
        """The router `router_id` is not connected (events to it were lost): end its requests
        here as if it had aborted them, which frees their pages. If it was only reconnecting,
        it learns why they ended from its next message on (`_tell_lost`)."""
        rids = [rid for rid, r in self.routes.items() if r == router_id]
        for rid in rids:
            self.on_abort(rid, "router gone")
            self.routes.pop(rid, None)  # (ended for this router, whatever the role keeps of it)
            self.metrics.count_finished("abort")
        if rids:
            log.warning("router %s is gone: aborted its %d request(s)", router_id, len(rids))
            now = time.monotonic()
            for r in [r for r, (t, _) in self._lost.items() if now - t > LOST_MEMORY_S]:
                del self._lost[r]
            self._lost.setdefault(router_id, (now, []))[1].extend(rids[:LOST_MAX])
            self.wake.set()

    def _expire_routers(self, now: float) -> None:
        """End the requests of every router silent for `router_lease_s`: a router that died while
        its requests here send no events (queued, prefilling, waiting for their KV) is never
        caught by a lost event batch, and their pages would stay taken. A router pings every
        node several times a second, so only a dead, stopped or cut-off one stays silent."""
        if now - self._lease_checked < LEASE_CHECK_S:
            return
        self._lease_checked = now
        lease = self.config.router_lease_s
        for router_id in set(self.routes.values()):
            heard = self._heard.setdefault(router_id, now)  # (a route not made by a message: from now)
            if now - heard > lease:
                log.warning("router %s silent for %.1f s (lease %.1f s)", router_id, now - heard, lease)
                self._router_gone(router_id)
        for router_id in [r for r, t in self._heard.items() if now - t > LOST_MEMORY_S]:
            del self._heard[router_id]

    def _tell_lost(self, router_id: str) -> None:
        """A router whose requests `_router_gone` ended is back (its connection had dropped):
        fail them there with the reason, rather than leave it waiting for their timeout."""
        entry = self._lost.pop(router_id, None)
        for rid in entry[1] if entry else ():
            # retry: the router resends it from the tokens it did stream (none lost, none twice)
            self.sink.add(router_id, TokenEvent(rid, [], True, "error",
                                                "the node lost its connection to the router: token events were "
                                                "dropped, so the node ended the request", retry=True))
        if entry:
            self.wake.set()

    def abort_all(self, reason: str) -> None:
        """Fail every live request on this node and free its pages."""
        for rid in list(self.seqs):
            self.engine.scheduler.abort(rid, f"abort: {reason}")
            self.fail(rid, reason)

    async def poll_io(self) -> None:
        """Move transfers forward (prefill: hand-offs; decode: arrivals). Bounded waits only."""

    def on_step_events(self, events: list[StepEvent], t: float) -> None:
        raise NotImplementedError

    def idle(self) -> bool:
        return not self.engine.has_work()

    # ---- events to the router -----------------------------------------------------------------
    def emit(self, seq: Sequence, tokens: list[int], finished: bool = False) -> None:
        ev = TokenEvent(seq.request_id, tokens, finished)
        if seq.num_output_tokens == len(tokens):  # its first output: this node computed its prompt
            # the first prefill's hit (the scheduler sets it once): a recompute after preemption
            # finds its own pages again, which is no saving of the client's prompt (-1: cache off)
            ev.cached_tokens = max(seq.num_cached_tokens, 0)
        if finished:
            ev.finish_reason = "stop" if seq.status == SeqStatus.FINISHED_STOPPED else "length"
            ev.timing = self.acct.final_timing(seq)
            self.metrics.count_finished(ev.finish_reason)
        self.sink.add(self.routes.get(seq.request_id, ""), ev)
        if finished:
            self._end(seq)

    def fail(self, request_id: str, reason: str, retry: bool = False) -> None:
        """End a request with an error event (its pages are freed by the caller); `retry`: it was
        refused before any work, and the router may send it to another node."""
        log.info("request %s failed: %s", request_id, reason)
        self.sink.add(self.routes.get(request_id, ""), TokenEvent(request_id, [], True, "error", reason, retry=retry))
        self.metrics.count_finished("error")
        self._end_id(request_id)

    def _end(self, seq: Sequence) -> None:
        self._end_id(seq.request_id)

    def _end_id(self, request_id: str) -> None:
        """Forget a request that left this node (ended, failed or moved): its route, its meters
        and what the policy keeps of it."""
        self.seqs.pop(request_id, None)
        self.routes.pop(request_id, None)
        self.acct.forget(request_id)
        self.policy.forget(request_id)

    # ---- stats ---------------------------------------------------------------------------------
    def stats(self, seq: int = 0) -> NodeStats:
        sch, pool = self.engine.scheduler, self.engine.pool
        queued = sch.queued_tokens()
        host = self.engine.host_pool
        return NodeStats(self.config.node_id, self.config.role, seq, pool.num_pages, pool.num_free,
                         host.num_pages if host else 0, host.num_free if host else 0,
                         running=len(sch.running), waiting=len(sch.waiting) + len(sch.parked), queued_tokens=queued,
                         kv_addr=self.kv_addr, metrics_addr=self.metrics_addr, draining=self.draining,
                         extra={"policy": self.policy_label(), "policy_info": self._policy_json,
                                **self.acct.tenant_stats(), **self.extra_stats()}, incarnation=self.incarnation,
                         **self.prefix_fields())

    PREFIX_SUMMARY_MAX = 4096  # page hashes a node reports to the router (most recent first)

    def prefix_fields(self) -> dict:
        """NodeStats' prefix cache fields: what the router routes on, and the hit counters."""
        sch, pool = self.engine.scheduler, self.engine.pool
        if sch.prefix_ns is None:
            return {"page_size": pool.spec.page_size}
        return {"page_size": pool.spec.page_size, "prefix_ns": sch.prefix_ns,
                "prefix_summary": pool.cached_hashes(self.PREFIX_SUMMARY_MAX),
                "prefix_query_tokens": sch.prefix.query_tokens, "prefix_hit_tokens": sch.prefix.hit_tokens}

    def extra_stats(self) -> dict:
        return {}

    def refresh_gauges(self) -> None:
        pool, host = self.engine.pool, self.engine.host_pool
        self.metrics.set_pages("device", pool.num_pages, pool.num_free)
        if host is not None:
            self.metrics.set_pages("host", host.num_pages, host.num_free)
        self.metrics.running.set(len(self.engine.scheduler.running))
        self.metrics.waiting.set(len(self.engine.scheduler.waiting) + len(self.engine.scheduler.parked))

    # ---- loop ------------------------------------------------------------------------------------
    async def engine_loop(self) -> None:
        while not self.stop.is_set():
            await self.ctrl.drain()
            self._expire_routers(time.monotonic())
            await self.poll_io()
            if self.engine.has_work():
                t = time.time()
                events = self.engine.step()
                if self.step_log is not None:
                    self.step_log.write(t, time.time() - t, self.engine.last_output)
                self.metrics.steps.inc()
                self.acct.on_output(self.engine.last_output, time.time())
                self.num_steps += 1
                if self.config.check_pages or self.num_steps % CONSERVATION_EVERY == 0:
                    if not self.acct.check_conservation() and self.config.check_pages:
                        raise RuntimeError("page conservation broken")  # tests: fail loudly
                self.on_step_events(events, t)
                await self.sink.flush()
                if self._stalled(self.engine.last_output):
                    await self._wait_wake()  # nothing may run now (a cap): do not spin on empty steps
                else:
                    await asyncio.sleep(0)
            else:
                await self.sink.flush()
                await self._wait_wake()
            self.refresh_gauges()

    @staticmethod
    def _stalled(out) -> bool:
        return not (out.chunks or out.moves or out.preempted)

    async def _wait_wake(self) -> None:
        """Wait for a message or a transfer (bounded: time-based policy limits lift by themselves)."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), 0.01)
        except asyncio.TimeoutError:
            pass

    async def start_extra(self) -> None:
        """Subclasses: start transports. Called before the address file is written."""

    async def close_extra(self) -> None:
        """Subclasses: close transports."""

    def addresses(self) -> dict:
        return {"role": self.config.role, "id": self.config.node_id, "ctrl": self.ctrl.address,
                "kv": self.kv_addr, "metrics": self.metrics_addr}

    async def drain(self) -> None:
        """SIGTERM: refuse new work, let in-flight requests finish (bounded), fail the rest."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        while not self.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.abort_all("node shut down before the request finished")
        await self.sink.flush()
        self.stop.set()

    async def run(self, on_ready=None) -> None:
        loop = asyncio.get_running_loop()
        from pdtb.security import start_authenticator

        self._auth = start_authenticator(self.ctx, self.keys)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: loop.create_task(self.drain()) if not self.draining else None)
        self._http, self.metrics_addr = await start_http(self.metrics, lambda: self.stats().__dict__,
                                                         self.config.host, self.config.metrics_port)
        if self.config.transport == "torch" and self.moves_kv:
            # Every prefill and decode node joins the one process group at start-up (it blocks
            # until all have joined; launch_cluster.sh starts them all before waiting for any).
            from kv_transport.torch_backend import ensure_process_group

            await ensure_process_group(self.config.transport_config(), self.engine.pool.kv.device)
        await self.start_extra()
        warm = self.engine.warm_up()  # before READY: the first requests must not pay for it
        log.info("node %s warmed up in %.3f s", self.config.node_id, warm)
        tasks = [loop.create_task(self.ctrl.serve(self.stop)), loop.create_task(self.engine_loop())]
        if on_ready:
            on_ready(self.addresses())
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception():
                    log.error("node %s is going down: %s failed", self.config.node_id, t.get_name(),
                              exc_info=t.exception())  # the whole traceback in the node's log
                    raise t.exception()  # a failed task brings the node down loudly
        finally:
            self.stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close_extra()
            if self.step_log is not None:
                self.step_log.close()
            pool = self.engine.pool  # the last word on leaks: every page should be free by now
            log.info("node %s stopped: %d of %d device pages free", self.config.node_id, pool.num_free,
                     pool.num_pages)
            await self._http.cleanup()
            if self._auth is not None:
                self._auth.stop()
            # A sent message may still sit in zmq's queue: without a linger, closing drops the
            # last failures flushed above and the router only sees the node stop answering.
            self.ctrl.close(linger_ms=FINAL_LINGER_MS)
            self.ctx.term()
