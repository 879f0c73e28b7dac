"""`usage.prompt_tokens_details.cached_tokens` end to end: real nodes (a colocated one, or one
prefill and one decode node over the ZeroMQ KV transport) and the real router, all in this
process on ephemeral loopback ports, driven by the openai client.

The same prompt of several full pages, sent twice: the first time nothing is cached (0); the
second time its prefill starts from every full page but the one holding its last token, which a
prefill always computes (docs/architecture.md, prefix cache), so the figure is worked out here
from the prompt's length and the page size, not read from the node.
"""
from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest

from conftest import make_prompts
from pdtb.engine.config import EngineConfig
from pdtb.nodes.node_base import NodeConfig
from pdtb.router.completions import STATE
from pdtb.router.config import NodeSpec, RouterConfig
from pdtb.router.main import start_router
from tests.async_case import async_test
from tests.router.test_router_integration import served, wait_until  # noqa: F401 (fixture)

PAGE = 16
PROMPT_LEN = 4 * PAGE + 6  # four full pages and part of a fifth
NUM_PAGES = 64
STOP_S = 10.0  # a node's run() ends within this once told to stop


def expected_hit(prompt_len: int, page: int = PAGE) -> int:
    """Tokens of a fully cached prompt a prefill takes from the cache: its full pages, less the
    one holding its last token."""
    return (prompt_len - 1) // page * page


def make_nodes(model_dir: str, mode: str) -> list:
    from decode_node.node import DecodeNode
    from pdtb.colocated.node import ColocatedNode
    from prefill_node.node import PrefillNode

    def cfg(role: str, node_id: str) -> NodeConfig:
        return NodeConfig(role, node_id, EngineConfig(model_dir, page_size=PAGE, num_pages=NUM_PAGES),
                          check_pages=True)

    if mode == "colocated":
        return [ColocatedNode(cfg("colocated", "c0"))]
    return [PrefillNode(cfg("prefill", "p0")), DecodeNode(cfg("decode", "d0"))]


@contextlib.asynccontextmanager
async def in_process_cluster(model_dir: str, served, mode: str):
    """The nodes' own run loops and a router, in this event loop; yields an openai client.
    Everything is stopped on the way out."""
    nodes = make_nodes(model_dir, mode)
    ready: dict[str, dict] = {}
    tasks = [asyncio.create_task(n.run(on_ready=lambda a: ready.__setitem__(a["id"], a))) for n in nodes]
    runner = None
    try:
        await wait_until(lambda: len(ready) == len(nodes) or any(t.done() for t in tasks), 60, "nodes ready")
        for t in tasks:
            if t.done():
                t.result()  # (a node that failed to start raises here)
        specs = tuple(NodeSpec(n.config.role, ready[n.config.node_id]["ctrl"]) for n in nodes)
        runner, url = await start_router(RouterConfig(specs, port=0, ping_interval=0.05), served)
        registry = runner.app[STATE].registry
        await wait_until(lambda: all(registry.is_healthy(n) for n in registry.nodes), 10, "nodes healthy")
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
            yield client
        # every request ended: every page free or cached (a prefill node lets go once its
        # transfer's end is polled, which may come after the client's last byte)
        await wait_until(lambda: all(n.engine.pool.num_free == n.engine.pool.num_pages for n in nodes), 10,
                         "every page free")
    finally:
        if runner is not None:
            await asyncio.wait_for(runner.cleanup(), 10)
        for n in nodes:
            n.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), STOP_S)


async def cached_tokens(client, prompt, stream: bool) -> int:
    """One request's usage.prompt_tokens_details.cached_tokens; checks the rest of usage too."""
    kw = dict(model="tiny", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = [ch async for ch in await client.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw)]
        assert [ch.usage for ch in chunks[:-1]] == [None] * (len(chunks) - 1)
        usage = chunks[-1].usage
    else:
        usage = (await client.completions.create(prompt=prompt, **kw)).usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 3)
    return usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
@async_test(timeout=120)
async def test_a_repeated_prompt_reports_its_cached_pages_in_usage(llama_dir, served, mode):
    first, second = make_prompts([PROMPT_LEN, PROMPT_LEN], seed=11)
    hit = expected_hit(PROMPT_LEN)
    assert 0 < hit < PROMPT_LEN and hit % PAGE == 0
    async with in_process_cluster(llama_dir, served, mode) as client:
        for prompt, stream in ((first, False), (second, True)):
            assert await cached_tokens(client, prompt, stream) == 0
            assert await cached_tokens(client, prompt, stream) == hit
        # a chat conversation: its rendered prompt is cached the same way (its length from usage)
        messages = [{"role": "user", "content": " ".join(["pages"] * 3 * PAGE)}]
        replies = [await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                                         temperature=0) for _ in range(2)]
        n = replies[0].usage.prompt_tokens
        assert n > 2 * PAGE
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, expected_hit(n)]
