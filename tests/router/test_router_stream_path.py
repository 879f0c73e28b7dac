"""The router's per-token path: its event queue, merging of queued events, and the chunk
template, each against a hand-worked or independently built reference."""
from __future__ import annotations

import asyncio
import json

import pytest

from pdtb.nodes.protocol import TokenEvent
from pdtb.router.chat_api import chat_delta
from pdtb.router.completions import CompletionRun
from pdtb.router.dispatch import merge_queued
from pdtb.router.event_queue import EventQueue
from pdtb.router.openai_api import choice_body
from tests.async_case import async_test
from tests.router.test_router_integration import PROMPT, cluster, reference, run, served, tokens  # noqa: F401 (fixtures)


@async_test(timeout=10)
async def test_a_queued_event_is_taken_without_waiting():
    q = EventQueue()
    q.put_nowait("a")
    q.put_nowait("b")
    assert await q.get(0.0) == "a"  # a zero timeout: nothing is awaited when an event waits
    assert q.peek() == "b" and q.qsize() == 1


@async_test(timeout=10)
async def test_a_waiting_get_wakes_on_put_and_times_out_without_one():
    q = EventQueue()
    getter = asyncio.ensure_future(q.get(5.0))
    await asyncio.sleep(0)
    q.put_nowait("x")
    assert await getter == "x"
    with pytest.raises(asyncio.TimeoutError):
        await q.get(0.01)
    assert q.empty()


@async_test(timeout=10)
async def test_a_cancelled_get_propagates_and_loses_no_event():
    q = EventQueue()
    getter = asyncio.ensure_future(q.get(5.0))
    await asyncio.sleep(0)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    q.put_nowait("kept")  # put after the cancel: still there for the next get
    assert await q.get(1.0) == "kept"


@async_test(timeout=10)
async def test_an_event_put_as_the_deadline_fires_is_returned():
    q = EventQueue()
    getter = asyncio.ensure_future(q.get(0.0))  # its timer fires on the next loop pass
    q.put_nowait("late")
    assert await getter == "late"


def ev(ids, finished=False, **kw):
    return TokenEvent("r", ids, finished, "length" if finished else None, **kw)


def queue_of(*events) -> EventQueue:
    q = EventQueue()
    for e in events:
        q.put_nowait(e)
    return q


def test_queued_plain_events_merge_into_one_ending_where_the_last_ends():
    q = queue_of(ev([2]), ev([3, 4]), ev([5], True, timing={"t": 1}))
    out = merge_queued(ev([1]), q)
    assert (out.token_ids, out.finished, out.finish_reason, out.timing) == ([1, 2, 3, 4, 5], True, "length", {"t": 1})
    assert q.empty()


@pytest.mark.parametrize("finished", [False, True])
def test_a_merged_event_keeps_the_cache_hit_of_the_first_output_token(finished):
    """Only the event with a request's first output token carries `cached_tokens`; merged with
    the events behind it (or behind a tokenless one) the figure stays."""
    q = queue_of(ev([2], cached_tokens=32), ev([3], finished))
    assert merge_queued(ev([], cached_tokens=0), q).cached_tokens == 32
    q = queue_of(ev([2]), ev([3], finished))
    assert merge_queued(ev([1], cached_tokens=48), q).cached_tokens == 48


def test_merging_stops_before_an_error_or_a_retry_and_never_passes_a_final_event():
    retry = TokenEvent("r", [], True, "error", "draining", retry=True)
    q = queue_of(ev([2]), retry, ev([9]))
    out = merge_queued(ev([1]), q)
    assert out.token_ids == [1, 2] and not out.finished
    assert q.get_nowait() is retry  # left for the handler, in order
    final = ev([7], True)
    q = queue_of(ev([8]))
    assert merge_queued(final, q) is final and q.qsize() == 1  # nothing after the last event joins it


def test_an_event_alone_is_returned_as_it_is():
    e = ev([1])
    assert merge_queued(e, EventQueue()) is e


class _Req:
    def __init__(self, chat: bool, include_usage: bool) -> None:
        from pdtb.router.chat_api import ChatPrompt

        self.prompt = ChatPrompt(({"role": "user", "content": "hi"},), True, ()) if chat else "hi"
        self.include_usage = include_usage


class _State:
    class model:
        name = 'tiny "model"'


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", ["plain", ' a "quoted" \\ back\nslash', "Grüße 東京 🙂", "\u0000nul", ""])
def test_the_chunk_template_writes_the_bytes_json_dumps_writes(chat, include_usage, text):
    run = CompletionRun.__new__(CompletionRun)  # the template needs only the request's identity
    run.state, run.req, run.chat, run._middle = _State, _Req(chat, include_usage), chat, None
    run.request_id, run.created = "cmpl-0123", 1700000000
    head, tail = run.middle_chunk()
    choice = chat_delta(text) if chat else choice_body(text, None)
    want = b"data: " + json.dumps(run._chunk(choice), ensure_ascii=False).encode() + b"\n\n"
    assert head + json.dumps(text, ensure_ascii=False).encode() + tail == want


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_stream_interval_sends_that_many_tokens_a_chunk_and_the_same_output(served, tokens, mode):
    prompt_ids = served.tokenizer(PROMPT)["input_ids"]
    ids, text = reference(served, tokens, prompt_ids, 11)
    # one token an event, 20 ms apart; a handler behind its node merges queued events into one (so
    # a chunk may hold more than the interval, never fewer but the last)
    node_kw = {"colocated": {"batch_size": 1, "delay": 0.02}, "decode": {"batch_size": 1, "delay": 0.02}}

    async def go():
        async with cluster(served, tokens, mode=mode, node_kw=node_kw, stream_interval=4) as c:
            chunks = [ch async for ch in await c.client().completions.create(
                model="tiny", prompt=PROMPT, max_tokens=11, stream=True, extra_body={"return_token_ids": True})]
            counts = [len(ch.choices[0].token_ids) for ch in chunks]
            assert all(n >= 4 for n in counts[1:-1]) and counts[-1] >= 1  # [1, 4, 4, 2] unmerged
            assert len(counts) <= 4
            assert sum((ch.choices[0].token_ids for ch in chunks), []) == ids
            assert "".join(ch.choices[0].text for ch in chunks) == text
            assert chunks[-1].choices[0].finish_reason == "length"

    run(go())


def test_a_stream_interval_below_one_is_refused():
    from pdtb.router.config import NodeSpec, RouterConfig

    with pytest.raises(ValueError, match="stream-interval"):
        RouterConfig((NodeSpec("colocated", "tcp://127.0.0.1:1"),), stream_interval=0)


@async_test(timeout=30)
async def test_a_write_to_a_paused_connection_is_bounded_by_the_request_timeout():
    """A paused connection under its high-water mark (it resumes only at the low-water mark):
    the write must take the bounded path and time out, not wait on the client for ever."""
    import types

    from aiohttp import web

    outcome: dict = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        run = CompletionRun.__new__(CompletionRun)
        run.state = types.SimpleNamespace(config=types.SimpleNamespace(request_timeout=0.2))
        resp = web.StreamResponse()
        await resp.prepare(request)
        run.request = request
        await run._write(resp, b"data: first\n\n")  # not paused: written at once
        request.protocol.pause_writing()  # as the transport does past its high-water mark
        assert request.transport.get_write_buffer_size() < request.transport.get_write_buffer_limits()[1]
        try:
            for _ in range(1000):  # aiohttp drains once about every 64 KiB written
                await run._write(resp, b"data: " + b"x" * 1000 + b"\n\n")
            outcome["result"] = "never waited"
        except asyncio.TimeoutError:
            outcome["result"] = "timed out"
        request.protocol.resume_writing()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{runner.addresses[0][1]}/") as r:
                await r.read()
    finally:
        await runner.cleanup()
    assert outcome["result"] == "timed out"
