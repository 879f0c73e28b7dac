"""`pdtb top URL --once` on a real 1P+1D cluster (loopback, ephemeral ports, the tiny model): the nodes,
tenants and page counts it shows are those of GET /cluster at the same moment, held still by
stopping the decode node (SIGSTOP) once both tenants' requests decode there."""
from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time

import pytest

from chaos_util import http_client, prompt, stream, until
from cluster_util import PDTB, disagg_with_router, get_json

pytestmark = pytest.mark.slow

TENANTS = {"whale": (2, 160), "minnow": (2, 16)}  # requests, prompt tokens
STILL_S = 1.0  # twice the router's ping interval
MAX_TOKENS = 3900  # (the tiny model's 4096 positions less the prompt): streams that outlast the wait below


def without_clock(nodes: list[dict]) -> list[dict]:
    return [{k: v for k, v in n.items() if k != "seconds_since_seen"} for n in nodes]


def sections(text: str) -> dict[str, list[str]]:
    """Each node's line and the lines under it, by node id, from a frame."""
    out, current = {}, None
    for line in text.splitlines()[1:]:
        if line and not line.startswith(" ") and "  device " in line:
            current = out.setdefault(line.split()[0], [line])
        elif line.startswith("  ") and current is not None:
            current.append(line)
        else:
            current = None
    return out


def tenant_rows(lines: list[str]) -> dict[str, list[str]]:
    rows = [ln.split() for ln in lines[1:] if ln.startswith("  ") and not ln.startswith("  inherited:")
            and not ln.startswith("  hand-offs:")]
    return {r[0]: r for r in rows[1:]}  # (rows[0] is the header)


async def freeze_and_look(url: str, decode) -> tuple[list, str, list]:
    """/cluster before and after `pdtb top --once`, with the decode node stopped in between."""
    vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
    rng, started = random.Random(3), []
    async with http_client() as http:
        tasks = [asyncio.ensure_future(stream(http, url, prompt(vocab, n, rng), MAX_TOKENS, started=started, user=t))
                 for t, (k, n) in TENANTS.items() for _ in range(k)]
        try:
            def all_decoding():
                nodes = {n["role"]: n for n in get_json(f"{url}/cluster")}
                pages = nodes["decode"]["extra"].get("tenant_pages", {})
                pre = nodes["prefill"]
                return (len(started) == len(tasks) and set(TENANTS) <= {t for t, v in pages.items() if v}
                        and pre["running"] == pre["waiting"] == pre["extra"].get("handoffs") == 0)

            await until(all_decoding, 60, "both tenants decoding at the decode node")
            decode.send_signal(signal.SIGSTOP)
            try:
                seen: list[tuple[float, list]] = []

                def still():  # a report sent before the stop may still be on its way: the same for a ping's time
                    now = time.monotonic()
                    seen.append((now, without_clock(get_json(f"{url}/cluster"))))
                    since = now
                    for t, c in reversed(seen):  # the latest run of equal reads
                        if c != seen[-1][1]:
                            break
                        since = t
                    return now - since >= STILL_S

                await until(still, 20, "/cluster to hold still")
                before = get_json(f"{url}/cluster")
                top = await asyncio.to_thread(subprocess.run, [PDTB, "top", url, "--once", "--interval", "0.2"],
                                              capture_output=True, text=True, timeout=60)
                after = get_json(f"{url}/cluster")
            finally:
                decode.send_signal(signal.SIGCONT)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert top.returncode == 0, top.stderr
    return before, top.stdout, after


def test_top_once_shows_the_nodes_tenants_and_pages_of_cluster(llama_dir, tmp_path):
    with disagg_with_router(llama_dir, tmp_path / "c", "--kv-pages", "800", "--host-kv-pages", "64",
                            "--policy", "memfair") as (decode, url, _):
        before, frame, after = asyncio.run(asyncio.wait_for(freeze_and_look(url, decode), 180))
    print(frame)
    assert without_clock(before) == without_clock(after)  # top's polls saw this /cluster
    shown = sections(frame)
    assert set(shown) == {n["id"] for n in before}
    for n in before:
        lines = shown[n["id"]]
        assert lines[0].startswith(f"{n['id']}  {n['role']}  ok  ")
        assert f"  device {n['pages_total'] - n['pages_free']}/{n['pages_total']}  " in lines[0]
        assert f"  host {n['host_pages_total'] - n['host_pages_free']}/{n['host_pages_total']}  " in lines[0]
        assert lines[0].endswith(f"  running {n['running']}  waiting {n['waiting']}")
        extra = n["extra"]
        rows = tenant_rows(lines)
        held = {t: str(v) for t, v in extra["tenant_pages"].items() if v}
        assert {t: r[1] for t, r in rows.items() if r[1] != "0"} == held
        for t, r in rows.items():
            assert r[4] == str(extra["tenant_host_pages"].get(t, 0))
            share = extra["quota"].get(t)
            assert r[2] == ("-" if share is None else f"{share:g}")
    decode_node = next(n for n in before if n["role"] == "decode")
    assert set(TENANTS) <= set(tenant_rows(shown[decode_node["id"]]))
    assert f"placed {decode_node['extra']['admissions']['accept']} (0.0/s" in frame  # (nothing moves while stopped)
    latency = frame[frame.index("TTFT and ITL at the router"):].splitlines()
    assert set(TENANTS) <= {ln.split()[0] for ln in latency[2:] if ln.strip()}
