"""Scripted fake nodes on the real control protocol (tests, demos).

A scripted stand-in for a prefill, decode or colocated node, speaking the real control protocol.

For router tests and demos without a model: it binds a zmq ROUTER, answers Ping with NodeStats,
and answers GenerateRequest with deterministic tokens (`expected_output`) in several TokenBatch
messages. Like the real nodes in disaggregated mode, a fake prefill node sends the first token
itself and hands the request to its peer decode node (in-process, standing in for the KV
transfer), which streams the rest to the router identity over its own socket.

With a `prefix_ns`, a prefill or colocated fake node remembers the full-page hashes of every
prompt it gets (or is told to `remember`) and reports them, most recent first, as its prefix
summary, as a node with a prefix cache does.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdtb.nodes.protocol import (AbortRequest, GenerateRequest, NodeStats, Ping, TokenBatch, TokenEvent,
                              decode_message, encode_message)
from pdtb.aio import bounded
from pdtb.engine.prefix_hash import page_hashes


def expected_output(prompt_ids: list[int], max_tokens: int, tokens: list[int]) -> list[int]:
    """The tokens a fake node generates: `tokens` cycled from an offset set by the prompt."""
    start = sum(prompt_ids) % len(tokens)
    return [tokens[(start + i) % len(tokens)] for i in range(max_tokens)]


@dataclass
class FakeNodeConfig:
    """How a fake node behaves."""

    role: str  # "prefill" | "decode" | "colocated"
    node_id: str
    tokens: list[int]  # the output vocabulary, cycled (see expected_output)
    batch_size: int = 3  # tokens per TokenBatch
    delay: float = 0.0  # seconds between batches
    first_token_delay: float = 0.0  # prefill: hand off first, send the first token this much later
    pages_total: int = 1000
    answer_pings: bool = True  # False: look dead to the router
    fail_with: str | None = None  # answer every request with this error
    fail_retry: bool = False  # ... as a refusal before any work (a draining node's): retry elsewhere
    timing: dict = field(default_factory=lambda: {"fake": True})
    page_size: int = 16  # tokens per page of its prefix hashes
    prefix_ns: str = ""  # namespace of its prefix hashes ("": no prefix cache)
    summary_max: int = 1024  # page hashes reported at most


class FakeNode:
    """One fake node on an ephemeral loopback port. `await start()` returns its address."""

    def __init__(self, cfg: FakeNodeConfig, peer: "FakeNode | None" = None) -> None:
        self.cfg, self.peer = cfg, peer  # peer: the decode node a prefill node hands off to
        self.requests: list[GenerateRequest] = []
        self.aborts: list[AbortRequest] = []
        self.address = ""
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._cached: OrderedDict[int, None] = OrderedDict()  # page hashes, most recent last

    def remember(self, token_ids: list[int]) -> None:
        """Hold the full pages of `token_ids` in the prefix cache (reported from the next stats on)."""
        if not self.cfg.prefix_ns:
            return
        for h in page_hashes(token_ids, self.cfg.page_size, self.cfg.prefix_ns):
            self._cached.pop(h, None)
            self._cached[h] = None
        while len(self._cached) > self.cfg.summary_max:
            self._cached.popitem(last=False)

    async def start(self) -> str:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:0")
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._loop_task = asyncio.create_task(self._serve())
        return self.address

    async def close(self) -> None:
        tasks = [t for t in (self._loop_task, *self._streams.values()) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()

    async def _serve(self) -> None:
        while True:
            if not await self._sock.poll(100):
                continue
            ident, frame = await self._sock.recv_multipart()
            msg = decode_message(frame)
            if isinstance(msg, Ping) and self.cfg.answer_pings:
                await self._send(ident, self._stats(msg.seq))
            elif isinstance(msg, GenerateRequest):
                self.requests.append(msg)
                self.remember(msg.prompt_token_ids)
                self._streams[msg.request_id] = asyncio.create_task(self._generate(ident, msg))
            elif isinstance(msg, AbortRequest):
                self.aborts.append(msg)
                task = self._streams.pop(msg.request_id, None)
                if task:
                    task.cancel()
                    if msg.final:  # as a real node: the last event, with the timeline
                        await self._send(ident, TokenBatch(self.cfg.node_id, [TokenEvent(
                            msg.request_id, [], True, "stop", timing=dict(self.cfg.timing))]))

    def _stats(self, seq: int) -> NodeStats:
        busy = len(self._streams)
        return NodeStats(self.cfg.node_id, self.cfg.role, seq, self.cfg.pages_total,
                         self.cfg.pages_total - busy, running=busy,
                         kv_addr=f"tcp://fake-kv/{self.cfg.node_id}" if self.cfg.role == "decode" else "",
                         page_size=self.cfg.page_size,
                         prefix_ns=self.cfg.prefix_ns, prefix_summary=list(reversed(self._cached)))

    async def _send(self, ident: bytes, msg) -> None:
        await bounded(self._sock.send_multipart([ident, encode_message(msg)]), 2.0)

    async def _generate(self, ident: bytes, req: GenerateRequest) -> None:
        out = expected_output(req.prompt_token_ids, req.params.max_tokens, self.cfg.tokens)
        if self.cfg.fail_with:
            await self._send(ident, TokenBatch(self.cfg.node_id, [TokenEvent(
                req.request_id, [], True, "error", self.cfg.fail_with, retry=self.cfg.fail_retry)]))
            return
        if self.cfg.role == "prefill":
            last = len(out) == 1
            if not last:
                self.peer.accept(req, out[1:])
            await asyncio.sleep(self.cfg.first_token_delay)
            await self._send(ident, TokenBatch(self.cfg.node_id, [TokenEvent(
                req.request_id, out[:1], last, "length" if last else None, timing=dict(self.cfg.timing))]))
            self._streams.pop(req.request_id, None)
            return
        await self._stream(ident, req, out)

    def accept(self, req: GenerateRequest, rest: list[int]) -> None:
        """Decode side: the 'KV' arrived; stream `rest` to the router that sent `req`."""
        ident = req.router_id.encode()
        self._streams[req.request_id] = asyncio.create_task(self._stream(ident, req, rest))

    async def _stream(self, ident: bytes, req: GenerateRequest, out: list[int]) -> None:
        for i in range(0, len(out), self.cfg.batch_size):
            await asyncio.sleep(self.cfg.delay)
            chunk, last = out[i:i + self.cfg.batch_size], i + self.cfg.batch_size >= len(out)
            event = TokenEvent(req.request_id, chunk, last, "length" if last else None,
                               timing=dict(self.cfg.timing) if last else {})
            await self._send(ident, TokenBatch(self.cfg.node_id, [event]))
        self._streams.pop(req.request_id, None)
