"""Scripted nodes for `pdtb bench router`: the real control protocol, no model.

One process holds N colocated nodes, or P prefill and D decode nodes, each on its own ephemeral
loopback zmq ROUTER socket, as real nodes listen. They answer pings with NodeStats and step as
an engine does: every `step_s` (0: back to back, yielding to the loop between steps) each node
sends, per router, ONE TokenBatch carrying the next token of every request it runs. A prefill
node sends a request's first token in its next step and hands the rest to the decode node the
router chose (in-process, standing in for the KV transfer).

    GenerateRequest -> [prefill: first token, next step -> decode node] -> running
    step: for each router identity, TokenBatch(one TokenEvent per running request) -> send
    AbortRequest -> dropped from running

Every token's send time (time.monotonic(), one clock for every process of the host) is logged
by request id, with the request's receive time, and written as JSON to --log when the process
ends (stdin closed, SIGTERM or SIGINT), with the process's own CPU seconds. A line `step MS` on
stdin sets every node's step time.

    python -m pdtb.microbench.router_nodes --colocated 2 --step-ms 20 --tokens 11,12,13 --log F
    (prints `NODE ROLE ADDRESS` per node, then `READY`)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdtb.nodes.protocol import (AbortRequest, GenerateRequest, NodeStats, Ping, TokenBatch, TokenEvent,
                                 decode_message, encode_message)
from pdtb.router.fake_node import expected_output

PAGES_TOTAL = 1 << 22  # pools far larger than any benchmark prompt: the router never refuses for room
PAGE_SIZE = 16


@dataclass
class Stream:
    """One request a node runs: its tokens still to send."""

    ident: bytes  # the router's DEALER identity
    out: list[int]  # the request's whole output (expected_output)
    next: int  # index of the next token to send


@dataclass
class SendLog:
    """Per request id: the time the first node got it, and each token's send time."""

    recv: dict[str, float] = field(default_factory=dict)
    sends: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"recv": self.recv, "sends": self.sends}


class StepNode:
    """One scripted node on an ephemeral loopback port."""

    def __init__(self, ctx: zmq.asyncio.Context, role: str, node_id: str, tokens: list[int], step_s: float,
                 log: SendLog, decoders: dict[str, "StepNode"]) -> None:
        self.role, self.node_id, self.tokens, self.step_s = role, node_id, tokens, step_s
        self.log, self.decoders = log, decoders  # decoders: decode nodes by id (a prefill node's peers)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a slow router backs up here, not in a dropped frame
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.running: dict[str, Stream] = {}
        self.handoff: dict[str, str] = {}  # prefill: request id -> the decode node it goes to
        self._work = asyncio.Event()

    def stats(self, seq: int) -> NodeStats:
        return NodeStats(self.node_id, self.role, seq, PAGES_TOTAL, PAGES_TOTAL, running=len(self.running),
                         kv_addr=f"tcp://scripted-kv/{self.node_id}" if self.role == "decode" else "",
                         page_size=PAGE_SIZE)

    async def serve(self) -> None:
        """Answer pings, take requests and aborts."""
        while True:
            ident, frame = await self.sock.recv_multipart()
            msg = decode_message(frame)
            if isinstance(msg, Ping):
                await self.sock.send_multipart([ident, encode_message(self.stats(msg.seq))])
            elif isinstance(msg, GenerateRequest):
                self.log.recv.setdefault(msg.request_id, time.monotonic())
                self.log.sends.setdefault(msg.request_id, [])
                out = expected_output(msg.prompt_token_ids, msg.params.max_tokens, self.tokens)
                self.take(msg, Stream(ident, out, 0))
            elif isinstance(msg, AbortRequest):
                self.running.pop(msg.request_id, None)
                self.handoff.pop(msg.request_id, None)
                for d in self.decoders.values():
                    d.running.pop(msg.request_id, None)

    def take(self, req: GenerateRequest, stream: Stream) -> None:
        self.running[req.request_id] = stream
        if self.role == "prefill" and len(stream.out) > 1:  # one token here, the rest on the chosen node
            chosen = req.decode_node if req.decode_node in self.decoders else next(iter(self.decoders))
            self.handoff[req.request_id] = chosen
        self._work.set()

    async def step_loop(self) -> None:
        """One TokenBatch per router per step, with the next token of every running request."""
        while True:
            if not self.running:
                self._work.clear()
                await self._work.wait()
            started = time.monotonic()
            await self.step()
            left = self.step_s - (time.monotonic() - started)
            await asyncio.sleep(max(0.0, left))

    async def step(self) -> None:
        batches: dict[bytes, list[TokenEvent]] = {}
        done, handed = [], []
        for rid, s in self.running.items():
            tok = s.out[s.next]
            s.next += 1
            last = s.next >= len(s.out)
            if self.role == "prefill" and not last:
                handed.append(rid)
            elif last:
                done.append(rid)
            batches.setdefault(s.ident, []).append(TokenEvent(
                rid, [tok], last, "length" if last else None, timing={"scripted": True} if last else {}))
        now = time.monotonic()
        for ident, events in batches.items():
            await self.sock.send_multipart([ident, encode_message(TokenBatch(self.node_id, events))])
            for ev in events:
                self.log.sends[ev.request_id].append(now)
        for rid in done:
            del self.running[rid]
        for rid in handed:
            s = self.running.pop(rid)
            target = self.decoders[self.handoff.pop(rid)]
            target.running[rid] = s
            target._work.set()


def _commands(nodes: list[StepNode], stop: asyncio.Event):
    """A reader of stdin: `step MS` lines set every node's step time; end of input stops."""
    buf = bytearray()

    def on_input() -> None:
        data = os.read(sys.stdin.fileno(), 4096)
        if not data:
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            stop.set()
            return
        buf.extend(data)
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            word, _, value = line.decode().partition(" ")
            if word == "step":
                for n in nodes:
                    n.step_s = max(0.0, float(value)) / 1e3
    return on_input


async def run(a: argparse.Namespace) -> int:
    ctx = zmq.asyncio.Context()
    log, tokens = SendLog(), [int(t) for t in a.tokens.split(",")]
    decoders: dict[str, StepNode] = {}
    nodes = []
    for role, count in (("decode", a.decode), ("prefill", a.prefill), ("colocated", a.colocated)):
        for i in range(count):
            node = StepNode(ctx, role, f"{role}-{i}", tokens, a.step_ms / 1e3, log, decoders)
            if role == "decode":
                decoders[node.node_id] = node
            nodes.append(node)
    tasks = [asyncio.create_task(c) for n in nodes for c in (n.serve(), n.step_loop())]
    for n in nodes:
        print(f"NODE {n.role} {n.address}", flush=True)
    print("READY", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_reader(sys.stdin.fileno(), _commands(nodes, stop))
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()
    failed = [t for t in done if t is not waiter and not t.cancelled() and t.exception()]
    cpu = os.times()
    with open(a.log, "w") as f:
        json.dump({**log.to_json(), "cpu_s": cpu.user + cpu.system}, f)
    for n in nodes:
        n.sock.close(linger=0)
    ctx.term()
    if failed:
        raise failed[0].exception()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.microbench.router_nodes", description=__doc__.split("\n")[0])
    ap.add_argument("--colocated", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--decode", type=int, default=0)
    ap.add_argument("--step-ms", type=float, default=20.0, help="one step every this many ms (0: back to back)")
    ap.add_argument("--tokens", required=True, help="the output vocabulary, comma-separated ids, cycled")
    ap.add_argument("--log", required=True, help="JSON file of receive and send times, written at the end")
    a = ap.parse_args(argv)
    if a.colocated < 0 or a.prefill < 0 or a.decode < 0 or a.step_ms < 0:
        ap.error("counts and --step-ms must be >= 0")
    if not (a.colocated or (a.prefill and a.decode)):
        ap.error("give colocated nodes, or prefill and decode nodes")
    import uvloop

    return uvloop.run(run(a))


if __name__ == "__main__":
    sys.exit(main())
