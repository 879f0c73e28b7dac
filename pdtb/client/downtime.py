"""`pdtb bench migration`: live migration downtime under load, against the same run's ITL.

    pdtb bench migration --url URL [--streams 16] [--prompt 512] [--max-tokens 128]
                         [--moves 12] [--every 0.25] [--out FILE] [--label NAME]

Starts `--streams` greedy streams through the router at URL (a cluster with two or more decode
nodes), and once they decode, moves `--moves` of them, one every `--every` seconds, each to
another decode node (POST /admin/migrate). When every stream has ended it reads
/cluster/migrations and prints, for the moves that completed:

    downtime      the pause each migrated request saw (the source's last step to the target's
                  first token, measured by the nodes): p50, p99, max
    gap           the longest gap between two tokens of each migrated stream, at the client
    itl           the inter-token gaps of the streams never moved (the baseline)
    precopy/final bytes moved and seconds taken by each phase (the final transfer is part of the
                  downtime; the precopy runs while the request decodes on)

and the ratio downtime p50 / ITL p50. With `--out` the figures and every
migration's record go to a JSON file. Streams that fail are counted and printed, never dropped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp

from pdtb.client.sse import SSEParser, count_tokens, error_message
from pdtb.figures.summary import pct


async def _get(http: aiohttp.ClientSession, url: str):
    async with http.get(url) as r:
        r.raise_for_status()
        return await r.json()


async def _stream(http, url: str, prompt: list[int], max_tokens: int, times: list[float], started: asyncio.Event,
                  ids: list[str]):
    """One greedy stream; appends each token's arrival time to `times` and its request id (the
    router's, as /cluster lists it) to `ids`. Returns an error or None."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}: {(await resp.text())[:200]}"
        parser, err = SSEParser(), None
        async for chunk in resp.content.iter_any():
            for data in parser.feed(chunk):
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                err = err or error_message(obj)
                if not ids and isinstance(obj.get("id"), str):
                    ids.append(obj["id"])
                now = time.monotonic()
                times.extend([now] * count_tokens(obj))
                if len(times) >= 2:
                    started.set()
        return err if err or len(times) == max_tokens else f"{len(times)} of {max_tokens} tokens"


async def _mover(http, url: str, moves: int, every: float, asked: list[str], failed: list[str], rng: random.Random):
    """Move `moves` requests, one every `every` s, each from the node holding it to another one."""
    moved: set[str] = set()
    while len(asked) + len(failed) < moves:
        await asyncio.sleep(every)
        nodes = [n for n in await _get(http, f"{url}/cluster") if n["role"] == "decode" and n["healthy"]
                 and not n["draining"]]
        cands = [(r[0], n["id"]) for n in nodes for r in n["extra"].get("requests", []) if r[0] not in moved]
        if len(nodes) < 2 or not cands:
            continue  # (stats lag the hand-offs; the caller stops this once every stream ended)
        rid, src = rng.choice(cands)
        dst = rng.choice([n["id"] for n in nodes if n["id"] != src])
        moved.add(rid)
        async with http.post(f"{url}/admin/migrate", json={"request_id": rid, "to": dst}) as r:
            body = await r.json()
            (asked.append(body["migration_id"]) if r.status == 202 else failed.append(body["error"]["message"]))


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


async def run(url: str, streams: int, prompt_len: int, max_tokens: int, moves: int, every: float, seed: int) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        vocab = (await _get(http, f"{url}/v1/models"))["data"][0]["vocab_size"]
        prompts = [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(streams)]
        times: list[list[float]] = [[] for _ in prompts]
        ids: list[list[str]] = [[] for _ in prompts]
        started = asyncio.Event()
        tasks = [asyncio.ensure_future(_stream(http, url, p, max_tokens, t, started, i))
                 for p, t, i in zip(prompts, times, ids)]
        await asyncio.wait_for(started.wait(), 600)
        asked, refused = [], []
        mover = asyncio.ensure_future(_mover(http, url, moves, every, asked, refused, rng))
        errors = [e for e in await asyncio.gather(*tasks, return_exceptions=True) if e is not None]
        mover.cancel()
        await asyncio.gather(mover, return_exceptions=True)
        book = None
        for _ in range(100):  # the last reports may still be on their way: bounded
            book = await _get(http, f"{url}/cluster/migrations")
            if not any(m["migration_id"] in asked for m in book["in_flight"]):
                break
            await asyncio.sleep(0.1)
    ours = [m for m in book["done"] if m["migration_id"] in asked]
    done = [m for m in ours if m["state"] == "done"]
    downtime = [m["downtime_s"] for m in done if m["downtime_s"] is not None]
    # a migrated stream's longest gap is its pause as the client saw it; the streams never moved
    # are the baseline
    moved = {m["request_id"] for m in done}
    by_id = {i[0]: t for i, t in zip(ids, times) if i}
    longest = [max(_gaps(by_id[r]), default=0.0) for r in moved if r in by_id]
    itl = pct([g for i, t in zip(ids, times) if not i or i[0] not in moved for g in _gaps(t)])
    out = {"url": url, "streams": streams, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
           "moves_asked": len(asked), "moves_refused": len(refused), "moves_done": len(done),
           "moves_failed": [m["outcome"] for m in ours if m["state"] != "done"], "stream_errors": [str(e) for e in errors],
           "downtime_s": pct(downtime), "client_gap_s": pct(longest), "itl_s": itl,
           "precopy_bytes": pct([m["precopy_bytes"] for m in done]), "final_bytes": pct([m["final_bytes"] for m in done]),
           "precopy_s": pct([m["precopy_s"] for m in done]), "final_s": pct([m["final_s"] for m in done]),
           "pages": pct([m["pages"] for m in done]), "migrations": ours}
    d50, i50 = out["downtime_s"]["p50"], itl["p50"]
    out["downtime_p50_over_itl_p50"] = d50 / i50 if d50 is not None and i50 else None
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def render(r: dict) -> str:
    d, g, i = r["downtime_s"], r["client_gap_s"], r["itl_s"]
    lines = [f"migrations: {r['moves_done']} done of {r['moves_asked']} started ({r['moves_refused']} refused at the "
             f"router, {len(r['moves_failed'])} failed); {len(r['stream_errors'])} stream errors",
             f"downtime ms     p50 {_ms(d['p50'])}  p99 {_ms(d['p99'])}  max {_ms(d['max'])}",
             f"client gap ms   p50 {_ms(g['p50'])}  p99 {_ms(g['p99'])}  (each moved stream's longest gap)",
             f"ITL ms          p50 {_ms(i['p50'])}  p99 {_ms(i['p99'])}  (the streams never moved: the baseline)"]
    pb, fb, ps, fs = r["precopy_bytes"], r["final_bytes"], r["precopy_s"], r["final_s"]
    if pb["p50"] is not None:
        lines.append(f"precopy         {pb['p50'] / 1e6:.3f} MB in {_ms(ps['p50'])} ms (p50); final "
                     f"{fb['p50'] / 1e6:.3f} MB in {_ms(fs['p50'])} ms (p50)")
    ratio = r["downtime_p50_over_itl_p50"]
    if ratio is not None:
        lines.append(f"downtime p50 / ITL p50 = {ratio:.2f}x")
    for why in r["moves_failed"][:5]:
        lines.append(f"  failed: {why}")
    for e in r["stream_errors"][:5]:
        lines.append(f"  stream error: {e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb bench migration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="router URL (a cluster with two or more decode nodes)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per stream")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--moves", type=int, default=12, help="requests to move, each once")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between two moves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="write the figures and the migrations' records here (JSON)")
    a = ap.parse_args(argv)
    if min(a.streams, a.prompt, a.max_tokens, a.moves) < 1 or a.every <= 0:
        ap.error("--streams, --prompt, --max-tokens and --moves must be positive, --every above 0")
    r = asyncio.run(run(a.url.rstrip("/"), a.streams, a.prompt, a.max_tokens, a.moves, a.every, a.seed))
    r["label"] = a.label
    print(render(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if r["moves_done"] and not r["stream_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
