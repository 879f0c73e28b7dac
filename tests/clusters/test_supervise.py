"""A local cluster under `launch_cluster.sh --restart-failed` (real processes, IPv6 loopback): the
router killed under 32 streams (the nodes free every page without it; the supervisor restarts
it on its port and it serves completions equal to transformers.generate), a decode node killed
(restarted under a new node id and added to the router), and a node stopped on purpose left
stopped."""
from __future__ import annotations

import json
import random
import subprocess
import urllib.request

import pytest

from chaos_util import prompt
from pdtb.chaos.checker import holds_nothing
from pdtb.chaos.drill import node_stats
from cluster_util import ROOT, alive, get_json, kill9, launched, router_healthy, vocab_of, wait_until

pytestmark = pytest.mark.slow
FREE_S = 30.0  # the bound the test allows; the nodes' own is their router lease (10 s) or the first lost event batch


def events(run_dir, name: str, event: str) -> list[dict]:
    path = run_dir / "supervisor.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["name"] == name and e["event"] == event]


def nodes_empty(run_dir) -> bool:
    return holds_nothing(node_stats(run_dir))


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


def test_router_killed_under_streams_nodes_free_everything_and_the_restarted_router_serves(supervised, llama_dir):
    """`pdtb chaos --router-drill`'s drill: 32 streams in flight, the router killed; every stream
    ends at the client with a connection error, every node frees its pages without the router,
    the supervisor brings the router back on its port, and its completions equal generate's."""
    from pdtb.chaos.drill import drill

    url, run_dir = supervised
    report = drill(url, run_dir, 32, 5, llama_dir)
    assert report["cut_at_client"] == 32 and report["completed_anyway"] == 0, report
    assert report["seconds_to_zero_pages"] <= FREE_S, report  # (the benchmark holds it to 10 s)
    assert report["probes_identical_to_generate"] and report["probes"] == 4, report
    assert report["seconds_to_router_back"] > 0 and router_healthy(url)
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

