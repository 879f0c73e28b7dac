"""Graceful shutdown and clean launches on real processes (loopback, ephemeral ports).

  - SIGTERM to a node (colocated, or the decode node of 1 prefill + 1 decode) with streams in
    flight: it stops taking requests, the in-flight ones finish (or, past --drain-timeout, fail
    with a reason), every page is free, exit code 0;
  - stop_cluster.sh with streams in flight leaves no process behind;
  - a launch that fails (bad model, a router that cannot start) exits non-zero and leaves no
    orphan process.
"""
from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
from contextlib import ExitStack
from pathlib import Path

import psutil
import pytest

from cluster_util import (ROOT, alive, colocated_with_router, disagg_with_router, get_json, launched, start_node,
                          start_router, wait_ready, wait_until)
from chaos_util import END_S, check_ended_well, procs_mentioning, prompt, http_client, stream, until

pytestmark = pytest.mark.slow


def drained_line(log: Path) -> tuple[int, int]:
    m = re.search(r"node \S+ stopped: (\d+) of (\d+) device pages free", log.read_text())
    assert m, log.read_text()[-2000:]
    return int(m.group(1)), int(m.group(2))


async def sigterm_mid_stream(node: subprocess.Popen, url: str, n: int, max_tokens: int, role: str = "colocated",
                             before: int | None = None):
    """`n` streams; SIGTERM to the node once `before` (default half) have tokens from it; then one
    more request once the router sees every `role` node draining. Returns (in-flight outcomes,
    the late request's outcome)."""
    vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
    rng, started = random.Random(1), []
    async with http_client() as s:
        tasks = [asyncio.ensure_future(stream(s, url, prompt(vocab, 24, rng), max_tokens, started=started))
                 for _ in range(n)]
        await until(lambda: len(started) >= (n // 2 if before is None else before), END_S, "streams to start")
        node.send_signal(signal.SIGTERM)

        def draining():
            return all(x["draining"] or not x["healthy"] for x in get_json(f"{url}/cluster") if x["role"] == role)

        await until(draining, 10, "the router to see the node draining")
        late = await asyncio.wait_for(stream(s, url, prompt(vocab, 24, rng), 8), END_S)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), END_S)
    return outs, late


def test_sigterm_colocated_finishes_in_flight_and_exits_0(llama_dir, tmp_path):
    with colocated_with_router(llama_dir, tmp_path / "d1", "--kv-pages", "400", "--drain-timeout", "40") \
            as (node, url, log):
        outs, late = asyncio.run(sigterm_mid_stream(node, url, 6, 300))
        assert all(o.ok and o.tokens == 300 for o in outs), outs  # drained: every stream finished
        assert late.failed_with_reason and not late.ok, late  # a draining node takes nothing new
        assert node.wait(timeout=60) == 0
        free, total = drained_line(log)
        assert free == total == 400


def test_sigterm_past_drain_timeout_fails_the_rest_with_a_reason(llama_dir, tmp_path):
    with colocated_with_router(llama_dir, tmp_path / "d2", "--kv-pages", "400", "--drain-timeout", "1") \
            as (node, url, log):
        outs, late = asyncio.run(sigterm_mid_stream(node, url, 6, 3500))
        check_ended_well(outs)
        assert late.failed_with_reason, late
        cut = [o for o in outs if not o.ok]
        assert cut and all("shut down" in o.error for o in cut), outs
        assert node.wait(timeout=60) == 0
        free, total = drained_line(log)
        assert free == total == 400


def prefill_pages_free(url: str) -> bool:
    return all(x["pages_free"] == x["pages_total"] for x in get_json(f"{url}/cluster") if x["role"] == "prefill")


def test_sigterm_decode_finishes_in_flight_and_exits_0(llama_dir, tmp_path):
    # Every stream has its second token (from the decode node) before the SIGTERM: all of them
    # are the decode node's in-flight work, and all must finish.
    with disagg_with_router(llama_dir, tmp_path / "dd1", "--kv-pages", "400", "--drain-timeout", "40") \
            as (node, url, log):
        outs, late = asyncio.run(sigterm_mid_stream(node, url, 6, 300, role="decode", before=6))
        assert all(o.ok and o.tokens == 300 for o in outs), outs
        assert late.failed_with_reason and not late.ok, late  # a draining decode node takes nothing new
        assert node.wait(timeout=60) == 0
        assert drained_line(log) == (400, 400)
        wait_until(lambda: prefill_pages_free(url), 30, what="prefill pages free")


def test_sigterm_decode_past_drain_timeout_fails_the_rest_with_a_reason(llama_dir, tmp_path):
    with disagg_with_router(llama_dir, tmp_path / "dd2", "--kv-pages", "400", "--drain-timeout", "1") \
            as (node, url, log):
        outs, late = asyncio.run(sigterm_mid_stream(node, url, 6, 3500, role="decode", before=6))
        check_ended_well(outs)
        assert late.failed_with_reason, late
        cut = [o for o in outs if not o.ok]
        assert cut and all("shut down" in o.error for o in cut), outs
        assert node.wait(timeout=60) == 0
        assert drained_line(log) == (400, 400)
        wait_until(lambda: prefill_pages_free(url), 30, what="prefill pages free")


def test_requests_parked_at_decode_outlive_their_prefill_node(llama_dir, tmp_path):
    """A request the decode node adopted into its host tier (the device tier is full) sends no
    token for a while; its prefill node then drains and exits. The request needs only the
    decode node now and must finish: the router must not count it as depending on the prefill
    node until its first decode token, and so fail it when that node stops answering."""
    run_dir = tmp_path / "pk"
    run_dir.mkdir()
    with ExitStack() as stack:
        dec = start_node(stack, "decode", llama_dir, run_dir, "--kv-pages", "240", "--host-kv-pages", "1024")
        pre = start_node(stack, "prefill", llama_dir, run_dir, "--kv-pages", "400")
        ctrls = [f"{p[2].stem}={wait_ready(*p)['ctrl']}" for p in (dec, pre)]
        url = start_router(stack, llama_dir, run_dir, ctrls)
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]

        def nodes(role):
            return [x for x in get_json(f"{url}/cluster") if x["role"] == role]

        async def go():
            rng, started = random.Random(4), []
            async with http_client() as s:
                # 238 of the 240 device pages at its peak: the next arrivals are parked in the host tier
                whale = asyncio.ensure_future(stream(s, url, prompt(vocab, 2800, rng), 1000, started=started))
                await until(lambda: started, END_S, "the long stream to start")
                shorts = [asyncio.ensure_future(stream(s, url, prompt(vocab, 1000, rng), 40)) for _ in range(3)]
                await until(lambda: nodes("decode")[0]["waiting"] == 3 and nodes("prefill")[0]["running"] == 0
                            and not nodes("prefill")[0]["extra"].get("handoffs"), END_S, "three parked at decode")
                pre[0].send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(pre[0].wait, 60) == 0
                await until(lambda: not nodes("prefill")[0]["healthy"], 15, "the router to see prefill gone")
                return await asyncio.wait_for(asyncio.gather(whale, *shorts), END_S)

        outs = asyncio.run(go())
        bad = [(o.tokens, o.error) for o, n in zip(outs, [1000, 40, 40, 40]) if not (o.ok and o.tokens == n)]
        assert not bad, bad


def test_a_dead_routers_requests_are_ended_at_the_node(llama_dir, tmp_path):
    """The router is SIGKILLed mid-stream. Its requests' events cannot be delivered, so the node
    ends them (as if aborted) and frees their pages, instead of generating for nobody until
    max_tokens or, on SIGTERM, until its drain timeout."""
    run_dir = tmp_path / "rg"
    run_dir.mkdir()
    with ExitStack() as stack:
        node, addr, log = start_node(stack, "colocated", llama_dir, run_dir, "--kv-pages", "400",
                                     "--drain-timeout", "1")
        procs: list = []
        url = start_router(stack, llama_dir, run_dir, [f"colocated={wait_ready(node, addr, log)['ctrl']}"], procs)
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]

        async def go():
            rng, started = random.Random(6), []
            async with http_client() as s:
                tasks = [asyncio.ensure_future(stream(s, url, prompt(vocab, 24, rng), 3500, started=started))
                         for _ in range(4)]
                await until(lambda: len(started) >= 4, END_S, "streams to start")
                procs[0].kill()
                await asyncio.wait_for(asyncio.gather(*tasks), END_S)  # the client sees the connection drop

        asyncio.run(go())
        wait_until(lambda: "is gone: aborted its 4 request(s)" in log.read_text(), 30, what="the node to end them")
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=60) == 0
        text = log.read_text()
        assert drained_line(log) == (400, 400) and "before the request finished" not in text, text[-2000:]


# ---- the scripts ------------------------------------------------------------------------------------
def tree(pids) -> set[int]:
    out = set(pids)
    for pid in pids:
        try:
            out |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return out


def test_stop_cluster_mid_stream_leaves_no_process(llama_dir, tmp_path):
    run_dir = tmp_path / "s1"
    with launched(run_dir, llama_dir, "--mode", "disagg", "--kv-pages", "400") as (url, _):
        pids = tree(int(p.read_text()) for p in run_dir.glob("*.pid"))
        assert len(pids) >= 3
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]

        async def go():
            rng, started = random.Random(2), []
            async with http_client() as s:
                tasks = [asyncio.ensure_future(stream(s, url, prompt(vocab, 24, rng), 200, started=started))
                         for _ in range(4)]
                # long prompts, more than the decode pool holds at once: some are still in
                # prefill, or held there by the decode node's backpressure, when the script runs
                tasks += [asyncio.ensure_future(stream(s, url, prompt(vocab, 1500, rng), 40)) for _ in range(8)]
                await until(lambda: len(started) >= 2, END_S, "streams to start")
                stop = await asyncio.create_subprocess_exec(
                    "bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--timeout", "20",
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                out, _ = await asyncio.wait_for(stop.communicate(), 90)
                outs = await asyncio.wait_for(asyncio.gather(*tasks), END_S)
                return stop.returncode, out.decode(), outs

        rc, out, outs = asyncio.run(go())
        assert rc == 0 and "did not exit" not in out, out  # SIGTERM was enough, no SIGKILL
        # Decode nodes stop only after the router and the prefill nodes: requests still in
        # prefill when the script started are handed off and finish too, none is refused.
        bad = [(o.status, o.tokens, o.error) for o, n in zip(outs, [200] * 4 + [40] * 8) if not (o.ok and o.tokens == n)]
        assert not bad, bad
        for log in run_dir.glob("*-0.log"):
            if not log.name.startswith("router"):
                free, total = drained_line(log)
                assert free == total, log.name
        assert not list(run_dir.glob("*.pid"))
        assert not [p for p in pids if alive(p)], f"left behind: {[p for p in pids if alive(p)]}"
        assert not procs_mentioning(str(run_dir))


def run_launch(run_dir: Path, model: str, *args: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(ROOT / "scripts/launch_cluster.sh"), "--run-dir", str(run_dir), "--model", model,
           "--port", "0", "--timeout", "120", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    finally:  # whatever happened, nothing of this cluster may outlive the test
        subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--timeout", "10"],
                       capture_output=True, timeout=60)


def test_failed_launch_bad_model_exits_nonzero_no_orphans(tmp_path):
    model = str(tmp_path / "nonexistent-model")
    r = run_launch(tmp_path / "f1", model, "--mode", "disagg", "--prefill", "1", "--decode", "2")
    assert r.returncode != 0
    assert "exited during start-up" in r.stderr, r.stderr[-2000:]
    assert not procs_mentioning(model), "a node of the failed launch is still running"
    assert not procs_mentioning(str(tmp_path / "f1"))


def test_failed_launch_router_cannot_start_stops_the_nodes(llama_dir, tmp_path):
    before = procs_mentioning(llama_dir)
    r = run_launch(tmp_path / "f2", llama_dir, "--mode", "disagg", "--router-args", "--no-such-flag")
    assert r.returncode != 0
    assert "router exited during start-up" in r.stderr, r.stderr[-2000:]
    left = procs_mentioning(llama_dir) - before
    assert not left, f"nodes of the failed launch still running: {left}"
    assert not procs_mentioning(str(tmp_path / "f2"))
