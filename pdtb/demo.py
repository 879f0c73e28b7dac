"""`pdtb demo --url URL`: send a few streaming completions, print their text and latency."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

PROMPTS = [
    "In a shared inference pool",
    "Prefill runs the prompt once and writes keys and values into pages of a pool.",
    "Tenants share the pool",
    "The quick brown fox jumps over the lazy dog.",
]


async def _one(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, text, n = None, "", 0
    async with http.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"prompt": prompt, "error": f"HTTP {r.status}: {await r.text()}"}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"prompt": prompt, "error": chunk["error"]["message"]}
            for c in chunk.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += c.get("text", "")
                n += 1
    return {"prompt": prompt, "text": text, "ttft_ms": 1000 * (ttft or 0), "e2e_ms": 1000 * (time.perf_counter() - t0),
            "chunks": n}


async def _run(url: str, max_tokens: int) -> int:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        results = await asyncio.gather(*(_one(s, url, model, p, max_tokens) for p in PROMPTS))
    failed = 0
    for r in results:
        if "error" in r:
            failed += 1
            print(f"--- {r['prompt']!r}\n    ERROR {r['error']}")
        else:
            print(f"--- {r['prompt']!r}\n    {r['text']!r}\n    TTFT {r['ttft_ms']:.1f} ms, E2E {r['e2e_ms']:.1f} ms")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb demo", description=__doc__)
    ap.add_argument("--url", required=True)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args(argv)
    return asyncio.run(_run(a.url.rstrip("/"), a.max_tokens))
