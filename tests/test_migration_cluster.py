"""Live migration between decode nodes on real clusters (1 prefill + 2 or 3 decode processes, the
tiny model, ZeroMQ KV transport on loopback): moved requests keep generate's tokens, every
injected fault leaves each request on one node (or recomputed), and no page is left held."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import urllib.error
import urllib.request

import pytest

from cluster_util import ROOT, get_json, launched, wait_until
from conftest import hf_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
# The decode nodes' KV read is capped (a token bucket per tenant), so every stream decodes for
# seconds and is still there to be moved whatever the machine's speed.
SLOW_DECODE = ("--decode-args", "--tenant-bw-cap 3e6 --migration-timeout 3", "--router-args", "--allow-fault-injection")


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def decoding_on(url: str) -> dict[str, list[str]]:
    """Decode node id -> the router's ids of the requests decoding there (largest first)."""
    return {n["id"]: [r[0] for r in n["extra"].get("requests", [])]
            for n in get_json(f"{url}/cluster") if n["role"] == "decode" and n["healthy"]}


def prompts_for(url: str, n: int, seed: int) -> list[list[int]]:
    vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(rng.choice((36, 52, 70)))] for _ in range(n)]


def run_streams(url: str, prompts: list[list[int]], during) -> list:
    """Stream every prompt (greedy, MAX_TOKENS); `during()` runs in a thread once half have started."""
    from chaos_util import http_client, stream, until

    async def go():
        started: list = []
        async with http_client() as s:
            tasks = [asyncio.ensure_future(stream(s, url, p, MAX_TOKENS, started=started)) for p in prompts]
            await until(lambda: len(started) >= len(prompts) // 2, 60, "streams to start")
            await asyncio.to_thread(during)
            return await asyncio.wait_for(asyncio.gather(*tasks), 180)

    return asyncio.run(go())


def migrate_one(url: str, candidates: list[str], to: str, inject: str) -> dict:
    """Move one of `candidates` still decoding (a listed one may have finished since), the
    smallest first: the youngest, the furthest from its end."""
    why = []
    for rid in reversed(candidates):
        status, body = post(f"{url}/admin/migrate", {"request_id": rid, "to": to, "inject": inject})
        if status == 202:
            return body
        assert status == 409, body
        why.append(body["error"]["message"])
    raise AssertionError(f"none of {candidates} could be moved to {to}: {why}")


def migrations(url: str) -> dict:
    return get_json(f"{url}/cluster/migrations")


def settled(url: str) -> bool:
    m = migrations(url)
    return not m["in_flight"]


def test_live_migration_keeps_generate_tokens_and_each_fault_leaves_one_holder(llama_dir, hf_models, tmp_path):
    """Requests moved both ways under load finish with generate's tokens; lose_precopy, lose_final
    and refuse_final each leave the request at its source, which finishes it; then one decode
    node is stopped (stop_cluster.sh --node: SIGTERM) and its requests move to the other one.
    Pages all free."""
    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  "--kv-pages", "800", *SLOW_DECODE) as (url, run_dir):
        prompts = prompts_for(url, 12, seed=11)
        asked: dict[str, str] = {}  # migration id -> inject ("" for a plain move)
        drained = {"had": 0}  # requests decoding on the stopped node when it got its SIGTERM

        def move_some():
            wait_until(lambda: sum(map(len, decoding_on(url).values())) >= 6, 60, what="requests decoding")
            on = decoding_on(url)
            ids = sorted(on)
            faults = ["lose_precopy", "lose_final", "refuse_final"]
            for src, dst in ((ids[0], ids[1]), (ids[1], ids[0])):
                for i, rid in enumerate(on[src][:5]):
                    inject = faults.pop() if faults and i % 2 else ""
                    status, body = post(f"{url}/admin/migrate", {"request_id": rid, "to": dst, "inject": inject})
                    if status == 202:
                        asked[body["migration_id"]] = inject
            status, body = post(f"{url}/admin/migrate", {"request_id": "no-such", "to": ids[1]})
            assert status == 409 and "not decoding" in body["error"]["message"]
            status, body = post(f"{url}/admin/migrate", {"request_id": "no-such", "to": ids[1], "inject": "x"})
            assert status == 400
            wait_until(lambda: settled(url), 30, what="the moves to end")
            drained["had"] = len(decoding_on(url).get(ids[1], []))
            r = subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--node",
                                ids[1], "--timeout", "60"], capture_output=True, text=True, timeout=90)
            assert r.returncode == 0 and "did not exit" not in r.stderr, r.stderr

        outs = run_streams(url, prompts, move_some)
        assert all(o.ok for o in outs), [o for o in outs if not o.ok][:3]
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf_models["llama"], p, MAX_TOKENS, ignore_eos=True)
        wait_until(lambda: settled(url), 30, what="migrations to end")
        done = {m["migration_id"]: m for m in migrations(url)["done"]}
        plain = [done[i] for i, inj in asked.items() if not inj and i in done]
        moved = [m for m in plain if m["state"] == "done"]
        # a request that finished before its move began, or during it, stays where it was, with the reason
        assert len(moved) >= 2 and all(m in moved or "not on this node" in m["outcome"] or "ended during" in m["outcome"]
                                       for m in plain), [(m["state"], m["phase"], m["outcome"]) for m in plain]
        # (the drain below may move a request on before its first step here: it reports no pause)
        redrained = {m["request_id"] for m in migrations(url)["done"] if m["reason"] == "drain"}
        assert all(m["final_bytes"] > 0 and (m["downtime_s"] or m["request_id"] in redrained) for m in moved), \
            [(m["precopy_bytes"], m["final_bytes"], m["downtime_s"]) for m in moved]
        assert sum(m["precopy_bytes"] > 0 for m in moved) >= 1  # (a request under two full pages has none)
        for mid, inj in asked.items():
            if inj:
                m = done[mid]
                assert m["state"] == "failed" and m["outcome"], m
        drains = [m for m in migrations(url)["done"] if m["reason"] == "drain"]
        if drained["had"] >= 3:  # (streams decode for seconds: the router moves them within one)
            assert any(m["state"] == "done" for m in drains), drains
        wait_until(lambda: all(n["pages_free"] == n["pages_total"] for n in get_json(f"{url}/cluster") if n["healthy"]),
                   30, what="every page free")
        for n in get_json(f"{url}/cluster"):
            if n["role"] == "decode" and n["healthy"]:
                assert n["extra"]["migrations_staged"] == 0 and n["extra"]["migrations_out"] == 0


def test_a_node_dying_mid_migration_leaves_each_request_finished(llama_dir, hf_models, tmp_path):
    """The target exits at the final header (its source resumes the request), then a source exits
    right after sending the final transfer (the target adopts it, or the router recomputes it):
    every stream finishes with generate's tokens and the survivor's pages are all free."""
    import os

    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "3",
                  "--kv-pages", "800", *SLOW_DECODE) as (url, run_dir):
        prompts = prompts_for(url, 9, seed=12)

        def kill_two():
            wait_until(lambda: sum(map(len, decoding_on(url).values())) >= 6, 60, what="requests decoding")
            on = decoding_on(url)
            d0, d1, d2 = sorted(on)
            migrate_one(url, on[d0] + on[d1], d2, "target_exits")
            wait_until(lambda: d2 not in decoding_on(url), 30, what=f"{d2} to be gone")
            wait_until(lambda: settled(url), 30, what="the first migration to end")
            migrate_one(url, decoding_on(url)[d1], d0, "exit_after_final")
            wait_until(lambda: d1 not in decoding_on(url), 30, what=f"{d1} to be gone")

        outs = run_streams(url, prompts, kill_two)
        assert all(o.ok for o in outs), [o for o in outs if not o.ok][:3]
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf_models["llama"], p, MAX_TOKENS, ignore_eos=True)
        wait_until(lambda: all(n["pages_free"] == n["pages_total"] for n in get_json(f"{url}/cluster") if n["healthy"]),
                   30, what="the survivors' pages free")
        assert os.path.isdir(run_dir)
