"""The real router app over real zmq sockets, against fake nodes, driven by the openai client.

Fake nodes (pdtb/router/fake_node.py) answer pings and stream deterministic tokens; in disaggregated
mode the fake prefill node sends the first token and its decode peer sends the rest to the
router identity over its own socket, as the real nodes do. Expected text comes from the
tokenizer's own decode of `expected_output`, never from the router.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
import openai
import pytest

from pdtb.router.completions import STATE, drain
from pdtb.router.config import NodeSpec, RouterConfig, load_served_model
from pdtb.router.fake_node import FakeNode, FakeNodeConfig, expected_output
from pdtb.router.main import start_router

from async_case import async_test

TEXT = "Grüße 東京 🙂 and ünïcödé, 서울!"
PROMPT = "Prefill runs the prompt once"


@pytest.fixture(scope="module")
def served(llama_dir):
    return load_served_model(llama_dir, "tiny")


@pytest.fixture(scope="module")
def tokens(served):
    return served.tokenizer(TEXT, add_special_tokens=False)["input_ids"]


@dataclass
class Cluster:
    url: str
    nodes: dict[str, FakeNode]
    state: object  # RouterState

    def client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=10.0)


async def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def get(url: str, headers: dict | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        async with s.get(url, headers=headers) as r:
            text = await r.text()
            return r.status, (json.loads(text) if r.content_type == "application/json" else text)


@contextlib.asynccontextmanager
async def cluster(served, tokens, mode: str = "disagg", healthy: bool = True, node_kw: dict | None = None, **router_kw):
    """Fake nodes plus a router on ephemeral ports; everything is closed on exit."""
    node_kw = node_kw or {}
    if mode == "disagg":
        dec = FakeNode(FakeNodeConfig("decode", "d0", tokens, **node_kw.get("decode", {})))
        pre = FakeNode(FakeNodeConfig("prefill", "p0", tokens, **node_kw.get("prefill", {})), peer=dec)
        nodes = {"prefill": pre, "decode": dec}
    else:
        nodes = {"colocated": FakeNode(FakeNodeConfig("colocated", "c0", tokens, **node_kw.get("colocated", {})))}
    runner = None
    try:
        specs = tuple([NodeSpec(role, await n.start()) for role, n in nodes.items()])
        router_kw = {"port": 0, "ping_interval": 0.05, "health_timeout": 0.5, **router_kw}
        runner, url = await start_router(RouterConfig(specs, **router_kw), served)
        c = Cluster(url, nodes, runner.app[STATE])
        if healthy:
            await wait_until(lambda: all(c.state.registry.is_healthy(n) for n in c.state.registry.nodes),
                             what="nodes healthy")
        yield c
    finally:
        if runner is not None:
            await asyncio.wait_for(runner.cleanup(), 10)
        for n in nodes.values():
            await n.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def reference(served, tokens, prompt_ids, max_tokens):
    ids = expected_output(prompt_ids, max_tokens, tokens)
    return ids, served.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("first_token_delay", [0.0, 0.1])  # 0.1: decode tokens overtake the first token
def test_disaggregated_stream_and_json_agree(served, tokens, first_token_delay):
    prompt_ids = served.tokenizer(PROMPT)["input_ids"]
    ids, text = reference(served, tokens, prompt_ids, 13)
    extra = {"return_token_ids": True, "ignore_eos": True}

    async def go():
        async with cluster(served, tokens, node_kw={"prefill": {"first_token_delay": first_token_delay}}) as c:
            client = c.client()
            r = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=13, temperature=0,
                                                extra_body=extra)
            assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
            assert r.choices[0].token_ids == ids and r.prompt_token_ids == prompt_ids
            assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
                (len(prompt_ids), 13, len(prompt_ids) + 13)
            assert r.pdtb_timing == {"fake": True}
            chunks = [ch async for ch in await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=13, stream=True, stream_options={"include_usage": True},
                extra_body=extra)]
            body, usage = chunks[:-1], chunks[-1]
            assert "".join(ch.choices[0].text for ch in body) == text
            assert sum((ch.choices[0].token_ids for ch in body), []) == ids
            assert body[0].choices[0].prompt_token_ids == prompt_ids
            assert body[-1].choices[0].finish_reason == "length" and body[-1].pdtb_timing == {"fake": True}
            assert usage.choices == [] and usage.usage.completion_tokens == 13
            req = c.nodes["prefill"].requests[0]
            assert req.decode_node == "d0" and req.decode_kv_addr == "tcp://fake-kv/d0"
            assert req.router_id == c.state.registry.router_id and req.params.ignore_eos
            assert c.nodes["decode"].requests == []  # the decode node only hears from its prefill peer
            assert not c.nodes["prefill"].aborts and not c.nodes["decode"].aborts

    run(go())


def test_colocated_token_prompt_and_stop_string(served, tokens):
    prompt_ids = [5, 6, 7]
    ids, text = reference(served, tokens, prompt_ids, 200)
    stop = "東京"
    assert stop in text

    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {"delay": 0.01}}) as c:
            client = c.client()
            r = await client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=200, stop=["zzz", stop])
            assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
            assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's field: which stop ended it
            assert r.model_extra["pdtb_timing"] == {"fake": True}  # the node's timeline, asked for with the abort
            node = c.nodes["colocated"]
            await wait_until(lambda: node.aborts, what="abort after the stop string")
            assert node.aborts[0].request_id == node.requests[0].request_id and node.aborts[0].final
            chunks = [ch async for ch in await client.completions.create(
                model="tiny", prompt=prompt_ids, max_tokens=200, stop=stop, stream=True)]
            assert "".join(ch.choices[0].text for ch in chunks) == text[:text.index(stop)]
            assert chunks[-1].choices[0].finish_reason == "stop"
            assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
            assert chunks[-1].model_extra["pdtb_timing"] == {"fake": True}
            r = await client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=3)
            assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None

    run(go())


def test_no_healthy_node_is_503(served, tokens):
    async def go():
        async with cluster(served, tokens, healthy=False, node_kw={"decode": {"answer_pings": False}}) as c:
            await wait_until(lambda: c.state.registry.is_healthy(c.state.registry.nodes[0]), what="prefill healthy")
            with pytest.raises(openai.APIStatusError) as info:
                await c.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert info.value.status_code == 503 and "decode" in info.value.body["message"]
            status, body = await get(c.url + "/health")
            assert status == 503 and body["missing"] == [{"role": "decode", "address": c.nodes["decode"].address}]
            assert c.nodes["prefill"].requests == []

    run(go())


async def read_sse(resp: aiohttp.ClientResponse, n: int | None = None) -> list:
    """Up to `n` SSE data payloads (all when None), decoded; the string "[DONE]" stays as is."""
    events = []
    while n is None or len(events) < n:
        line = await asyncio.wait_for(resp.content.readline(), 5)
        if not line:
            break
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_client_disconnect_aborts_on_both_nodes(served, tokens):
    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.2}}) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "stream": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await read_sse(resp, 2)
                    resp.close()  # the client goes away mid-stream
            await wait_until(lambda: c.nodes["decode"].aborts and c.nodes["prefill"].aborts, what="aborts")
            rid = c.nodes["prefill"].requests[0].request_id
            assert c.nodes["decode"].aborts[0].request_id == rid == c.nodes["prefill"].aborts[0].request_id
            await wait_until(lambda: c.state.registry.num_open_requests == 0, what="request released")
            assert c.state.streams_by_tenant == {}
            # non-streaming: the client gives up waiting; aiohttp cancels the handler
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(c.url + "/v1/completions", json={**body, "stream": False})
            await wait_until(lambda: len(c.nodes["decode"].aborts) == 2, what="abort of the non-streaming request")
            assert c.nodes["decode"].aborts[1].request_id == c.nodes["prefill"].requests[1].request_id
            await wait_until(lambda: c.state.registry.num_open_requests == 0, what="request released")
            _, metrics = await get(c.url + "/metrics")
            assert 'pdtb_router_requests_total{status="499"} 2.0' in metrics

    run(go())


async def half_closed(url: str, body: dict, close: bool = False, version: str = "1.1") -> bytes:
    """POST `body` over a raw connection, then shut the sending side (close=True: close the
    socket at once) and read the answer to the end."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (version.encode(), len(data), data))
    await writer.drain()
    if close:
        writer.close()
        return b""
    writer.write_eof()
    got = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    return got


def unchunk(body: bytes) -> bytes:
    out = b""
    while True:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + rest[:n], rest[n + 2:]


def test_a_client_that_half_closed_is_answered_stream_and_json(served, tokens):
    """A client that shuts its sending side once its request is out gets the whole answer:
    the stream (SSE comments keep it company while tokens are slow), or a 200 at once and
    the JSON body after whitespace."""
    prompt_ids = served.tokenizer(PROMPT)["input_ids"]
    ids, text = reference(served, tokens, prompt_ids, 30)

    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.15}}) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "ignore_eos": True, "return_token_ids": True}
            head, _, raw = (await half_closed(c.url, {**body, "stream": True})).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            events = unchunk(raw).decode().split("\n\n")
            assert ": " in events  # a heartbeat while the tokens came slowly
            data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert [t for ch in chunks for t in ch["choices"][0].get("token_ids") or []] == ids
            head, _, raw = (await half_closed(c.url, body)).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            got = unchunk(raw)
            assert got.startswith(b" ")  # the body was started before the answer was ready
            answer = json.loads(got)
            assert answer["choices"][0]["token_ids"] == ids and answer["choices"][0]["text"] == text
            # HTTP/1.0 has no chunks: the body runs to the close
            head, _, raw = (await half_closed(c.url, body, version="1.0")).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200 ") and raw.startswith(b" ")
            assert json.loads(raw)["choices"][0]["token_ids"] == ids
            await wait_until(lambda: c.state.registry.num_open_requests == 0, what="requests released")
            assert not c.nodes["decode"].aborts

    run(go())


def test_a_client_that_closed_while_waiting_is_found_and_aborted(served, tokens):
    """A client that closed its socket (not half-closed) while its request waits is told from
    one that half-closed by the router's writes: its request is aborted at its nodes."""
    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.3}, "prefill": {"first_token_delay": 20}}) as c:
            for stream in (True, False):
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "stream": stream}
                await half_closed(c.url, body, close=True)
                n = 1 + (not stream)
                await wait_until(lambda: len(c.nodes["prefill"].aborts) == n, 15, what="the abort")
            await wait_until(lambda: c.state.registry.num_open_requests == 0, what="requests released")

    run(go())


CLOSE_AT_END = '''
import socket, sys
host, port, body, n = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4])
head = (f"POST /v1/completions HTTP/1.1\\r\\nHost: {host}\\r\\nContent-Type: application/json\\r\\n"
        f"Content-Length: {len(body)}\\r\\n\\r\\n").encode()
for _ in range(n):
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head + body)
        got = b""
        while not got.endswith(b"\\r\\n0\\r\\n\\r\\n"):  # the chunked body's end, then close at once
            more = sock.recv(65536)
            if not more:
                sys.exit(f"the stream ended early: {got[-200:]!r}")
            got += more
'''


def test_a_stream_read_to_its_end_counts_as_served_when_the_client_closes_at_once(served, tokens, monkeypatch):
    """A client that closes its connection as soon as the stream's last bytes arrive (curl does)
    may cancel the handler before write_eof returns (here it always does: write_eof lingers after
    writing): the request was served all the same, not a 499."""
    write_eof = web.StreamResponse.write_eof

    async def lingering_write_eof(self, data=b""):
        await write_eof(self, data)
        await asyncio.sleep(2)  # the client has all of it and closes meanwhile: the handler is cancelled here

    monkeypatch.setattr(web.StreamResponse, "write_eof", lingering_write_eof)

    async def go():
        async with cluster(served, tokens) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True}
            host, port = c.url.removeprefix("http://").split(":")
            # another process, as curl is
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLOSE_AT_END, host, port,
                                                        json.dumps(body), "12")
            try:
                assert await asyncio.wait_for(proc.wait(), 30) == 0
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await wait_until(lambda: not c.state.handlers, what="handlers done")
            _, metrics = await get(c.url + "/metrics")
            assert 'pdtb_router_requests_total{status="200"} 12.0' in metrics, metrics
            assert 'status="499"' not in metrics

    run(go())


def test_a_text_too_long_for_the_context_is_refused_without_tokenizing(served, tokens):
    """A 4 MB prompt (under the body limit) would take seconds of tokenizing on the router's
    loop, which would then miss its nodes' pings and fail another client's stream. It is a 400
    from a character bound, while that stream runs on."""
    assert served.max_prompt_chars is not None and served.max_prompt_chars < 4_000_000

    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {"delay": 0.02}},
                           health_timeout=1.0) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async def victim():
                    async with s.post(c.url + "/v1/completions", json=body) as resp:
                        return resp.status, await resp.text()

                task = asyncio.create_task(victim())
                await asyncio.sleep(0.1)
                big = {"model": "tiny", "prompt": "hello world " * 350_000, "max_tokens": 4}
                async with s.post(c.url + "/v1/completions", json=big) as resp:
                    err = await resp.json()
                    assert resp.status == 400 and err["error"]["param"] == "prompt", err
                    assert "characters" in err["error"]["message"]
                status, text = await task
            assert status == 200 and '"finish_reason": "length"' in text and "error" not in text

    run(go())


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_request_no_pool_can_hold_is_400(served, tokens, mode):
    """8 pages of 16 tokens hold 128: a prompt + max_tokens past that is the client's error,
    answered before any node sees it (not a node's failure, a 500)."""
    small = {"colocated": {"pages_total": 8}, "decode": {"pages_total": 8}}

    async def go():
        async with cluster(served, tokens, mode=mode, node_kw=small) as c:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                body = {"model": "tiny", "prompt": [5] * 100, "max_tokens": 40}
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    err = await resp.json()
                    assert resp.status == 400 and err["error"]["type"] == "invalid_request_error", err
                    assert "needs up to 9 KV pages" in err["error"]["message"]
                    assert (err["error"]["code"], err["error"]["param"]) == ("invalid_value", "max_tokens")
                async with s.post(c.url + "/v1/completions", json={**body, "max_tokens": 20}) as resp:
                    assert resp.status == 200  # 120 tokens: 8 pages
                # chat's default max_tokens (the rest of the context) shrinks to what the pool holds
                chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
                async with s.post(c.url + "/v1/chat/completions", json=chat) as resp:
                    assert resp.status == 200, await resp.text()
                    usage = (await resp.json())["usage"]
                assert usage["prompt_tokens"] + usage["completion_tokens"] == 128, usage
            entry = c.nodes["colocated" if mode == "colocated" else "prefill"]
            assert len(entry.requests) == 2
            assert len(entry.requests[-1].prompt_token_ids) + entry.requests[-1].params.max_tokens == 128

    run(go())


def test_decode_node_dies_mid_stream(served, tokens):
    """A node that stops answering while its connection stands (hung) is down after the hang
    timeout."""
    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.1}}, hang_timeout=1.0, node_wait=0.3) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "stream": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    await read_sse(resp, 2)
                    c.nodes["decode"].cfg.answer_pings = False
                    c.nodes["decode"].cfg.delay = 30.0  # and it stops streaming
                    events = await read_sse(resp)
            assert events[-1] == "[DONE]" and "stopped answering" in events[-2]["error"]["message"]
            assert events[-2]["error"]["type"] == "service_unavailable"
            # a new request now has no decode node
            with pytest.raises(openai.APIStatusError) as info:
                await c.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert info.value.status_code == 503

    run(go())


@pytest.mark.parametrize("node_wait", [0.0, 20.0])
def test_a_request_to_recompute_waits_for_a_node_to_come_back(served, tokens, node_wait):
    """Its only node hung mid-stream, a request waits up to node_wait for a node that can take
    its recompute (a restarted one, added here), and goes on there; with no wait it fails."""
    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {"delay": 0.05}},
                           hang_timeout=1.0, node_wait=node_wait) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "stream": True}
            spare = FakeNode(FakeNodeConfig("colocated", "c1", tokens, delay=0.01))
            addr = await spare.start()
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=25)) as s:
                    async with s.post(c.url + "/v1/completions", json=body) as resp:
                        await read_sse(resp, 2)
                        c.nodes["colocated"].cfg.answer_pings = False
                        c.nodes["colocated"].cfg.delay = 30.0  # hung
                        reg = c.state.registry
                        if node_wait:
                            await wait_until(lambda: reg.node_set.waiters, 10, what="the request to wait for a node")
                            async with s.post(c.url + "/admin/nodes", json={"role": "colocated", "address": addr}):
                                pass
                        events = await read_sse(resp)
                assert events[-1] == "[DONE]"
                errors = [e for e in events[:-1] if "error" in e]
                if node_wait:
                    assert not errors and events[-2]["choices"][0]["finish_reason"] == "length"
                    assert [r.request_id.rsplit(".", 1)[1] for r in spare.requests] == ["r1"]  # the recompute
                else:
                    assert "stopped answering" in errors[-1]["error"]["message"] and not spare.requests
            finally:
                await spare.close()

    run(go())


def test_a_long_step_is_not_a_death_but_a_closed_connection_is(served, tokens):
    """A node in one long engine step answers no ping: taking 3 s of silence for death would
    fail every request there (12 of 14 requests, on steps of 1-6 s carrying a 2,048-token
    prefill chunk). Silence over a live connection is tolerated up to the hang timeout; a node whose connection drops (its process died) is down after the health timeout."""
    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {"delay": 0.05}},
                           health_timeout=0.5, hang_timeout=20.0) as c:
            node = c.nodes["colocated"]
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "stream": True, "ignore_eos": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    await read_sse(resp, 2)
                    node.cfg.answer_pings, node.cfg.delay = False, 2.0  # a 2 s step: 4x the health timeout
                    await asyncio.sleep(1.5)
                    node.cfg.answer_pings, node.cfg.delay = True, 0.05
                    events = await read_sse(resp)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
            registry = c.state.registry
            (state,) = registry.nodes
            assert state.connected
            await node.close()  # the process is gone: its connection drops
            await wait_until(lambda: not registry.is_healthy(state), timeout=5.0, what="the node judged down")
            assert not state.connected

    run(go())


def test_a_request_a_draining_node_refused_unstarted_goes_to_another(served, tokens):
    """A node that began draining refuses a request the router sent before its stats said so:
    the refusal says it may be retried, and the router sends it to another node (the client
    sees the other node's tokens, no error); a plain error is the client's."""
    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {
                "fail_with": "node is draining", "fail_retry": True, "pages_total": 5000}}) as c:
            spare = FakeNode(FakeNodeConfig("colocated", "c1", tokens))
            addr = await spare.start()
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                    async with s.post(c.url + "/admin/nodes", json={"role": "colocated", "address": addr}) as resp:
                        assert resp.status == 200
                reg = c.state.registry
                await wait_until(lambda: len(reg.nodes) == 2 and reg.is_healthy(reg.nodes[1]), what="c1 healthy")
                r = await c.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                                        extra_body={"return_token_ids": True})
                assert r.choices[0].token_ids == expected_output([5, 6, 7], 4, tokens)  # served by c1
                assert [q.request_id.rsplit(".", 1)[-1] for q in spare.requests] == ["r1"]
                c.nodes["colocated"].cfg.fail_retry = False  # a plain failure is not retried
                c.nodes["colocated"].cfg.pages_total = 10 ** 6
                await wait_until(lambda: reg.nodes[0].stats.pages_total == 10 ** 6, what="c0's stats")
                with pytest.raises(openai.APIStatusError):
                    await c.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
            finally:
                await spare.close()

    run(go())


def test_node_error_and_request_timeout(served, tokens):
    async def go():
        async with cluster(served, tokens, mode="colocated", node_kw={"colocated": {"fail_with": "boom"}}) as c:
            with pytest.raises(openai.InternalServerError) as info:
                await c.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert "boom" in info.value.body["message"]
        async with cluster(served, tokens, mode="colocated", request_timeout=0.3,
                           node_kw={"colocated": {"delay": 30.0}}) as c:
            with pytest.raises(openai.APIStatusError) as info:
                await c.client().completions.create(model="tiny", prompt="x", max_tokens=2)
            assert info.value.status_code == 503 and "no response" in info.value.body["message"]
            await wait_until(lambda: c.nodes["colocated"].aborts, what="abort after timeout")

    run(go())


def test_info_endpoints_and_metrics(served, tokens):
    async def go():
        async with cluster(served, tokens) as c:
            await c.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
            status, models = await get(c.url + "/v1/models")
            assert status == 200 and models["data"][0]["id"] == "tiny"
            assert models["data"][0]["max_model_len"] == served.max_model_len
            assert models["data"][0]["vocab_size"] == served.vocab_size
            status, health = await get(c.url + "/health")
            assert status == 200 and health["status"] == "ok"
            status, nodes = await get(c.url + "/cluster")
            assert status == 200 and [n["role"] for n in nodes] == ["prefill", "decode"]
            assert {"role", "id", "address", "pages_total", "pages_free", "host_pages_total", "host_pages_free",
                    "running", "waiting", "healthy", "extra"} <= set(nodes[0])
            assert nodes[1]["id"] == "d0" and nodes[1]["healthy"] and nodes[1]["pages_total"] == 1000
            status, text = await get(c.url + "/metrics")
            assert status == 200 and 'pdtb_router_requests_total{status="200"} 1.0' in text
            assert "pdtb_router_ttft_seconds_count 1.0" in text and "pdtb_router_generation_tokens_total 4.0" in text
            assert "pdtb_router_requests_in_flight 0.0" in text

    run(go())


def test_auth_limits_and_http_errors(served, tokens):
    async def go():
        async with cluster(served, tokens, api_key="sekret", max_body_bytes=4096) as c:
            with pytest.raises(openai.AuthenticationError) as info:
                await c.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
            assert info.value.body["code"] == "invalid_api_key"
            r = await c.client("sekret").completions.create(model="tiny", prompt="x", max_tokens=2)
            assert r.usage.completion_tokens == 2
            assert (await get(c.url + "/health"))[0] == 200  # open without a key
            with pytest.raises(openai.NotFoundError) as info:
                await c.client("sekret").completions.create(model="other", prompt="x", max_tokens=2)
            assert info.value.body["code"] == "model_not_found"
            with pytest.raises(openai.BadRequestError):
                await c.client("sekret").completions.create(model="tiny", prompt="x", max_tokens=10 ** 6)
            auth = {"Authorization": "Bearer sekret"}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5), headers=auth) as s:
                for data, want in ((b"x" * 5000, 413), (b"{bad", 400)):
                    async with s.post(c.url + "/v1/completions", data=data) as resp:
                        assert resp.status == want and set((await resp.json())["error"]) >= {"message", "type"}
                async with s.get(c.url + "/v1/nothing") as resp:
                    assert resp.status == 404 and "error" in await resp.json()
                # the admin routes are behind the key; a fault to inject needs --allow-fault-injection
                for path, body, want in (("/admin/migrate", {"request_id": "r", "to": "d0"}, 409),
                                         ("/admin/drain", {"node": "nobody"}, 409),
                                         ("/admin/migrate", {"request_id": "r", "to": "d0", "inject": "lose_final"}, 403),
                                         ("/admin/migrate", {"request_id": "r"}, 400),
                                         ("/admin/faults", {"node": "d0", "faults": {"drop_prob": 1}, "for_s": 1}, 403)):
                    async with s.post(c.url + path, json=body) as resp:
                        assert resp.status == want and "error" in await resp.json(), (path, body)
                async with s.get(c.url + "/cluster/migrations") as resp:
                    assert resp.status == 200 and (await resp.json())["in_flight"] == []
            # a Content-Length past the limit is refused from the headers, the body never awaited
            host, port = c.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 9000000\r\n\r\n{")
            status = await asyncio.wait_for(reader.readline(), 5)  # (request_timeout is far longer)
            writer.close()
            assert b" 413 " in status, status
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                async with s.post(c.url + "/admin/drain", json={"node": "d0"}) as resp:
                    assert resp.status == 401

    run(go())


def test_tenant_stream_limit(served, tokens):
    async def go():
        async with cluster(served, tokens, mode="colocated", max_streams_per_tenant=1,
                           node_kw={"colocated": {"delay": 0.1}}) as c:
            client = c.client()
            first = await client.completions.create(model="tiny", prompt="x", max_tokens=30, stream=True, user="a")
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model="tiny", prompt="x", max_tokens=2, user="a")
            r = await client.completions.create(model="tiny", prompt="x", max_tokens=2, user="b")
            assert r.choices[0].finish_reason == "length"
            await first.close()

    run(go())


def test_dispatch_policy_prefers_idle_prefill_and_free_decode():
    from pdtb.nodes.protocol import NodeStats
    from pdtb.router.registry import NodeState, pick_most_free, pick_prefill

    def node(role, **stats):
        n = NodeState(NodeSpec(role, "tcp://127.0.0.1:1"))
        n.stats = NodeStats("n", role, 0, 100, stats.pop("pages_free", 100), **stats)
        return n

    busy, idle_but_running, idle = node("prefill", queued_tokens=50), node("prefill", running=3), node("prefill", running=1)
    assert pick_prefill([busy, idle_but_running, idle]) is idle
    a, b = node("decode", pages_free=60), node("decode", pages_free=50)
    assert pick_most_free([a, b]) is a
    a.pending_pages["r1"] = 20  # sent there recently, not yet in its stats
    assert pick_most_free([a, b]) is b
    assert pick_prefill([]) is None and pick_most_free([]) is None


@async_test
async def test_a_silent_node_fails_its_requests_with_why():
    """A node that goes silent fails the requests that depend on it; one that said it was draining
    is reported as shut down, even when its own abort messages were lost on the way."""
    import asyncio

    from pdtb.nodes.protocol import NodeStats
    from pdtb.router.registry import NodeRegistry, RequestHandle

    reg = NodeRegistry([NodeSpec("colocated", "tcp://127.0.0.1:1"), NodeSpec("colocated", "tcp://127.0.0.1:2")])
    crashed, drained = reg.nodes
    crashed.stats = NodeStats("a", "colocated", 0, 100, 100)
    drained.stats = NodeStats("b", "colocated", 0, 100, 100, draining=True)
    for rid, node in (("r1", crashed), ("r2", drained), ("r3", drained)):
        reg.dispatch.requests[rid] = RequestHandle(rid, node, None)
    reg.follower.fail_dependents(crashed)
    reg.follower.fail_dependents(drained)
    why = {rid: str(h.queue.get_nowait()) for rid, h in reg.dispatch.requests.items()}
    assert "stopped answering" in why["r1"] and "shut down" not in why["r1"]
    assert all("shut down" in why[r] for r in ("r2", "r3"))


def test_stop_reason_of_a_stop_token(served):
    from pdtb.router.completions import CompletionRun
    from pdtb.router.detok import OutputText
    from pdtb.router.openai_api import parse_completion_request

    run = CompletionRun.__new__(CompletionRun)  # only the request is needed
    run.req = parse_completion_request(json.dumps({"prompt": "x", "stop_token_ids": [7, 9]}).encode(), "tiny", 512)
    out = OutputText(served.tokenizer)
    out.add([5])  # the stop token itself is not added to the text (vLLM leaves its text out)
    assert run._stop_reason(out, "stop", 9) == 9
    assert run._stop_reason(out, "length", None) is None
    assert run._stop_reason(out, "stop", None) is None  # ended by an end-of-sequence token


def test_a_node_that_cannot_take_a_request_is_skipped_for_another():
    """A prefill node killed a moment ago still looks healthy until the health timeout, but its
    queue no longer drains: the request goes to another prefill node, and the refusing one is
    left out until it answers a ping again (else a chaos run gets 48 instant 503s while another
    prefill node is healthy)."""
    import time as _time

    from pdtb.nodes.protocol import GenerateRequest, NodeStats, Params
    from pdtb.router.registry import NodeRegistry, RequestFailed

    reg = NodeRegistry([NodeSpec("prefill", "tcp://127.0.0.1:1"), NodeSpec("prefill", "tcp://127.0.0.1:2"),
                        NodeSpec("decode", "tcp://127.0.0.1:3")])
    now = _time.monotonic()
    for i, n in enumerate(reg.nodes):
        n.stats = NodeStats(f"n{i}", n.spec.role, 0, 100, 100, running=i, kv_addr="tcp://kv")
        n.last_seen = now
    dead, alive = reg.nodes[0], reg.nodes[1]  # the dead one is the idler: it would be chosen first
    sent = []
    reg.node_set.send = lambda node, msg: node is not dead and not sent.append(node)

    def req(i):
        return GenerateRequest(f"r{i}", [5, 6, 7], Params(4))
    assert reg.submit(req(1)).entry is alive and dead.refused_at is not None
    assert reg.submit(req(2)).entry is alive and sent == [alive, alive]  # not even tried again
    dead.last_seen = _time.monotonic() + 1  # it answered a ping: back in the running
    alive.last_seen = dead.last_seen
    reg.node_set.send = lambda node, msg: False  # nobody takes it now
    with pytest.raises(RequestFailed) as info:
        reg.submit(req(3))
    assert info.value.status == 503


def test_shutdown_grace_refuses_new_requests_and_finishes_running_ones(served, tokens):
    """During drain (the router's SIGTERM grace period) a kept-alive connection can still send
    requests: they get a 503 at once, /health says so, and the stream already running finishes."""
    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.05}}) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stream": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await read_sse(resp, 2)
                    drained = asyncio.create_task(drain(c.state, 8.0))
                    await asyncio.sleep(0.05)  # drain() has begun
                    async with s.post(c.url + "/v1/completions", json={**body, "stream": False}) as late:
                        assert late.status == 503
                        assert "shutting down" in (await late.json())["error"]["message"]
                    async with s.get(c.url + "/health") as h:
                        assert h.status == 503
                    rest = await read_sse(resp)
                    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
                assert await asyncio.wait_for(drained, 10) == 0  # nothing had to be cancelled
            assert len(c.nodes["prefill"].requests) == 1  # the late one never reached a node

    run(go())


def test_requests_past_the_grace_period_end_with_an_error_not_a_cut_connection(served, tokens):
    """When the grace period runs out, each request still running gets a 503 it can read (an
    error event and [DONE] on a stream, an error response otherwise) and is aborted at its
    nodes, instead of its handler being cancelled and the client seeing the connection break."""
    async def go():
        async with cluster(served, tokens, node_kw={"decode": {"delay": 0.05}}) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "stream": True}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:

                async def json_request():
                    async with s.post(c.url + "/v1/completions", json={**body, "stream": False}) as r:
                        return r.status, await r.json()

                late_json = asyncio.ensure_future(json_request())
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await read_sse(resp, 2)
                    await wait_until(lambda: c.state.registry.num_open_requests == 2, what="both requests open")
                    assert await asyncio.wait_for(drain(c.state, 0.3), 10) == 2
                    rest = await read_sse(resp)
                assert rest[-1] == "[DONE]" and "grace period" in rest[-2]["error"]["message"], rest[-3:]
                status, err = await asyncio.wait_for(late_json, 10)
                assert status == 503 and "grace period" in err["error"]["message"]
            await wait_until(lambda: len(c.nodes["decode"].aborts) == 2, what="both aborted at the decode node")

    run(go())


def test_a_request_whose_body_arrives_during_the_drain_is_refused(served, tokens):
    """A request still sending its body when the drain began is refused with a 503 once it is
    read, not submitted after the grace period's failures went out, run and cancelled: a cut
    connection."""
    async def go():
        async with cluster(served, tokens) as c:
            go_on = asyncio.Event()
            body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "stream": True}).encode()

            async def slow_body():
                yield body[:10]
                await go_on.wait()
                yield body[10:]

            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                req = asyncio.ensure_future(s.post(c.url + "/v1/completions", data=slow_body(),
                                                   headers={"Content-Type": "application/json"}))
                await wait_until(lambda: c.state.handlers, what="the handler reading the body")
                drained = asyncio.ensure_future(drain(c.state, 0.2))
                await asyncio.sleep(0.4)  # the grace period is over
                go_on.set()
                async with await req as resp:
                    assert resp.status == 503 and "shutting down" in (await resp.json())["error"]["message"]
                await asyncio.wait_for(drained, 10)
            assert not c.nodes["prefill"].requests  # it never reached a node

    run(go())


def test_a_prefill_pool_holds_exactly_its_prompt(served, tokens):
    """The router asks the prefill node for the prompt's pages, not one more: a prompt filling
    an 8-page prefill pool exactly (128 tokens) is served, not refused with a 400."""
    async def go():
        async with cluster(served, tokens, node_kw={"prefill": {"pages_total": 8}}) as c:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                body = {"model": "tiny", "prompt": [5] * 128, "max_tokens": 1}
                async with s.post(c.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                async with s.post(c.url + "/v1/completions", json={**body, "prompt": [5] * 129}) as resp:
                    assert resp.status == 400 and "needs up to 9 KV pages for its prompt" in await resp.text()

    run(go())


@pytest.mark.parametrize("token_ids", [True, False])
def test_the_load_test_client_in_chat_mode_against_the_router(served, tokens, token_ids):
    """`pdtb bench serve --api chat`: prompts as one user message of text, streamed from
    /v1/chat/completions; tokens counted from token_ids or from delta.content, the prompt
    length taken from the server's usage (what the chat template made of the text)."""
    from pdtb.figures.records import RequestSpec
    from pdtb.client.load import RunConfig, run as run_client

    specs = [RequestSpec(0.01 * i, f"t{i % 2}", "c", 12 + i, 5) for i in range(4)]

    async def go():
        async with cluster(served, tokens, mode="colocated") as c:
            cfg = RunConfig(c.url, None, served.vocab_size, progress=False, sample_interval=0, api="chat",
                            return_token_ids=token_ids,
                            detokenize=lambda ids: served.tokenizer.decode(ids, skip_special_tokens=True))
            return await run_client(specs, cfg)

    res = run(go())
    for rec, spec in zip(res.records, specs):
        assert rec.status == "ok", rec.error
        assert rec.output_tokens == 5  # from token_ids, or from the usage chunk
        assert len(rec.token_times) == 5 if token_ids else 1 <= len(rec.token_times) <= 5  # one per content chunk
        assert rec.prompt_tokens != spec.prompt_len  # the template's tokens are counted: the server's figure


def test_a_reconnected_node_is_not_vouched_for_by_its_new_connection():
    """A node restarted on the same port reconnects at once; until it answers a ping the router
    holds the dead process's stats (its old KV address), so the new connection must not keep it
    healthy through a silence (the chaos test of a restart caught requests sent to the old
    address)."""
    from pdtb.router.registry import NodeState

    n = NodeState(NodeSpec("decode", "tcp://127.0.0.1:1"))
    n.last_seen, n.connected = 100.0, True
    assert n.healthy(110.0, 3.0, 30.0)  # silent over a steady connection: a long step
    n.connected, n.dropped_at = False, 101.0  # the process died
    assert not n.healthy(110.0, 3.0, 30.0)
    n.connected = True  # a new process on the same port: connected, not answered yet
    assert not n.healthy(110.0, 3.0, 30.0) and n.healthy(103.5, 3.0, 30.0) is False
    n.last_seen = 111.0  # it answered: its own stats now
    assert n.healthy(112.0, 3.0, 30.0) and n.healthy(130.0, 3.0, 30.0)


@async_test
async def test_a_node_restarted_within_the_health_timeout_fails_the_dead_processs_requests():
    """A node restarted on the same port faster than the health timeout is never seen as down,
    so the dead process's requests would wait for their timeout. Its new incarnation in
    NodeStats fails them at once."""
    import time as _time

    from pdtb.nodes.protocol import NodeStats, encode_message
    from pdtb.router.registry import NodeRegistry, RequestHandle

    reg = NodeRegistry([NodeSpec("colocated", "tcp://127.0.0.1:1")])
    (node,) = reg.nodes
    reg.node_set.on_frame(node, encode_message(NodeStats("c0", "colocated", 1, 100, 100, incarnation="aaaa")))
    handle = reg.dispatch.requests["r1"] = RequestHandle("r1", node, None)
    reg.node_set.on_frame(node, encode_message(NodeStats("c0", "colocated", 2, 100, 90, incarnation="aaaa")))
    assert handle.queue.empty()  # the same process
    reg.node_set.on_frame(node, encode_message(NodeStats("c0", "colocated", 3, 100, 100, incarnation="bbbb")))
    assert "restarted" in str(handle.queue.get_nowait())
    assert reg.is_healthy(node, _time.monotonic())  # the new process serves


def test_a_node_added_at_run_time_takes_work(served, tokens):
    """POST /admin/nodes: a colocated node that joins a running router answers its pings and
    serves requests once the first node is gone; the same address twice is 409, a bad role 400."""
    async def go():
        async with cluster(served, tokens, mode="colocated") as c:
            extra = FakeNode(FakeNodeConfig("colocated", "c1", tokens))
            addr = await extra.start()
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                    async with s.post(c.url + "/admin/nodes", json={"role": "colocated", "address": addr}) as resp:
                        assert resp.status == 200 and (await resp.json())["address"] == addr
                    async with s.post(c.url + "/admin/nodes", json={"role": "colocated", "address": addr}) as resp:
                        assert resp.status == 409
                    async with s.post(c.url + "/admin/nodes", json={"role": "router", "address": addr}) as resp:
                        assert resp.status == 400
                reg = c.state.registry
                await wait_until(lambda: len(reg.nodes) == 2 and reg.is_healthy(reg.nodes[1]), what="the new node healthy")
                await c.nodes["colocated"].close()  # the first node goes: the new one serves
                await wait_until(lambda: not reg.is_healthy(reg.nodes[0]), what="the first node down")
                await asyncio.sleep(4 * 0.5)  # health timeouts: the new node stays healthy only if pinged
                assert reg.is_healthy(reg.nodes[1]) and all(not t.done() for t in reg._tasks)
                r = await c.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                                        extra_body={"return_token_ids": True})
                assert r.choices[0].token_ids == expected_output([5, 6, 7], 3, tokens)
                status, nodes = await get(c.url + "/cluster")
                assert [n["id"] for n in nodes if n["healthy"]] == ["c1"]
                # the dead node's figures are its last answer's: marked so, and counted for no one
                assert [(n["id"], n["stale"]) for n in nodes] == [(nodes[0]["id"], True), ("c1", False)]
                from pdtb.figures.samples import cluster_sample, used_pages_series

                dead = {**nodes[0], "pages_free": 0, "extra": {"tenant_pages": {"t": 9}}}  # as if it held pages
                sample = cluster_sample(0.0, [dead, nodes[1]])
                assert sample["nodes"][0]["tenant_pages"] == {}
                live = nodes[1]["pages_total"] - nodes[1]["pages_free"]
                assert used_pages_series([sample])["colocated"][1] == [live]
                # /health waits for the dead node until a replacement retires it; a live node is not retired
                assert (await get(c.url + "/health"))[0] == 503
                third = FakeNode(FakeNodeConfig("colocated", "c2", tokens))
                addr3 = await third.start()
                try:
                    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                        for replaces, want in (("c1", 409), ("nobody", 409), (nodes[0]["id"], 200)):
                            async with s.post(c.url + "/admin/nodes", json={"role": "colocated", "address": addr3,
                                                                            "replaces": replaces}) as resp:
                                assert resp.status == want, (replaces, await resp.text())
                    await wait_until(lambda: reg.is_healthy(reg.nodes[2]), what="the replacement healthy")
                    assert (await get(c.url + "/health"))[0] == 200
                    status, nodes = await get(c.url + "/cluster")
                    assert [n["retired"] for n in nodes] == [True, False, False]
                finally:
                    await third.close()
            finally:
                await extra.close()

    run(go())
