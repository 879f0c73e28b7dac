"""`pdtb bench lockstep`: a workload's hand-offs into a real `DecodeNode` over one transport, in a
fixed order of events on a virtual clock (verdicts, counts, token digest, pools checked empty).

`pdtb bench lockstep`: a seeded workload's hand-offs into a real decode node over one KV
transport, in a fixed order of events, so that two transports' admission decisions can differ
only by what the transports do with them.

    pdtb bench lockstep [--step-ms 20] [--out FILE] [--label-policy NAME] WORKLOAD FLAGS -- DECODE NODE FLAGS

The workload flags are `pdtb bench serve`'s, the node flags `pdtb node decode`'s (`--policy`
NAME, module:Class or path/to/file.py:Class, `--policy-arg KEY=VALUE`, `--transport`,
`--kv-pages`, ...): a live run's, so that both run the same configuration. The result names
the policy as the node does (its `name`, else the reference; `--label-policy` overrides it)
and carries the node's `policy_info` (name, source, settings).

In a live run a verdict depends on what the decode pool holds at the wall-clock moment a
header arrives, so two runs over the same transport already differ. Here:

- the decode node is `DecodeNode` itself: its admission (`_admit`: the policy's placement),
  its receiver of the chosen backend, landing parked requests in the host tier, adoption, and
  continuous-batching steps of the model over the landed pages;
- the prefill side is a child process (lockstep_peer.py) that sends a request's KV (seeded
  bytes: prefill is taken as instant and unlimited) when told, and reports how it ended;
- time is virtual: the node's scheduler clock reads `step * step_s`. At each step boundary the
  requests whose send time has come are handed off in workload order, then the deferred ones
  whose backoff is over are retried, each after the previous transfer has ended; then the
  engine runs one step. A transfer's end is taken as a prefill node takes it
  (prefill_node/handoff.py `transfer_ended`: backoff, hold timeout, failure).

The result: the node's verdict counts (`DecodeNode.admissions`, as a live run's /cluster
samples give them), every request's verdicts in order, and a digest of every generated token
(the same bytes landed give the same greedy tokens), with the pools checked empty at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from decode_node.node import DecodeNode
from fairness import policy_info
from kv_transport.fail_codes import FailCode
from pdtb.engine.sequence import Sequence
from pdtb.nodes.control import EventSink
from pdtb.nodes.handoff import HandoffEvent
from pdtb.nodes.arrival import to_sampling
from pdtb.nodes.protocol import GenerateRequest, HandoffMeta, Params, Target, to_extra
from prefill_node.handoff import Handoff, Outcome, transfer_ended

ROUTER = "lockstep"  # the router id the hand-offs name (there is none: events are counted, not sent)
ANSWER_MARGIN_S = 10.0  # a hand-off's answer, beyond the transfer timeout
ADOPT_TIMEOUT_S = 10.0  # a landed transfer's adoption by the node
GROUP_TIMEOUT_S = 30.0  # --transport torch: the peer joining the gloo group
_CODES = {c.value for c in FailCode}


@dataclass
class LockstepResult:
    transport: str
    policy: str
    step_s: float  # virtual seconds per engine step
    steps: int  # engine steps until every request ended
    requests: int
    finished: int  # requests that generated all their tokens
    failed: dict[str, int]  # requests the prefill side gives up on, by the transfer's code
    admissions: dict[str, int]  # the node's verdict counts (DecodeNode.admissions)
    verdicts: dict[str, list[str]]  # request id -> its verdicts, in order
    tokens_sha256: str  # every request's generated tokens, in request order
    pages_free: bool  # both tiers empty and consistent at the end
    wall_s: float = 0.0  # real seconds the run took
    policy_info: dict = field(default_factory=dict)  # the node's policy: name, source, settings
    lockstep: bool = field(default=True, init=False)  # (tells the result files apart from live runs')


class _NoRouter(EventSink):
    """Token events are kept by the node (`_Node.emit`); none goes to a router."""

    async def flush(self) -> None:
        self.take()


class _Node(DecodeNode):
    """The decode node, recording its verdicts and tokens, on a virtual clock."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.set_clock(lambda: 0.0)
        self.sink = _NoRouter(self.ctrl, config.node_id)
        self.verdicts: dict[str, list[str]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def set_clock(self, now) -> None:
        """Read the time from `now` (the driver's step), here and in the scheduler."""
        self.now = self.engine.scheduler.clock = now

    def _count_admission(self, rid, verdict) -> None:
        super()._count_admission(rid, verdict)
        self.verdicts.setdefault(rid, []).append(verdict.value)

    def _adopt(self, t) -> None:
        super()._adopt(t)
        seq = self.seqs.get(t.request_id)
        if seq is not None:
            seq.arrival_time = self.now()  # its place in line, on the node's clock

    def emit(self, seq, tokens, finished=False) -> None:
        self.tokens.setdefault(seq.request_id, []).extend(tokens)
        if finished:
            self.finished.add(seq.request_id)
        super().emit(seq, tokens, finished)


class _Peer:
    """The lockstep_peer child: one command, one answer."""

    def __init__(self, proc: asyncio.subprocess.Process, answer_timeout_s: float) -> None:
        self.proc = proc
        self.answer_timeout_s = answer_timeout_s

    @classmethod
    async def start(cls, config, spec, max_pages: int, dist_port: int) -> "_Peer":
        t = config.transfer_timeout_s
        args = [sys.executable, "-m", "pdtb.microbench.lockstep_peer", "--backend", config.transport,
                "--spec", json.dumps(dataclasses.asdict(spec)), "--max-pages", str(max_pages), "--timeout-s", str(t)]
        if dist_port:
            args += ["--dist-port", str(dist_port)]
        return cls(await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.PIPE), t + ANSWER_MARGIN_S)

    async def ask(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise RuntimeError(f"the lockstep peer exited ({await self.proc.wait()})") from None
        line = await asyncio.wait_for(self.proc.stdout.readline(), self.answer_timeout_s)
        if not line:
            raise RuntimeError(f"the lockstep peer exited ({await self.proc.wait()})")
        return json.loads(line)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def _handoff(spec, index: int, rid: str, seed: int, vocab: int, deadline: float) -> Handoff:
    """Request `index`'s hand-off as a prefill node holds it: its prompt token ids and first output
    token (sampled at prefill) seeded, bound to the one decode node."""
    rng = random.Random(f"{seed}/lockstep/{index}")
    prompt = [rng.randrange(3, vocab) for _ in range(spec.prompt_len)]
    req = GenerateRequest(rid, prompt, Params(max_tokens=spec.output_len, ignore_eos=True), spec.tenant,
                          spec.priority or 0, spec.slo_tier or "", router_id=ROUTER, decode_node="decode")
    seq = Sequence(rid, [*prompt, rng.randrange(3, vocab)], len(prompt), to_sampling(req.params), req.tenant,
                   req.priority, req.slo_tier, num_computed_tokens=len(prompt))
    return Handoff(seq, req, [Target(req.decode_node, "")], deadline=deadline)


def _meta(h: Handoff) -> dict:
    seq, req = h.seq, h.req
    return {"tenant": seq.tenant, "prompt_token_ids": seq.prompt_token_ids, "output_token_ids": seq.output_token_ids,
            "num_computed_tokens": seq.num_computed_tokens,
            "extra": to_extra(HandoffMeta(req.router_id, req.params, req.priority, slo_tier=req.slo_tier))}


async def _adopted(node: _Node, rid: str) -> None:
    """Wait (bounded) until the node has adopted a landed transfer."""
    deadline = time.monotonic() + ADOPT_TIMEOUT_S
    while True:
        await node.poll_io()
        if rid in node.seqs:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{rid} landed but the node did not adopt it within {ADOPT_TIMEOUT_S}s")
        await asyncio.sleep(0.001)


class _Driver:
    """The order of events: hand-offs at their send times and retries at their backoff's end,
    each after the previous one has ended, then one engine step, step after step."""

    def __init__(self, node: _Node, peer: _Peer, specs: list, step_s: float, seed: int, vocab: int) -> None:
        self.node, self.peer, self.specs, self.step_s = node, peer, specs, step_s
        self.seed, self.vocab = seed, vocab
        self.rids = [f"r{i:05d}" for i in range(len(specs))]
        self.pending = deque(sorted(range(len(specs)), key=lambda i: (specs[i].send_time, i)))
        self.held: dict[int, tuple[Handoff, int]] = {}  # deferred: (its hand-off, the step it goes again at)
        self.failed: dict[str, int] = {}
        self.steps = 0

    def now(self) -> float:
        return self.steps * self.step_s

    async def run(self, max_steps: int) -> None:
        node = self.node
        while self.steps < max_steps:
            while self.pending and self.specs[self.pending[0]].send_time <= self.now():
                i = self.pending.popleft()
                await self.hand_off(i, _handoff(self.specs[i], i, self.rids[i], self.seed, self.vocab,
                                                self.now() + node.config.hold_timeout_s))
            for i in [i for i, (_, step) in self.held.items() if step <= self.steps]:
                await self.hand_off(i, self.held.pop(i)[0])
            await node.poll_io()
            if node.engine.has_work():
                node.on_step_events(node.engine.step(), self.now())
                await node.sink.flush()
            elif not self.pending and not self.held:
                return
            self.steps += 1
        raise RuntimeError(f"not done after {max_steps} steps: {len(self.pending)} to send, {len(self.held)} held")

    async def hand_off(self, i: int, h: Handoff) -> None:
        """One attempt; its end as a prefill node takes it (prefill_node/handoff.transfer_ended)."""
        got = await self.peer.ask({"rid": h.req.request_id, "num_tokens": h.seq.num_computed_tokens,
                                   "seed": self.seed * 1_000_003 + i, "meta": _meta(h)})
        h.on(HandoffEvent.SEND)
        code = got["code"]
        out = transfer_ended(h, got["state"] == "DONE", FailCode(code) if code in _CODES else None, self.now())
        if out is Outcome.LANDED:
            await _adopted(self.node, h.req.request_id)
        elif out is Outcome.HELD:
            self.held[i] = (h, self.steps + max(1, round((h.retry_at - self.now()) / self.step_s)))
        else:  # the prefill side fails it
            self.failed[code] = self.failed.get(code, 0) + 1


async def run_lockstep(config, specs: list, step_s: float, seed: int, vocab: int,
                       max_steps: int = 200_000) -> LockstepResult:
    """Hand `specs` off into a DecodeNode built from `config`, in lockstep (module docstring)."""
    t0 = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        store = None
        if config.transport == "torch":
            store = _store()
            config = dataclasses.replace(config, dist_init_method=f"tcp://127.0.0.1:{store.port}", dist_rank=0,
                                         dist_world_size=2)
        node = _Node(config)
        stack.callback(node.ctx.destroy, 0)
        spec = node.engine.spec
        max_pages = max(spec.pages_for(s.prompt_len) for s in specs) + 1
        peer = await _Peer.start(config, spec, max_pages, store.port if store else 0)
        stack.push_async_callback(peer.stop)
        if store is not None:
            await _join_group(store, peer)
            stack.callback(_leave_group)
        await node.start_extra()
        stack.push_async_callback(node.close_extra)
        await peer.ask({"endpoint": node.kv_addr})
        driver = _Driver(node, peer, specs, step_s, seed, vocab)
        node.set_clock(driver.now)
        await driver.run(max_steps)
        return _result(node, driver, time.monotonic() - t0)


def _store():
    """The TCPStore of the 2-rank gloo group (this node: rank 0; the peer: rank 1)."""
    import datetime

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


async def _join_group(store, peer: _Peer) -> None:
    """Join the group as rank 0; fails at once if the peer exits instead of joining."""
    import datetime

    import torch.distributed as dist
    join = asyncio.ensure_future(asyncio.to_thread(dist.init_process_group, "gloo", store=store, rank=0,
                                                   world_size=2, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)))
    gone = asyncio.ensure_future(peer.proc.wait())
    await asyncio.wait((join, gone), timeout=GROUP_TIMEOUT_S + 5, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not join.done():
        raise RuntimeError(f"the lockstep peer did not join the gloo group (exit status {peer.proc.returncode})")
    join.result()


def _leave_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _result(node: _Node, d: _Driver, wall_s: float) -> LockstepResult:
    pools = [p for p in (node.engine.pool, node.engine.host_pool) if p is not None]
    for p in pools:
        p.check()
    digest = hashlib.sha256()
    for rid in d.rids:
        digest.update(json.dumps([rid, node.tokens.get(rid, [])]).encode())
    info = policy_info(node.config.policy, node.config.policy_args)  # as the node describes its own
    return LockstepResult(node.config.transport, info.name, d.step_s, d.steps, len(d.specs),
                          len(node.finished), d.failed, {k: int(v) for k, v in sorted(node.admissions.items())},
                          node.verdicts, digest.hexdigest(), all(p.num_free == p.num_pages for p in pools),
                          round(wall_s, 3), info.to_json())


def parse(argv: list[str]):
    """(lockstep options, workload namespace, decode node namespace) from
    `[--step-ms MS] [--out FILE] WORKLOAD FLAGS -- NODE FLAGS`."""
    from pdtb.client.serve import build_parser
    from pdtb.node_cli import parse as parse_node

    own, node_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="pdtb bench lockstep", description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--step-ms", type=float, default=20.0, help="virtual milliseconds per engine step")
    ap.add_argument("--out", help="write the result here as JSON")
    ap.add_argument("--label-policy", help="the policy's name in the result (default: as the node names it)")
    ap.add_argument("-h", "--help", action="store_true")
    a, rest = ap.parse_known_args(own)
    if a.help:
        print(__doc__)
        raise SystemExit(0)
    if not a.step_ms > 0:
        ap.error("--step-ms must be > 0")
    na = parse_node("decode", node_argv)
    if na.transport == "torch":  # a group of this node and the peer, on a store run_lockstep hosts
        if na.device != "cpu":
            ap.error("--transport torch runs in lockstep on the CPU only (a gloo group; the peer's pages are on the CPU)")
        na.dist_init_method, na.dist_rank, na.dist_world_size = "tcp://127.0.0.1:0", 0, 2
    return a, build_parser().parse_args(rest), na


@dataclass
class Lockstep:
    """What `run_lockstep` takes, from the command line's flags."""

    config: object  # the decode node's NodeConfig
    specs: list
    step_s: float
    seed: int
    vocab: int  # prompt token ids are drawn below it
    out: str | None = None
    label: str | None = None  # the result's policy name, where not the node's own


def prepare(argv: list[str]) -> Lockstep:
    from transformers import AutoConfig

    from pdtb.client.serve import build_workload
    from pdtb.engine.loader import resolve_model_arg
    from pdtb.node_cli import node_config

    a, wa, na = parse(argv)
    model_dir = resolve_model_arg(na.model)
    specs, _ = build_workload(wa)
    return Lockstep(node_config("decode", na, model_dir), specs, a.step_ms / 1000, wa.seed,
                    AutoConfig.from_pretrained(model_dir).vocab_size, a.out, a.label_policy)


def main(argv: list[str] | None = None) -> int:
    import torch
    import uvloop

    job = prepare(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(job.config.engine.torch_threads)
    res = uvloop.run(run_lockstep(job.config, job.specs, job.step_s, job.seed, job.vocab))
    if job.label:
        res = dataclasses.replace(res, policy=job.label)
    if job.out:
        with open(job.out, "w") as f:
            json.dump(dataclasses.asdict(res), f)
    counts = " ".join(f"{k}={v}" for k, v in res.admissions.items())
    print(f"lockstep {res.transport}/{res.policy}: {res.requests} requests, {res.finished} finished, "
          f"{res.steps} steps of {res.step_s * 1000:g} ms; verdicts {counts}; failed {res.failed or 'none'}; "
          f"tokens {res.tokens_sha256[:16]}; pools {'empty' if res.pages_free else 'NOT EMPTY'} ({res.wall_s:.1f} s)")
    return 0 if res.pages_free else 1


if __name__ == "__main__":
    sys.exit(main())
