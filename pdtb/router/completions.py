"""One request's path: submit, stream/JSON, abort on disconnect, drain.

One completion request's path through the router (/v1/completions and /v1/chat/completions).

    body -> parse/validate -> [chat: render the template] -> tokenize -> check lengths
         -> tenant slot (429) -> submit (503)
         -> TokenEvents from the request's queue -> OutputText (detok, stop strings) -> Pieces
         -> one JSON response, or SSE chunks ending with `data: [DONE]`

The nodes get an AbortRequest whenever the request ends before a node finished it: a stop
string matched, the client went away (aiohttp cancels the handler), a write stalled, a node
failed or fell silent, or the request timed out waiting for its next event. After a stop
string the abort asks for a last event (`final`): the text goes out at once, and the last chunk
(finish_reason "stop") waits for the node's timeline, at most FINAL_TIMING_S, to carry it as
`pdtb_timing`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web

from pdtb.nodes.protocol import Earlier, GenerateRequest, Params
from pdtb.aio import bounded
from pdtb.router.chat_api import ChatPrompt, chat_choice, chat_delta, parse_chat_request
from pdtb.router.config import RouterConfig, ServedModel
from pdtb.router.detok import OutputText, TextDelta
from pdtb.router.half_close import HEARTBEAT_S, peer_eof, write_cannot_wait
from pdtb.router.metrics import RouterMetrics
from pdtb.router.registry import NodeRegistry, RequestFailed, RequestHandle
from pdtb.router.openai_api import (ApiError, CompletionRequest, check_lengths, choice_body, completion_body,
                               parse_completion_request, usage_body)
from pdtb.router.prompts import prompt_ids_of


@dataclass
class RouterState:
    """Everything the handlers share (one per app)."""

    config: RouterConfig
    model: ServedModel
    registry: NodeRegistry
    metrics: RouterMetrics
    streams_by_tenant: dict[str, int] = field(default_factory=dict)  # open requests per tenant
    started: float = field(default_factory=time.time)  # wall-clock start, for /v1/models
    handlers: set = field(default_factory=set)  # asyncio tasks of in-flight completion handlers
    shutting_down: bool = False  # drain() began: new completions are refused (503)


STATE = web.AppKey("state", RouterState)
log = logging.getLogger("pdtb.router")
_TEXT_MARK = "\u0000pdtb-text\u0000"  # a chunk's text in middle_chunk: found once, as no id or model name holds NUL
FINAL_TIMING_S = 0.5  # how long a request ended by a stop string waits for its node's timeline
MAX_RESUBMITS = 3  # a request refused before any work (a draining node) is sent elsewhere at most this often


@dataclass
class Piece:
    """What one node event turns into for the client."""

    text: str  # newly released text
    token_ids: list[int]  # the event's token ids
    finish_reason: str | None = None  # set on the last piece
    timing: dict = field(default_factory=dict)  # the node's timeline (last piece)
    stop_reason: str | int | None = None  # last piece: the stop string or stop token id that ended it


def failure_error(e: RequestFailed) -> ApiError:
    """The OpenAI-shaped error for a request that failed after it was accepted."""
    kind = "invalid_request_error" if e.status < 500 else "service_unavailable" if e.status == 503 \
        else "server_error"
    return ApiError(e.status, str(e), kind, "invalid_value" if e.param else None, e.param)


class CompletionRun:
    """One accepted request from submit to its last byte."""

    def __init__(self, state: RouterState, req: CompletionRequest, prompt_ids: list[int], max_tokens: int):
        self.state, self.req, self.prompt_ids, self.max_tokens = state, req, prompt_ids, max_tokens
        self.chat = isinstance(req.prompt, ChatPrompt)  # chat.completion shapes instead of text_completion
        self.request_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.handle: RequestHandle | None = None
        self.released = False  # the handle was released (pieces() ended, or close())
        self.output_ids: list[int] = []  # every token the nodes sent, stop token included
        self.recomputes = 0  # times a node it depended on died and it was prefilled anew elsewhere
        self.resubmits = 0  # times a node refused it before any work and it was sent elsewhere
        self.recomputed_at = 0.0  # time.monotonic() of the last recompute's submission
        self.tokens_before = 0  # tokens streamed before the last recompute
        # prompt tokens served from the prefix cache (usage.prompt_tokens_details.cached_tokens): the
        # figure on the event with the first output token; a recompute after a node loss prefills
        # the prompt and the streamed tokens anew, and its hit is not what the client's prompt cost
        self.cached_tokens = 0
        self.first_token_at = self.last_token_at = 0.0  # time.monotonic() of the first and latest token
        self.latency = state.metrics.tenants.of(req.tenant)  # its tenant's TTFT/ITL series
        self.status = "200"  # for the requests counter; "499": the client went away
        self.delivered = False  # a stream's last event ([DONE]) was written: whatever follows, it was served
        self.request: web.Request | None = None  # the client's HTTP request, once its stream's response is prepared
        self._middle: tuple[bytes, bytes] | None = None  # a plain chunk's bytes around its text (middle_chunk)
        self._timing_sent: dict = {}  # the timeline the last chunk carried (the usage chunk repeats it)

    def submit(self) -> None:
        """Send the request to the chosen nodes. Raises ApiError(503) when none is available."""
        try:
            self.handle = self.state.registry.submit(self._generate_request(self.request_id, self.prompt_ids,
                                                                            self.max_tokens))
        except RequestFailed as e:
            raise failure_error(e) from None
        self.state.metrics.prompt_tokens.inc(len(self.prompt_ids))
        self.state.metrics.observe_route(self.handle.entry.node_id, self.handle.prefix_overlap_tokens)

    def _generate_request(self, request_id: str, prompt_ids: list[int], max_tokens: int,
                          first_index: int = 0, earlier: Earlier | None = None) -> GenerateRequest:
        params = Params(max_tokens, self.req.temperature, self.req.top_p, self.req.seed,
                        self.req.ignore_eos, list(self.req.stop_token_ids), first_index)
        tier = self.req.slo_tier or self.state.config.tenant_tiers.get(self.req.tenant, "")
        return GenerateRequest(request_id, prompt_ids, params, tenant=self.req.tenant,
                               priority=self.req.priority, slo_tier=tier, arrival_time=time.time(), earlier=earlier)

    async def _recompute(self, e: RequestFailed, unstarted: bool = False) -> bool:
        """A node the request depended on died (`e`): send it anew, its prompt followed by every
        token already streamed, to live nodes. Their prefill recomputes the KV; greedy output
        continues token for token, and a seeded sample draws its next tokens at the same output
        indices (Params.first_index), as an uninterrupted run would. With no healthy node to take
        it, it waits up to `node_wait` for one to come back. False when it may not: not a lost
        node, the retries spent, nothing left to generate, or still no node (then it fails)."""
        left = self.max_tokens - len(self.output_ids)
        if unstarted:  # refused before any work (a drain began): sent elsewhere, not a recompute
            if self.resubmits >= MAX_RESUBMITS:
                return False
            self.resubmits += 1
        elif not e.node_lost or self.recomputes >= self.state.config.recompute_retries or left < 1:
            return False
        else:
            self.recomputes += 1
        tries = self.recomputes + self.resubmits
        old = self.handle
        self.state.registry.abort(old, "recomputed on another node")  # any live node still holding it lets go
        self.state.registry.release(old)
        rid = f"{self.request_id}.r{tries}"
        req = self._generate_request(rid, self.prompt_ids + self.output_ids, left, len(self.output_ids),
                                     self._earlier() if self.recomputes else None)
        deadline = time.monotonic() + self.state.config.node_wait
        while True:
            try:
                self.handle = self.state.registry.submit(req)
                break
            except RequestFailed as no_node:
                wait = deadline - time.monotonic()
                if no_node.status != 503 or wait <= 0:
                    self.handle = old  # released already: _end does nothing more
                    return False
                log.info("request %s: %s; waiting up to %.1f s for one", self.request_id, no_node, wait)
                await self.state.registry.node_back(wait)  # (a node's return, or the deadline)
        if unstarted:
            log.info("request %s: %s; sent anew as %s", self.request_id, e, rid)
            return True
        self.state.metrics.recomputes.inc()
        self.recomputed_at, self.tokens_before = time.monotonic(), len(self.output_ids)
        log.info("request %s: %s; recomputed as %s after %d tokens", self.request_id, e, rid, len(self.output_ids))
        return True

    def _earlier(self) -> Earlier:
        """What the attempts so far took, for the next attempt's SLO attribution (the nodes
        judge the request whole: fairness/attribution.py)."""
        n = len(self.output_ids)
        tok = (lambda t: round(t - self.arrival, 6)) if n else (lambda t: -1.0)
        return Earlier(round(time.monotonic() - self.arrival, 6), n, tok(self.first_token_at), tok(self.last_token_at))

    def _timing(self, timing: dict) -> dict:
        """The final event's timeline, with what recomputes took: the stamps are the last
        attempt's, `recomputed.lost_s` the time before it (the lost attempts, the loss found,
        and the new submission); the SLO attribution covers the whole request (`_earlier`)."""
        if not self.recomputes:
            return timing
        return {**timing, "recomputed": {"times": self.recomputes, "lost_s": round(self.recomputed_at - self.arrival, 6),
                                         "tokens_before": self.tokens_before}}

    async def pieces(self) -> AsyncIterator[Piece]:
        """The output, one Piece per node event. Raises RequestFailed. Use with `aclosing`."""
        registry, metrics = self.state.registry, self.state.metrics
        out = OutputText(self.state.model.tokenizer, self.req.stop)
        finished_by_node, reason, last, stop_id = False, "client disconnected", None, None
        try:
            while True:
                try:
                    # (with stop strings, one event at a time: the tokens after a match are not output)
                    ev = await registry.next_event(self.handle, self.state.config.request_timeout,
                                                   merge=not self.req.stop)
                except RequestFailed as e:
                    if await self._recompute(e):
                        continue
                    reason = str(e)
                    raise
                if ev.retry and self.handle.entry is not None:  # a drain began, a hand-off failed: elsewhere
                    unstarted = not ev.token_ids and not self.output_ids
                    if unstarted:  # refused before any work: not back there before its next stats
                        self.handle.entry.refused_at = time.monotonic()
                    if await self._recompute(RequestFailed(503, f"{self.handle.entry.node_id}: {ev.error}",
                                                           node_lost=True), unstarted):
                        continue
                if ev.finish_reason == "error" or ev.error:
                    reason = f"failed on a node: {ev.error or 'no reason given'}"
                    raise RequestFailed(500, f"request {reason}")
                now = time.monotonic()
                if ev.token_ids and not self.output_ids:
                    self.cached_tokens = ev.cached_tokens
                last = self._observe(ev, now, last)
                ids = ev.token_ids
                if ev.finished and ids and ev.finish_reason == "stop" and ids[-1] in self.req.stop_token_ids:
                    stop_id, ids = ids[-1], ids[:-1]  # as vLLM: a stop token's text is not output
                delta = out.add(ids)
                finished_by_node = ev.finished
                if ev.finished and not delta.stopped:
                    tail = out.finish()
                    delta = TextDelta(delta.text + tail.text, tail.stopped)
                if delta.stopped and not ev.finished:
                    # A stop string ended it here while its node still runs: the text goes out
                    # now, then the last piece with the node's timeline, which the abort asks for.
                    reason = "stop string matched"
                    metrics.e2e.observe(now - self.arrival)
                    if delta.text or ids:
                        yield Piece(delta.text, ev.token_ids)
                    finished_by_node = True  # the abort goes out in _final_timing
                    yield Piece("", [], "stop", self._timing(await self._final_timing()),
                                self._stop_reason(out, "stop", stop_id))
                    return
                if delta.stopped or ev.finished:
                    reason = "stop string matched"
                    metrics.e2e.observe(now - self.arrival)
                    finish = "stop" if delta.stopped else (ev.finish_reason or "stop")
                    yield Piece(delta.text, ev.token_ids, finish, self._timing(ev.timing or {}),
                                self._stop_reason(out, finish, stop_id))
                    return
                yield Piece(delta.text, ev.token_ids)
        finally:
            self._end(None if finished_by_node else reason)

    async def _final_timing(self) -> dict:
        """Abort the request at its nodes asking the one that holds it for its last event, and
        return that event's timeline (pdtb_timing), or {} if none came within FINAL_TIMING_S
        (the output is complete already; only the attribution is missing then)."""
        registry = self.state.registry
        registry.abort(self.handle, "stop string matched", final=True)
        deadline = time.monotonic() + FINAL_TIMING_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = await registry.next_event(self.handle, left)
            except RequestFailed:
                return {}
            if ev.finished:  # token events still in flight before it are past the stop string
                return ev.timing or {}
        return {}

    def close(self) -> None:
        """Abort and release a submitted request whose output was never read (the client went
        away while the response headers were being written); a no-op once pieces() ended."""
        self._end("client disconnected before the response started")

    def _end(self, abort_reason: str | None) -> None:
        """Once: tell the nodes to drop the request (unless `abort_reason` is None: they
        finished it) and forget it here."""
        if self.handle is None or self.released:
            return
        if abort_reason is not None:
            self.state.registry.abort(self.handle, abort_reason)
        self.state.registry.release(self.handle)
        self.released = True

    def _stop_reason(self, out: OutputText, finish: str, stop_id: int | None) -> str | int | None:
        """vLLM's `stop_reason`: the stop string matched, or the stop token id sampled last;
        None for an end-of-sequence token, a length limit or an error."""
        if out.stops.stopped:
            return out.stops.matched
        return stop_id if finish == "stop" else None

    def _observe(self, ev, now: float, last: float | None) -> float | None:
        """Count the event's tokens; returns the time of the latest token batch."""
        self.output_ids += ev.token_ids
        if not ev.token_ids:
            return last
        self.last_token_at = now
        if not self.first_token_at:
            self.first_token_at = now
        if last is None:
            self.state.metrics.ttft.observe(now - self.arrival)
            self.latency.first_token(now - self.arrival, now)
        else:
            self.latency.tokens(len(ev.token_ids), now - last, now)
        self.state.metrics.observe_tokens(len(ev.token_ids), None if last is None else now - last)
        return now

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def _usage(self) -> dict:
        return usage_body(len(self.prompt_ids), self.num_output_tokens, self.cached_tokens)

    async def json_response(self, request: web.Request) -> web.StreamResponse:
        """Collect the whole output into one `text_completion` response. A client whose input
        ended while it waits (half-closed, or gone) gets a 200 at once and the body later,
        whitespace before it meanwhile: writes are how TCP tells the two apart (half_close.py);
        a failure then is an error body under that 200."""
        eof = peer_eof(request)
        body = asyncio.ensure_future(self._json_body())
        waits = {body} if eof is None else {body, asyncio.ensure_future(eof.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if body.done():
                return web.json_response(body.result())
            # (no Content-Length: chunked on HTTP/1.1, the body ended by the close on HTTP/1.0)
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            try:
                await bounded(resp.prepare(request), self.state.config.request_timeout)
                while not (await asyncio.wait({body}, timeout=HEARTBEAT_S))[0]:
                    await self._write(resp, b" ")
                try:
                    out = body.result()
                except ApiError as e:
                    self.status, out = str(e.status), e.body()
                except Exception:  # the 200 is out: the error goes in the body
                    log.exception("request %s failed after its response started", self.request_id)
                    self.status, out = "500", ApiError(500, "internal server error", "server_error").body()
                await self._write(resp, json.dumps(out, ensure_ascii=False).encode())
                self.delivered = True
                await bounded(resp.write_eof(), self.state.config.request_timeout)
            except (ConnectionResetError, asyncio.TimeoutError):
                if not self.delivered:
                    self.status = "499"  # the client had closed, not half-closed
            return resp
        finally:
            for w in waits:  # (the body's: the client went away; pieces() sends the abort)
                w.cancel()
                w.add_done_callback(_retrieved)

    async def _json_body(self) -> dict:
        text, ids, finish, timing, reason = [], [], None, {}, None
        try:
            async with aclosing(self.pieces()) as gen:
                async for p in gen:
                    text.append(p.text)
                    ids.extend(p.token_ids)
                    finish, timing = p.finish_reason or finish, p.timing or timing
                    reason = p.stop_reason if p.finish_reason else reason
        except RequestFailed as e:
            raise failure_error(e) from None
        rti = self.req.return_token_ids
        if self.chat:
            choice = chat_choice("".join(text), finish, ids if rti else None, stop_reason=reason)
        else:
            choice = choice_body("".join(text), finish, ids if rti else None, self.prompt_ids if rti else None,
                                 stop_reason=reason)
        extra = {"pdtb_timing": timing}
        if rti:
            extra["prompt_token_ids"] = self.prompt_ids
        return completion_body(request_id=self.request_id, created=self.created, model=self.state.model.name,
                               choice=choice, usage=self._usage(), extra=extra,
                               object_name="chat.completion" if self.chat else "text_completion")

    async def stream_response(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: one chunk per piece, an optional usage chunk, then [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        beat = None
        try:
            await bounded(resp.prepare(request), self.state.config.request_timeout)
            self.request = request
            if (eof := peer_eof(request)) is not None:
                beat = asyncio.ensure_future(self._heartbeat(resp, eof))
            try:
                await self._send_pieces(resp)
            except RequestFailed as e:
                self.status = str(e.status)
                await self._send(resp, failure_error(e).body())
            if beat is not None:  # no comment after the last event (nor after write_eof's terminator)
                beat.cancel()
                await asyncio.wait({beat})
            await self._write(resp, b"data: [DONE]\n\n")
            self.delivered = True
            await bounded(resp.write_eof(), self.state.config.request_timeout)
        except (ConnectionResetError, asyncio.TimeoutError):
            if not self.delivered:
                self.status = "499"  # the client went away or stopped reading; pieces() sent the abort
        finally:
            if beat is not None:
                beat.cancel()
        return resp

    async def _heartbeat(self, resp: web.StreamResponse, eof: asyncio.Event) -> None:
        """Once the client's input ended: an SSE comment every HEARTBEAT_S, so that a client that
        closed (not half-closed) is found while its request waits for tokens (half_close.py).
        Each write is a whole line pair, so it never splits an event; a failed write ends
        the stream as the client's close does."""
        await eof.wait()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._write(resp, b": \n\n")
            except (ConnectionResetError, asyncio.TimeoutError, RuntimeError):
                return  # (the stream's own next write fails the same way)

    async def _send_pieces(self, resp: web.StreamResponse) -> None:
        """Every piece as a chunk, `stream_interval` tokens to a chunk after the first; a failure
        sends the tokens held so far before its error event."""
        rti, first = self.req.return_token_ids, True
        if self.chat:  # the role comes first, before any token (as vLLM and OpenAI send it)
            await self._send(resp, self._chunk(chat_delta("", role=True),
                                               extra={"prompt_token_ids": self.prompt_ids} if rti else None))
        interval, held = self.state.config.stream_interval, Piece("", [])
        try:
            async with aclosing(self.pieces()) as gen:
                async for p in gen:
                    if interval > 1 and not first:  # held until `interval` tokens, or the last piece
                        p = Piece(held.text + p.text, held.token_ids + p.token_ids, p.finish_reason, p.timing,
                                  p.stop_reason)
                        held = Piece("", [])
                        if not p.finish_reason and len(p.token_ids) < interval:
                            held = p
                            continue
                    if await self._send_piece(resp, p, first):
                        first = False
        except RequestFailed:
            if held.text or held.token_ids:
                await self._send_piece(resp, held, first)
            raise
        if self.req.include_usage:
            await self._send(resp, self._chunk(None, usage=self._usage(), extra={"pdtb_timing": self._timing_sent}))

    async def _send_piece(self, resp: web.StreamResponse, p: Piece, first: bool) -> bool:
        """One piece as one chunk; False when it had nothing to send (an empty middle piece)."""
        rti = self.req.return_token_ids
        if not (p.text or p.finish_reason or (rti and p.token_ids)):
            return False
        if not p.finish_reason and not rti:  # most chunks: the text is all that changes
            head, tail = self.middle_chunk()
            await self._write(resp, head + json.dumps(p.text, ensure_ascii=False).encode() + tail)
            return True
        if self.chat:
            choice = chat_delta(p.text, p.finish_reason, p.token_ids if rti else None, p.stop_reason)
        else:
            choice = choice_body(p.text, p.finish_reason, p.token_ids if rti else None,
                                 self.prompt_ids if rti and first else None, stop_reason=p.stop_reason)
        if p.finish_reason:
            self._timing_sent = p.timing
        await self._send(resp, self._chunk(choice, extra={"pdtb_timing": p.timing} if p.finish_reason else None))
        return True

    def _chunk(self, choice: dict | None, usage: dict | None = None, extra: dict | None = None) -> dict:
        return completion_body(request_id=self.request_id, created=self.created, model=self.state.model.name,
                               choice=choice, usage=usage, extra=extra, stream=True,
                               usage_key=self.req.include_usage,
                               object_name="chat.completion.chunk" if self.chat else "text_completion")

    def middle_chunk(self) -> tuple[bytes, bytes]:
        """The SSE bytes of a chunk that carries text alone (no finish, no token ids), before and
        after its JSON-encoded text: json.dumps of the whole chunk, once per request, with a
        marker where the text goes."""
        if self._middle is None:
            choice = chat_delta(_TEXT_MARK) if self.chat else choice_body(_TEXT_MARK, None)
            raw = json.dumps(self._chunk(choice), ensure_ascii=False)
            head, tail = raw.split(json.dumps(_TEXT_MARK, ensure_ascii=False))
            self._middle = (b"data: " + head.encode(), tail.encode() + b"\n\n")
        return self._middle

    async def _send(self, resp: web.StreamResponse, body: dict) -> None:
        await self._write(resp, b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        """One write, bounded by the request timeout; one that cannot wait on the client (the
        common case, once per token) is awaited as it is, without the bounded wait's task and
        timer (half_close.write_cannot_wait)."""
        if self.request is not None and write_cannot_wait(self.request, len(data)):
            await resp.write(data)
        else:
            await bounded(resp.write(data), self.state.config.request_timeout)


def _retrieved(task: asyncio.Task) -> None:
    """(a cancelled helper task's exception, if it had one, is not left unretrieved)"""
    if not task.cancelled():
        task.exception()


THREAD_PARSE_BYTES = 1 << 20  # larger bodies are parsed and validated off the event loop


async def prepare(state: RouterState, raw: bytes, chat: bool = False) -> CompletionRun:
    """Parse, [render,] tokenize and length-check a body. Raises ApiError (400/404). A body of
    over a MiB is parsed in a thread: eight 7.7 MB bodies of one-character content parts held
    the loop for 4 s when parsed on it."""
    model = state.model
    parse = parse_chat_request if chat else parse_completion_request
    if len(raw) > THREAD_PARSE_BYTES:
        req = await asyncio.to_thread(parse, raw, model.name, model.vocab_size)
    else:
        req = parse(raw, model.name, model.vocab_size)
    prompt_ids = await prompt_ids_of(model, req.prompt)
    max_tokens = check_lengths(req, len(prompt_ids), model.max_model_len)
    room = state.registry.largest_pool_tokens() if req.max_tokens is None else None
    if room is not None and room > len(prompt_ids):  # a default output fits the pools too, as it fits the context
        max_tokens = min(max_tokens, room - len(prompt_ids))
    return CompletionRun(state, req, prompt_ids, max_tokens)


@contextlib.contextmanager
def tenant_slot(state: RouterState, tenant: str):
    """Hold one of the tenant's concurrent-request slots. Raises ApiError(429) when none is free."""
    limit = state.config.max_streams_per_tenant
    if state.streams_by_tenant.get(tenant, 0) >= limit:
        raise ApiError(429, f"too many concurrent requests for user {tenant!r} (limit {limit})",
                       "rate_limit_error", "rate_limit_exceeded")
    state.streams_by_tenant[tenant] = state.streams_by_tenant.get(tenant, 0) + 1
    state.metrics.in_flight.inc()
    try:
        yield
    finally:
        state.metrics.in_flight.dec()
        state.streams_by_tenant[tenant] -= 1
        if not state.streams_by_tenant[tenant]:
            del state.streams_by_tenant[tenant]


async def read_body(request: web.Request, timeout: float, max_bytes: int) -> bytes:
    """The request body; HTTPRequestEntityTooLarge past `max_bytes` (the app's client_max_size):
    at once where Content-Length says so, without waiting for a body that may never come."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=request.content_length)
    try:
        return await bounded(request.read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, "request body not received in time", "invalid_request_error", "timeout") from None


async def handle_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _handle(request, chat=False)


async def handle_chat_completion(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _handle(request, chat=True)


async def _handle(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    status, task, run = "200", asyncio.current_task(), None
    state.handlers.add(task)
    try:
        if state.shutting_down:  # a keep-alive connection may still send one during the grace period
            raise ApiError(503, "the router is shutting down", "service_unavailable", None)
        run = await prepare(state, await read_body(request, state.config.request_timeout, state.config.max_body_bytes), chat)
        if state.shutting_down:  # began while the body was read or rendered: drain() cannot fail it later
            raise ApiError(503, "the router is shutting down", "service_unavailable", None)
        with tenant_slot(state, run.req.tenant):
            run.submit()
            try:
                resp = await (run.stream_response(request) if run.req.stream else run.json_response(request))
            finally:
                run.close()
            status = run.status
            return resp
    except ApiError as e:
        status = str(e.status)
        raise
    except web.HTTPRequestEntityTooLarge:
        status = "413"
        raise
    except asyncio.CancelledError:  # (the client closed its connection: after a whole stream, often before write_eof)
        status = run.status if run is not None and run.delivered else "499"
        raise
    except Exception:
        status = "500"  # error_middleware answers it
        raise
    finally:
        state.handlers.discard(task)
        state.metrics.requests.labels(status).inc()


async def drain(state: RouterState, grace: float, last_words_s: float = 2.0) -> int:
    """Shutdown: wait up to `grace` seconds for in-flight completions; then fail the rest with a
    503 that each handler sends its client (an error event and [DONE] on a stream, an error
    response otherwise) and aborts at its nodes, and give the handlers `last_words_s` to do it
    before cancelling any still running (a client that stopped reading). Returns how many
    requests were cut."""
    state.shutting_down = True
    deadline = time.monotonic() + grace
    while state.handlers and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not state.handlers:
        return 0
    cut = len(state.handlers)
    state.registry.fail_all(f"the router shut down: the request was still running after the {grace:g} s grace period")
    deadline = time.monotonic() + last_words_s
    while state.handlers and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(state.handlers)
    for task in left:
        task.cancel()
    if left:
        await asyncio.wait(left, timeout=5.0)
    return cut
