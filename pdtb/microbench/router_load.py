"""The load of `pdtb bench router`: a lean client and the router's added latency.

The client reads each SSE chunk's arrival time and how many tokens it carries. The scripted
nodes' every token decodes to one word led by a space (router_bench's vocabulary), so a chunk's
token count is the number of spaces in its text; nothing else of it is read past the first
chunk's id (the request id the nodes logged).

    closed loop: `concurrency` requests in flight until `count` are done
    open loop:   `count` requests sent at Poisson times of `rate` per second

Added latency, per request, against the nodes' own send times (one monotonic clock per host):
    added TTFT = (client's first token - client's send) - (node's first send - node's receive)
    token delay = client's arrival of token k - node's send of token k
    added ITL   = quantile of the client's inter-token gaps - the same quantile of the nodes'
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from pdtb.client.sse import SSEParser


@dataclass
class Shot:
    """One request as the client saw it."""

    sent: float  # time.monotonic() when the request went out
    request_id: str = ""
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per chunk with tokens
    ended: float = 0.0
    error: str = ""
    usage_tokens: int | None = None  # the server's count, where it sent one (stream_options.include_usage)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else sum(n for _, n in self.chunks)


def _tokens_in(chunk: dict) -> int:
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    text = c.get("text")
    if text is None:
        text = (c.get("delta") or {}).get("content") or ""
    return text.count(" ")


async def one(http: aiohttp.ClientSession, url: str, body: dict) -> Shot:
    shot = Shot(time.monotonic())
    try:
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                shot.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return shot
            if not body.get("stream"):
                data = await resp.json()
                shot.request_id = data.get("id", "")
                shot.chunks.append((time.monotonic(), int((data.get("usage") or {}).get("completion_tokens", 0))))
                return shot
            parser = SSEParser()
            async for raw in resp.content.iter_any():
                now = time.monotonic()
                for ev in parser.feed(raw):
                    if ev == "[DONE]":
                        continue
                    chunk = json.loads(ev)
                    if "error" in chunk:
                        shot.error = str(chunk["error"])[:200]
                    if not shot.request_id:
                        shot.request_id = chunk.get("id", "")
                    if chunk.get("usage"):
                        shot.usage_tokens = int(chunk["usage"].get("completion_tokens", 0))
                    n = _tokens_in(chunk)
                    if n:
                        shot.chunks.append((now, n))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        shot.error = f"{type(e).__name__}: {e}"
    finally:
        shot.ended = time.monotonic()
    return shot


async def closed_loop(url: str, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[Shot], float]:
    """Every body sent, `concurrency` in flight; returns the shots and the wall seconds."""
    shots: list[Shot] = []
    it = iter(bodies)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async def worker() -> None:
            for body in it:
                shots.append(await one(http, url, body))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        return shots, time.monotonic() - t0


async def open_loop(url: str, bodies: list[dict], rate: float, seed: int, timeout: float) -> tuple[list[Shot], float]:
    """Each body sent at Poisson times of `rate` per second, whatever is in flight."""
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        t0, at, tasks = time.monotonic(), 0.0, []
        for body in bodies:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(http, url, body)))
            at += rng.expovariate(rate)
        shots = list(await asyncio.gather(*tasks))
        return shots, time.monotonic() - t0


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def added_latency(shots: list[Shot], node_log: dict) -> dict:
    """The router's added TTFT, token delay and ITL (milliseconds, p50 and p99), against the
    nodes' receive and send times of the same requests (see the module docstring)."""
    recv, sends = node_log["recv"], node_log["sends"]
    ttft, delay, client_itl, node_itl = [], [], [], []
    for s in shots:
        sent = sends.get(s.request_id)
        if s.error or not s.chunks or not sent:
            continue
        arrivals = [t for t, n in s.chunks for _ in range(n)]
        k = min(len(arrivals), len(sent))
        ttft.append((arrivals[0] - s.sent) - (sent[0] - recv[s.request_id]))
        delay.extend(arrivals[i] - sent[i] for i in range(k))
        client_itl.extend(arrivals[i] - arrivals[i - 1] for i in range(1, k))
        node_itl.extend(sent[i] - sent[i - 1] for i in range(1, k))
    out = {"requests": len(ttft)}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        out[f"ttft_{name}_ms"] = _ms(quantile(ttft, q))
        out[f"delay_{name}_ms"] = _ms(quantile(delay, q))
        c, n = quantile(client_itl, q), quantile(node_itl, q)
        out[f"itl_{name}_ms"] = None if c is None or n is None else _ms(c - n)
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)
