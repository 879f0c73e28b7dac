"""Helpers of the chaos, drain and soak tests: a streaming client that records how each request
ended, bounded waits, and process look-ups (real processes on loopback)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import aiohttp
import psutil

from pdtb.client.sse import SSEParser, count_tokens, error_message

END_S = 60.0  # every request ends within this bound


# ---- a streaming client that records how each request ended ------------------------------------
@dataclass
class Outcome:
    status: int = 0  # HTTP status; 0: no response
    tokens: int = 0  # output tokens received
    finish: str | None = None  # finish_reason of the last choice
    error: str | None = None  # HTTP error body or error event message
    done: bool = False  # the stream ended with data: [DONE]
    exc: str | None = None  # client-side exception (connection dropped, ...)
    token_ids: list[int] = field(default_factory=list)  # output token ids, in order
    timing: dict = field(default_factory=dict)  # the last chunk's pdtb_timing

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish is not None and self.error is None

    @property
    def failed_with_reason(self) -> bool:
        if self.status == 503:
            return bool(self.error)
        return self.status == 200 and self.done and bool(self.error) and self.exc is None


def check_ended_well(outs: list[Outcome]) -> None:
    bad = [o for o in outs if not (o.ok or o.failed_with_reason)]
    assert not bad, f"requests that neither finished nor failed with a reason: {bad[:5]}"


def prompt(vocab: int, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(16, vocab) for _ in range(n)]


async def stream(http, url: str, prompt_ids: list[int], max_tokens: int, *, started: list | None = None,
                 close_after: int | None = None, user: str | None = None) -> Outcome:
    """One streaming completion. `started` gets one item when 2 tokens arrived; with `close_after`
    the client closes the connection after that many tokens."""
    out = Outcome()
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "temperature": 0}
    if user is not None:
        body["user"] = user  # the tenant
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    out.error = error_message(json.loads(text)) or text
                except ValueError:
                    out.error = text or f"HTTP {resp.status}"
                return out
            parser = SSEParser()
            async for chunk in resp.content.iter_any():
                for data in parser.feed(chunk):
                    if data == "[DONE]":
                        out.done = True
                        continue
                    obj = json.loads(data)
                    out.error = out.error or error_message(obj)
                    out.timing = obj.get("pdtb_timing") or out.timing
                    before, out.tokens = out.tokens, out.tokens + count_tokens(obj)
                    for ch in obj.get("choices") or []:
                        out.finish = ch.get("finish_reason") or out.finish
                        out.token_ids += ch.get("token_ids") or []
                    if started is not None and before < 2 <= out.tokens:
                        started.append(1)
                    if close_after is not None and out.tokens >= close_after:
                        resp.close()  # the client goes away mid-stream
                        out.exc = "closed by the client"
                        return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.exc = f"{type(e).__name__}: {e}"
    return out


def http_client():
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=END_S + 30, sock_read=END_S),
                                 connector=aiohttp.TCPConnector(limit=0))


async def until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def procs_mentioning(text: str) -> set[int]:
    """Live processes (not zombies) whose command line mentions `text`."""
    out = set()
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(p.info["cmdline"] or ()):
                out.add(p.info["pid"])
        except psutil.Error:
            pass
    return out - {os.getpid()}
