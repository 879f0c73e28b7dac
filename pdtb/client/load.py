"""The load generator: sends a request list to a router and records what came back.

  open loop (concurrency None):  a dispatcher sleeps until each spec's send_time, then starts
                                 its request as a task (bodies are built before the sleep)
  closed loop (concurrency N):   N workers each send the next spec as soon as their last one ended;
                                 send times in the specs are ignored
  max_concurrency M (either):    at most M requests in flight; an arrival past that waits for a
                                 slot (vLLM's --max-concurrency), its wait shows as dispatch lag
Alongside, a monitor task samples `/cluster` every `sample_interval` s, measures the event loop's
lag and prints progress on stderr. Every HTTP wait is bounded by `request_timeout` between reads.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import aiohttp

from pdtb.client.prefix import prompt_ids
from pdtb.figures.records import CUT_OFF, OK, RequestRecord, RequestSpec
from pdtb.figures.samples import cluster_sample
from pdtb.client.sse import SSEParser, cached_tokens, count_tokens, error_message, usage_tokens
from pdtb.figures.summary import pct



@dataclass(frozen=True)
class RunConfig:
    """How to send the requests."""

    url: str  # router base URL
    model: str | None  # `model` field; None lets the router pick its served model
    vocab_size: int  # prompt ids are drawn from [min_token_id, vocab_size)
    min_token_id: int = 16  # keep clear of special tokens
    seed: int = 0  # prompt ids of request i come from rng(seed, i)
    concurrency: int | None = None  # None: open loop
    request_timeout: float = 600.0  # s between reads on one request
    sample_interval: float = 0.5  # s between /cluster samples; 0 disables
    return_token_ids: bool = True  # count tokens by token_ids (else one per chunk)
    temperature: float = 0.0
    progress: bool = True  # progress line on stderr
    api_key: str | None = None
    max_concurrency: int | None = None  # cap on requests in flight (open loop too); None: none
    warmup: int = 0  # requests sent (4 output tokens each) and awaited before the run; not recorded
    api: str = "completions"  # "completions" (token-id prompts) or "chat" (/v1/chat/completions)
    detokenize: Callable[[list[int]], str] | None = None  # chat: prompt ids -> the user message's text
    send_until: float | None = None  # closed loop: no request starts after this many s (specs are cycled)
    drain_timeout: float | None = None  # s to wait for requests in flight once sending ends; the rest are cut off


@dataclass
class RunResult:
    """What `run` measured."""

    records: list[RequestRecord]  # in spec order
    samples: list[dict]  # /cluster samples
    duration: float  # s from start until the last request ended
    start_time: float  # wall clock (epoch s) of the run's start
    client_overhead: dict  # dispatch lag, parse cost, loop lag
    warmup_failed: int = 0  # warm-up requests that failed (they are not in `records`)
    cluster_before: list | None = None  # `/cluster` read right before the first request (None: no answer)
    cluster_after: list | None = None  # `/cluster` read right after the last request ended


@dataclass
class _Progress:
    total: int
    done: int = 0
    failed: int = 0
    loop_lag: list[float] = field(default_factory=list)  # s
    finished: bool = False



async def read_cluster(http: aiohttp.ClientSession, url: str) -> list | None:
    """The router's `/cluster` answer, or None (a missed reading is a gap, not a failed run)."""
    try:
        async with http.get(url + "/cluster", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None

def request_body(cfg: RunConfig, index: int, spec: RequestSpec) -> bytes:
    """The JSON body of request `index`: seeded random prompt ids (opening with the spec's shared
    blocks, see pdtb/client/prefix.py), exact output length."""
    low = min(cfg.min_token_id, cfg.vocab_size - 1)
    ids = prompt_ids(cfg.seed, index, spec, low, cfg.vocab_size)
    if cfg.api == "chat":  # the text of the same ids as one user message (the template adds its tokens)
        prompt = {"messages": [{"role": "user", "content": cfg.detokenize(ids)}]}
    else:
        prompt = {"prompt": ids}
    body = {**prompt, "max_tokens": spec.output_len, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "user": spec.tenant, "ignore_eos": True,
            "return_token_ids": cfg.return_token_ids,
            # vLLM does not carry `user` to its scheduler; vllm_xargs reach it (SamplingParams.extra_args),
            # where pdtb.integrations.vllm reads the tenant. The project's router ignores the field.
            "vllm_xargs": {"tenant": spec.tenant}}
    if cfg.model:
        body["model"] = cfg.model
    if spec.priority is not None:
        body["priority"] = spec.priority
    if spec.slo_tier is not None:
        body["slo_tier"] = spec.slo_tier
    return json.dumps(body).encode()


def new_record(spec: RequestSpec, scheduled: float) -> RequestRecord:
    """`send_time` is the scheduled time until the request goes out: one cut off while it waits
    for a --max-concurrency slot has waited since then (not since the run's start)."""
    return RequestRecord(spec.tenant, spec.klass, spec.prompt_len, spec.output_len,
                         scheduled_time=scheduled, send_time=scheduled, priority=spec.priority)


def _close(rec: RequestRecord, now: float) -> None:
    """End `rec` at `now`: the server's token count where it sent one (without token_ids a chunk
    whose text the router held back, a partial character, never arrives and its token comes
    with a later chunk), else the tokens counted in the stream; TTFT from the first of them."""
    rec.end_time = now
    rec.output_tokens = max(rec.output_tokens, len(rec.token_times))
    rec.first_token_time = rec.token_times[0] if rec.token_times else None


def cut_off(rec: RequestRecord, now: float) -> RequestRecord:
    """`rec` of a request cancelled at `now` because its run ended: failed, tokens kept."""
    _close(rec, now)
    rec.error, rec.status = CUT_OFF, "failed"
    return rec


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, clock) -> bool:
    """Consume the SSE stream into `rec`; True when it ended with [DONE]."""
    parser = SSEParser()
    async for chunk in resp.content.iter_any():
        now = clock()
        t = time.perf_counter()
        for data in parser.feed(chunk):
            if data == "[DONE]":
                rec.parse_s += time.perf_counter() - t
                return True
            obj = json.loads(data)
            rec.error = rec.error or error_message(obj)
            rec.token_times.extend([now] * count_tokens(obj))
            rec.output_tokens = usage_tokens(obj) or rec.output_tokens
            rec.prompt_tokens = usage_tokens(obj, "prompt_tokens") or rec.prompt_tokens  # chat: what the template made
            if (cached := cached_tokens(obj)) is not None:
                rec.cached_tokens = cached
            rec.server_timing = obj.get("pdtb_timing") or rec.server_timing
        rec.parse_s += time.perf_counter() - t
    return False


async def send_one(http: aiohttp.ClientSession, cfg: RunConfig, spec: RequestSpec, body: bytes,
                   scheduled: float, clock, rec: RequestRecord | None = None) -> RequestRecord:
    """Send one request and record it (into `rec` when given, so a caller that cancels it still
    holds what arrived); never raises but CancelledError (a failure is a `failed` record)."""
    rec = rec or new_record(spec, scheduled)
    rec.send_time = clock()
    try:
        async with http.post(cfg.url + ("/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"), data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    msg = error_message(json.loads(text)) or text
                except ValueError:
                    msg = text
                rec.error = f"HTTP {resp.status}: {msg[:300]}"
            elif not await _read_stream(resp, rec, clock):
                rec.error = rec.error or "stream ended without [DONE]"
    except asyncio.TimeoutError:
        rec.error = f"timeout: nothing read for {cfg.request_timeout} s"
    except (aiohttp.ClientError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    _close(rec, clock())
    if rec.error is None and rec.first_token_time is None:  # as vLLM's client: no TTFT, no success
        rec.error = "the stream ended without an output token"
    rec.status = OK if rec.error is None else "failed"
    return rec


async def _monitor(http: aiohttp.ClientSession, cfg: RunConfig, prog: _Progress, samples: list, clock) -> None:
    """Sample /cluster, measure loop lag, print progress, until the run is finished."""
    tick, next_sample, next_print = 0.05, 0.0, 0.0
    tty, pending = sys.stderr.isatty(), set()
    while not prog.finished:
        now = clock()
        if cfg.sample_interval > 0 and now >= next_sample:
            next_sample = now + cfg.sample_interval
            task = asyncio.ensure_future(_sample(http, cfg, samples, clock))
            pending.add(task)  # a slow /cluster answer must not hold up the loop-lag ticks
            task.add_done_callback(pending.discard)
        if cfg.progress and now >= next_print:
            next_print = now + (0.5 if tty else 10.0)
            line = f"[bench] {prog.done}/{prog.total} done, {prog.failed} failed, {now:.1f}s elapsed"
            print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        before = time.perf_counter()
        await asyncio.sleep(tick)
        prog.loop_lag.append(max(0.0, time.perf_counter() - before - tick))
    if pending:
        await asyncio.gather(*pending)


async def _sample(http: aiohttp.ClientSession, cfg: RunConfig, samples: list, clock,
                  nodes: list | None = None) -> None:
    """Append a sample of `nodes` (default: read `/cluster` now)."""
    nodes = await read_cluster(http, cfg.url) if nodes is None else nodes
    if nodes is not None:
        samples.append(cluster_sample(clock(), nodes))


async def run(specs: list[RequestSpec], cfg: RunConfig) -> RunResult:
    """Send every spec and return the records (in spec order) and samples."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=cfg.request_timeout)
    prog, samples = _Progress(len(specs)), []
    records: dict[int, RequestRecord] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout,
                                     headers=headers) as http:
        warmup_failed = await _warm_up(http, cfg, specs)
        before = await read_cluster(http, cfg.url)  # the prefix counters' starting point
        start_wall, t0 = time.time(), time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()

        async def one(i: int, body: bytes, scheduled: float) -> None:
            spec = specs[i % len(specs)]
            rec = records[i] = new_record(spec, scheduled)
            try:
                async with slots:
                    await send_one(http, cfg, spec, body, scheduled, clock, rec)
            except asyncio.CancelledError:
                cut_off(rec, clock())
                raise
            finally:
                prog.done += 1
                prog.failed += rec.status != OK

        monitor = asyncio.ensure_future(_monitor(http, cfg, prog, samples, clock))
        try:
            if cfg.concurrency:
                await _closed_loop(cfg, specs, one, clock, prog)
            else:
                await _open_loop(cfg, specs, one, clock)
            duration = clock()
        finally:
            prog.finished = True
            await monitor
        after = await read_cluster(http, cfg.url)
        if cfg.sample_interval > 0:
            await _sample(http, cfg, samples, clock, after)
        if cfg.progress:
            print(("\r" if sys.stderr.isatty() else "") + f"[bench] {prog.done}/{prog.total} done, "
                  f"{prog.failed} failed, {duration:.1f}s", file=sys.stderr, flush=True)
    done = [records[i] for i in sorted(records)]
    samples.sort(key=lambda s: s["t"])
    return RunResult(done, samples, duration, start_wall, client_overhead(done, prog.loop_lag), warmup_failed,
                     before, after)


async def _warm_up(http: aiohttp.ClientSession, cfg: RunConfig, specs: list[RequestSpec]) -> int:
    """Send `cfg.warmup` requests shaped like the first specs but with 4 output tokens, all at
    once, and wait for them (connections, the router's and nodes' first-request costs). Their
    prompts come from another seed than the run's. Returns how many failed."""
    if cfg.warmup <= 0 or not specs:
        return 0
    warm_cfg = replace(cfg, seed=cfg.seed + 7919)  # prompts unlike the run's (no prefix reuse)
    firsts = (specs[i % len(specs)] for i in range(cfg.warmup))
    shapes = [replace(sp, output_len=min(4, sp.output_len)) for sp in firsts]
    recs = await asyncio.gather(*(send_one(http, warm_cfg, sp, request_body(warm_cfg, i, sp), 0.0, time.perf_counter)
                                  for i, sp in enumerate(shapes)))
    return sum(r.status != OK for r in recs)


async def _drain(cfg: RunConfig, tasks: list[asyncio.Future]) -> None:
    """Wait for the requests in flight (at most `drain_timeout` s), then cancel the rest (each
    becomes a cut-off record)."""
    if cfg.drain_timeout is None or not tasks:
        await asyncio.gather(*tasks)
        return
    _, late = await asyncio.wait(tasks, timeout=cfg.drain_timeout)
    for t in late:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _open_loop(cfg: RunConfig, specs: list[RequestSpec], one, clock) -> None:
    tasks = []
    try:
        for i, spec in enumerate(specs):
            body = request_body(cfg, i, spec)
            delay = spec.send_time - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i, body, spec.send_time)))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    await _drain(cfg, tasks)


async def _closed_loop(cfg: RunConfig, specs: list[RequestSpec], one, clock, prog: _Progress) -> None:
    """N workers; each index goes to exactly one worker. With `send_until` the specs are cycled
    (index i sends specs[i % len], its prompt seeded by i) until that time."""
    it = itertools.count() if cfg.send_until is not None else iter(range(len(specs)))

    async def worker() -> None:
        for i in it:
            scheduled = clock()
            if cfg.send_until is not None:
                if scheduled >= cfg.send_until:
                    return
                prog.total = max(prog.total, i + 1)
            await one(i, request_body(cfg, i, specs[i % len(specs)]), scheduled)

    await _drain(cfg, [asyncio.ensure_future(worker()) for _ in range(cfg.concurrency)])


def client_overhead(records: list[RequestRecord], loop_lag: list[float]) -> dict:
    """The client's own cost: lag from scheduled to actual send, stream parsing per token, and how
    late the event loop woke up (a busy client shows here first)."""
    ms = 1000.0
    return {"dispatch_lag_ms": pct([(r.send_time - r.scheduled_time) * ms for r in records]),
            "parse_us_per_token": pct([r.parse_s / r.output_tokens * 1e6 for r in records if r.output_tokens]),
            "parse_ms_total": sum(r.parse_s for r in records) * ms,
            "loop_lag_ms": pct([x * ms for x in loop_lag])}
