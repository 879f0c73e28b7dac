"""`pdtb chaos --router-drill N`: streams in flight, the router killed; seconds until every node
is empty and until the router is back; its completions against generate.

The router-kill drill (`pdtb chaos --router-drill N`): N greedy streams in flight, the router
killed (SIGKILL), then how long until every node holds no page (read from the nodes' own /stats:
the router is gone), how long the supervisor takes to bring the router back, and whether the
restarted router's completions equal transformers.generate's."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import time
import urllib.error

from pdtb.chaos.checker import holds_nothing, reference
from pdtb.chaos.inject import cluster_pid, http_json
from pdtb.chaos.load import Load, prompt_pool

PROBES = 4  # completions compared with generate after the restart
BOUND_S = 120.0  # every wait below ends within this
ZERO_PAGES_S = 10.0  # the nodes hold no page this soon after the router's death (or it is a violation)


def node_stats(run_dir: pathlib.Path) -> list[dict]:
    """Each live node's own /stats, by the metrics address of its last READY line."""
    from pdtb.local_cluster.supervise import node_ready

    out = []
    for pid_file in run_dir.glob("*-*.pid"):
        name = pid_file.stem
        if name.startswith("router"):
            continue
        logs = sorted([run_dir / f"{name}.log", *run_dir.glob(f"{name}~*.log")], key=lambda p: p.stat().st_mtime)
        ready = node_ready(logs[-1]) if logs else None
        if ready:
            try:
                out.append(http_json(ready["metrics"] + "/stats", timeout=5))
            except (OSError, ValueError):
                pass
    return out


def until(pred, what: str) -> None:
    t = time.monotonic()
    while not pred():
        if time.monotonic() - t > BOUND_S:
            raise RuntimeError(f"{what}: not within {BOUND_S:.0f} s")
        time.sleep(0.05)


def router_restarts(run_dir: pathlib.Path) -> int:
    """How many times the supervisor has restarted the router so far."""
    path = run_dir / "supervisor.jsonl"
    entries = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    return sum(e["name"] == "router-0" and e["event"] == "restarted" for e in entries)


def drill(url: str, run_dir: pathlib.Path, streams: int, seed: int, model: str) -> dict:

    vocab = http_json(f"{url}/v1/models")["data"][0]["vocab_size"]
    prompts = prompt_pool(seed, vocab, streams + PROBES, (16, 64))
    restarts = router_restarts(run_dir)

    async def kill_under_streams() -> tuple[Load, float]:
        load = Load(url, prompts[:streams], seed=seed, tenants=streams, workers=1, max_tokens=(400, 400),
                    t0=time.monotonic())
        task = asyncio.create_task(load.run())
        while len([r for r in load.requests if r.token_ids]) < streams:  # every stream has tokens
            if time.monotonic() - load.t0 > BOUND_S:
                raise RuntimeError("the streams did not start")
            await asyncio.sleep(0.05)
        load.stop.set()
        try:
            pid = cluster_pid(run_dir, "router-0")
        except ProcessLookupError as e:
            raise RuntimeError(str(e)) from None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.wait_for(task, BOUND_S)
        return load, killed

    load, killed = asyncio.run(kill_under_streams())
    until(lambda: holds_nothing(node_stats(run_dir)), "every node free")
    to_zero = time.monotonic() - killed
    until(lambda: router_restarts(run_dir) > restarts, "the supervisor to restart the router")
    back = time.monotonic() - killed

    def healthy() -> bool:
        try:
            return http_json(f"{url}/health", timeout=5).get("status") == "ok"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    until(healthy, "the restarted router healthy")
    probes = prompts[streams:]
    got = [http_json(f"{url}/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                                 "return_token_ids": True})["choices"][0]["token_ids"] for p in probes]
    want = reference(model, probes, 24)
    cut = [r for r in load.requests if r.exc and not r.done]
    violations = []
    if to_zero > ZERO_PAGES_S:
        violations.append(f"pages held {to_zero:.1f} s after the kill (bound {ZERO_PAGES_S:g} s)")
    if got != want:
        violations.append("the restarted router's completions differ from generate's")
    return {"violations": violations, "streams": streams, "cut_at_client": len(cut),
            "completed_anyway": sum(r.done for r in load.requests), "seconds_to_zero_pages": round(to_zero, 2),
            "seconds_to_router_back": round(back, 2), "probes_identical_to_generate": got == want,
            "probes": len(probes)}
