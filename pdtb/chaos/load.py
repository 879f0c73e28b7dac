"""The steady greedy load of several tenants over a seeded prompt pool; each request's timeline;
client cuts.

The campaign's steady load: several tenants, each with a few workers sending greedy streaming
completions one after another (prompts from a fixed pool, so that the checker's reference is
computed once per prompt). Every request keeps its timeline.

A request the router could not take (its connection refused while the router restarts, or a
503 before any token) is sent again, up to RETRY_FOR_S; what happened is in its timeline.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

from pdtb.client.sse import SSEParser, error_message

END_S = 120.0  # every request ends (completes, fails or is cut) within this bound
RETRY_FOR_S = 60.0  # a request refused before any token is sent again for this long
RETRY_GAP_S = 0.25  # ... this long apart


@dataclass
class Request:
    rid: int  # the campaign's own id
    tenant: str
    prompt: int  # index into the prompt pool
    max_tokens: int
    t_sent: float  # seconds from the campaign's start
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (seconds from start, what)
    status: int = 0  # the accepted attempt's HTTP status (0: none answered)
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None  # an error event or an HTTP error's message
    done: bool = False  # data: [DONE] came
    exc: str | None = None  # the connection broke (or the bound ran out)
    cut: str | None = None  # "client": closed by its client on purpose
    tries: int = 0
    t_end: float = 0.0
    resp: object = None  # the open response, while streaming (client-cut closes it)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("resp", "token_ids")} | {
            "tokens": len(self.token_ids)}


def prompt_pool(seed: int, vocab: int, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


class Load:
    def __init__(self, url: str, prompts: list[list[int]], *, seed: int, tenants: int, workers: int,
                 max_tokens: tuple[int, int], t0: float) -> None:
        self.url, self.prompts, self.seed = url, prompts, seed
        self.tenants, self.workers, self.max_tokens, self.t0 = tenants, workers, max_tokens, t0
        self.requests: list[Request] = []
        self.stop = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=END_S, sock_connect=5)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            await asyncio.gather(*(self.worker(http, f"tenant-{t}", random.Random(self.seed * 1000 + t * 100 + w))
                                   for t in range(self.tenants) for w in range(self.workers)))

    async def worker(self, http, tenant: str, rng: random.Random) -> None:
        while not self.stop.is_set():
            req = Request(len(self.requests), tenant, rng.randrange(len(self.prompts)), rng.randint(*self.max_tokens),
                          self.now())
            self.requests.append(req)
            await self.one(http, req)

    def in_flight(self) -> list[Request]:
        return [r for r in self.requests if r.resp is not None and r.token_ids and r.cut is None]

    def cut(self, n: int, rng: random.Random) -> list[int]:
        """Close `n` streams in flight (that have tokens) from the client side; their ids."""
        live = self.in_flight()
        chosen = rng.sample(live, min(n, len(live)))
        for r in chosen:
            r.cut = "client"
            r.timeline.append((self.now(), "closed by its client"))
            r.resp.close()
        return [r.rid for r in chosen]

    async def one(self, http, req: Request) -> None:
        body = {"prompt": self.prompts[req.prompt], "max_tokens": req.max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "user": req.tenant}
        deadline = time.monotonic() + END_S
        try:
            await asyncio.wait_for(self._attempts(http, req, body), max(1.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            req.exc = req.exc or f"did not end within {END_S:.0f} s"
            req.timeline.append((self.now(), req.exc))
        req.resp = None
        req.t_end = self.now()

    async def _attempts(self, http, req: Request, body: dict) -> None:
        retry_until = time.monotonic() + RETRY_FOR_S
        while True:
            req.tries += 1
            refused = await self._attempt(http, req, body)
            if refused is None or self.stop.is_set() and req.tries > 1 or time.monotonic() > retry_until:
                if refused is not None:
                    req.exc = refused
                return
            req.timeline.append((self.now(), f"refused: {refused}; sent again"))
            await asyncio.sleep(RETRY_GAP_S)

    async def _attempt(self, http, req: Request, body: dict) -> str | None:
        """One try. Returns why the router did not take it (then it is tried again), or None."""
        req.timeline.append((self.now(), "sent"))
        try:
            async with http.post(f"{self.url}/v1/completions", json=body) as resp:
                if resp.status == 503:
                    return f"HTTP 503 {(await resp.text())[:200]}"
                req.status = resp.status
                req.timeline.append((self.now(), f"HTTP {resp.status}"))
                if resp.status != 200:
                    req.error = (await resp.text())[:500]
                    return None
                req.resp = resp
                await self._read(resp, req)
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            return f"{type(e).__name__}: {e}"
        except (aiohttp.ClientError, ConnectionError) as e:
            if req.cut is None:
                req.exc = f"{type(e).__name__}: {e}"
                req.timeline.append((self.now(), f"connection broke: {req.exc}"))
        return None

    async def _read(self, resp, req: Request) -> None:
        parser = SSEParser()
        async for chunk in resp.content.iter_any():
            for data in parser.feed(chunk):
                if data == "[DONE]":
                    req.done = True
                    req.timeline.append((self.now(), f"[DONE] after {len(req.token_ids)} tokens, finish {req.finish}"))
                    continue
                obj = json.loads(data)
                err = error_message(obj)
                if err and req.error is None:
                    req.error = err
                    req.timeline.append((self.now(), f"error event: {err}"))
                for ch in obj.get("choices") or []:
                    if not req.token_ids and ch.get("token_ids"):
                        req.timeline.append((self.now(), "first token"))
                    req.token_ids += ch.get("token_ids") or []
                    req.finish = ch.get("finish_reason") or req.finish
        if not req.done and req.cut is None and req.exc is None:
            req.exc = "the stream ended without [DONE]"
            req.timeline.append((self.now(), req.exc))
