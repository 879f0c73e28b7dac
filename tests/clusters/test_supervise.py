"""A local cluster under `launch_cluster.sh --restart-failed` (real processes, IPv6 loopback): the
router killed under 32 streams (the nodes free every page without it; the supervisor restarts
it on its port and it serves completions equal to transformers.generate), a decode node killed
(restarted under a new node id and added to the router), and a node stopped on purpose left
stopped."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import urllib.request

import pytest

from chaos_util import END_S, http_client, prompt, stream, until
from cluster_util import ROOT, alive, get_json, kill9, launched, router_healthy, vocab_of, wait_until
from conftest import hf_greedy

pytestmark = pytest.mark.slow
FREE_S = 30.0  # the bound the test allows; the nodes' own is their router lease (10 s) or the first lost event batch


def events(run_dir, name: str, event: str) -> list[dict]:
    path = run_dir / "supervisor.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["name"] == name and e["event"] == event]


def node_stats(run_dir) -> list[dict]:
    """Every live node's own /stats (the router may be down), newest incarnation of each."""
    out = []
    for pid_file in run_dir.glob("*-*.pid"):
        if pid_file.stem.startswith("router") or not alive(int(pid_file.read_text())):
            continue
        logs = sorted(run_dir.glob(f"{pid_file.stem}*.log"), key=lambda p: p.stat().st_mtime)
        line = [ln for ln in logs[-1].read_text().splitlines() if ln.startswith("NODE READY ")][-1]
        out.append(get_json(json.loads(line[len("NODE READY "):])["metrics"] + "/stats"))
    return out


def nodes_empty(run_dir) -> bool:
    stats = node_stats(run_dir)
    return bool(stats) and all(s["pages_free"] == s["pages_total"] and s["running"] == 0 and s["waiting"] == 0
                               for s in stats)


def completions(url: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                                      "return_token_ids": True}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append(json.loads(r.read())["choices"][0]["token_ids"])
    return out


@pytest.fixture(scope="module")
def supervised(llama_dir, tmp_path_factory):
    """1P+2D on the IPv6 loopback (--host ::1: every socket there, addresses in brackets)."""
    with launched(tmp_path_factory.mktemp("sup"), llama_dir, "--mode", "disagg", "--prefill", "1", "--decode", "2",
                  "--kv-pages", "600", "--restart-failed", "--host", "::1") as (url, rd):
        assert url.startswith("http://[::1]:")
        addrs = json.loads([ln for ln in (rd / "decode-0.log").read_text().splitlines()
                            if ln.startswith("NODE READY ")][0][len("NODE READY "):])
        assert addrs["ctrl"].startswith("tcp://[::1]:") and addrs["kv"].startswith("tcp://[::1]:")
        assert addrs["metrics"].startswith("http://[::1]:")
        yield url, rd
    assert not (rd / "supervisor.pid").exists()  # stopped with the rest


def test_router_killed_under_streams_nodes_free_everything_and_the_restarted_router_serves(supervised, hf_models):
    url, run_dir = supervised
    vocab = vocab_of(url)
    rng = random.Random(5)
    probes = [prompt(vocab, 20, rng) for _ in range(3)]
    want = [hf_greedy(hf_models["llama"], p, 16, ignore_eos=True) for p in probes]
    assert completions(url, probes, 16) == want  # before the kill

    async def kill_under_streams():
        started: list = []
        async with http_client() as s:
            streams = [asyncio.ensure_future(stream(s, url, prompt(vocab, 24, rng), 600, started=started))
                       for _ in range(32)]
            await until(lambda: len(started) >= 32, END_S, "32 streams to start")
            await asyncio.to_thread(kill9, run_dir, "router-0")
            return await asyncio.wait_for(asyncio.gather(*streams), END_S)

    outs = asyncio.run(kill_under_streams())
    # every stream open at the crash ends at the client with a connection error, none completes
    assert all(o.exc and not o.done for o in outs), [o for o in outs if not o.exc][:3]
    wait_until(lambda: nodes_empty(run_dir), FREE_S, what="every node to free its pages without the router")

    wait_until(lambda: events(run_dir, "router-0", "restarted"), 120, what="the supervisor to restart the router")
    assert get_json(f"{url}/v1/models")  # on the same port
    wait_until(lambda: router_healthy(url), 60, what="the restarted router to see its nodes")
    assert completions(url, probes, 16) == want
    wait_until(lambda: nodes_empty(run_dir), FREE_S, what="pages free after the restarted router's requests")


def test_a_killed_node_is_restarted_and_added_and_a_stopped_one_stays_stopped(supervised):
    url, run_dir = supervised
    old = kill9(run_dir, "decode-1")
    wait_until(lambda: events(run_dir, "decode-1", "restarted"), 120, what="decode-1 restarted")
    pid = int((run_dir / "decode-1.pid").read_text())
    assert pid != old and alive(pid)
    wait_until(lambda: any(n["id"] == "decode-1~1" and n["healthy"] for n in get_json(f"{url}/cluster")), 30,
               what="the router to list decode-1~1 healthy")
    wait_until(lambda: router_healthy(url), 30, what="/health 200: the dead incarnation retired")
    assert [n["retired"] for n in get_json(f"{url}/cluster") if n["id"] == "decode-1"] == [True]
    vocab = vocab_of(url)
    rng = random.Random(9)
    for _ in range(6):  # (the router spreads decode work: some lands on the replacement)
        assert len(completions(url, [prompt(vocab, 20, rng)], 8)[0]) == 8

    r = subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "--run-dir", str(run_dir), "--node", "decode-0",
                        "--timeout", "20"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: events(run_dir, "decode-0", "stopped"), 30, what="the supervisor to see decode-0 stopped")
    assert not events(run_dir, "decode-0", "restarted")

