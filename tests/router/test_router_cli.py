"""`python -m pdtb.router.main` as a process: start-up line, serving, and SIGTERM with in-flight requests."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import aiohttp

from pdtb.router.fake_node import FakeNode, FakeNodeConfig

TOKENS = list(range(10, 60))


async def start_router(model_dir: str, node: FakeNode, *extra: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdtb.router.main", "--model", model_dir, "--node", f"colocated={node.address}",
        "--port", "0", "--served-model-name", "tiny", "--log-level", "warning", *extra,
        stdout=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert line.startswith("router listening on http://127.0.0.1:"), line
    return proc, line.split()[-1]


async def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 10
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while True:
            async with s.get(url + "/health") as r:
                if r.status == 200:
                    return
            assert time.monotonic() < deadline, "router never became healthy"
            await asyncio.sleep(0.05)


async def stream_text(http: aiohttp.ClientSession, url: str, max_tokens: int) -> list[str]:
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": max_tokens, "stream": True}
    lines = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: "):
                lines.append(line[6:].strip().decode())
    return lines


async def sigterm_scenario(model_dir: str):
    """Two streams in flight at SIGTERM: a short one that ends within the 1.5 s grace, a long one
    that does not (it fails with an error event and is aborted at the node)."""
    node = FakeNode(FakeNodeConfig("colocated", "c0", TOKENS, delay=0.2))
    await node.start()
    proc = None
    try:
        proc, url = await start_router(model_dir, node, "--shutdown-timeout", "1.5")
        await wait_healthy(url)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            short = asyncio.create_task(stream_text(s, url, 6))
            long = asyncio.create_task(stream_text(s, url, 300))
            await asyncio.wait_for(_until(lambda: len(node.requests) == 2), 5)
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(short, long, return_exceptions=True), 15)
        rc = await asyncio.wait_for(proc.wait(), 15)
        return rc, results, node
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await node.close()


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


def test_sigterm_finishes_short_requests_and_aborts_the_rest(llama_dir):
    rc, (short, long), node = asyncio.run(sigterm_scenario(llama_dir))
    assert rc == 0
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    # the long one outlived the grace period: it gets a readable 503 error event, then [DONE]
    assert long[-1] == "[DONE]" and "grace period" in json.loads(long[-2])["error"]["message"], long[-3:]
    long_id = max(node.requests, key=lambda r: r.params.max_tokens).request_id
    assert [a.request_id for a in node.aborts] == [long_id]


def test_bad_flags_exit_2(llama_dir):
    from pdtb.router.main import main

    assert main(["--model", llama_dir, "--node", "gpu=tcp://127.0.0.1:1"]) == 2
    assert main(["--model", llama_dir, "--node", "prefill=tcp://127.0.0.1:1"]) == 2  # no decode node
