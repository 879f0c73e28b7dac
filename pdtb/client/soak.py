"""The soak checker (two phases, RSS and pages after each).

`python -m pdtb.client.soak`: the checks of a soak run against a running cluster (scripts/soak.sh).

  python -m pdtb.client.soak --url URL --run-dir DIR [--requests 10000] [--concurrency 8]
      [--warmup 1000] [--rss-tolerance 0.10] [--seed 0] [--quiet]

Sends `--requests` short closed-loop requests (prompts 16-64 tokens, outputs 4-16, four tenants)
in two phases: the first `--warmup` requests, then the rest. After each phase, once every node
is idle, it samples the resident memory of every process in the run dir's *.pid files and the
nodes' pages (`/cluster`). Prints the figures; exits 1 when a request failed, a page is still
allocated at the end, or a process's RSS at the end is off its post-warm-up level by more than
`--rss-tolerance` (a fraction; a negative value skips that check).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from pdtb.client import workloads as wl
from pdtb.figures.records import OK
from pdtb.client.load import RunConfig, run

MiB = 1 << 20
IDLE_TIMEOUT_S = 60.0  # a phase's requests are over: the nodes must be idle within this bound
ARRIVAL_RATE = 100.0  # only orders the specs (closed loop ignores send times)


@dataclass
class Sample:
    """The cluster once idle after a phase."""

    done: int  # requests sent so far
    rss: dict[str, int]  # process name (run dir pid file stem) -> resident bytes
    pages: list[dict]  # per node: id, pages_free, pages_total, host_pages_free, host_pages_total
    idle: bool  # every node reported no running/waiting request and all pages free in time


def soak_specs(n: int, seed: int) -> list[wl.RequestSpec]:
    """`n` short requests from four equal tenants."""
    tenants = wl.even_tenants(4, ARRIVAL_RATE, None, "uniform:16:64", "uniform:4:16")
    specs = wl.multi_tenant(tenants, n / ARRIVAL_RATE * 1.5 + 10.0, seed)
    if len(specs) < n:
        raise RuntimeError(f"workload produced {len(specs)} requests, wanted {n}")
    return specs[:n]


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def node_pages(url: str) -> list[dict]:
    keys = ("id", "role", "pages_free", "pages_total", "host_pages_free", "host_pages_total", "running", "waiting")
    return [{k: n[k] for k in keys} for n in get_json(f"{url}/cluster")]


def is_idle(pages: list[dict]) -> bool:
    return all(n["pages_free"] == n["pages_total"] and n["host_pages_free"] == n["host_pages_total"]
               and n["running"] == 0 and n["waiting"] == 0 for n in pages)


def rss_by_process(run_dir: Path) -> dict[str, int]:
    """Resident bytes of every live process named by a pid file in `run_dir` (0: gone)."""
    out = {}
    for f in sorted(run_dir.glob("*.pid")):
        try:
            out[f.stem] = psutil.Process(int(f.read_text())).memory_info().rss
        except (psutil.NoSuchProcess, ValueError):
            out[f.stem] = 0
    return out


def sample(url: str, run_dir: Path, done: int) -> Sample:
    """Wait (bounded) until every node is idle with all pages free, then sample. A node that
    never gets there is reported as is (the leak check fails on it)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    pages = node_pages(url)
    while not is_idle(pages) and time.monotonic() < deadline:
        time.sleep(0.5)
        pages = node_pages(url)
    time.sleep(1.0)  # let allocator frees of the last requests settle before reading RSS
    return Sample(done, rss_by_process(run_dir), pages, is_idle(pages))


async def send(url: str, specs: list[wl.RequestSpec], concurrency: int, seed: int, progress: bool):
    model = get_json(f"{url}/v1/models")["data"][0]
    cfg = RunConfig(url, None, model["vocab_size"], seed=seed, concurrency=concurrency, request_timeout=120.0,
                    sample_interval=0.0, progress=progress)
    return await run(specs, cfg)


def check(first: Sample, last: Sample, records, tolerance: float) -> list[str]:
    """Every failed check, as a sentence (empty: the soak passed)."""
    problems = []
    failed = [r for r in records if r.status != OK]
    if failed:
        errors = sorted({r.error or "?" for r in failed})[:5]
        problems.append(f"{len(failed)} request(s) failed, e.g. {errors}")
    for n in last.pages:
        if n["pages_free"] != n["pages_total"] or n["host_pages_free"] != n["host_pages_total"]:
            problems.append(f"{n['id']}: {n['pages_total'] - n['pages_free']} device and "
                            f"{n['host_pages_total'] - n['host_pages_free']} host page(s) still allocated")
        elif not last.idle:
            problems.append(f"{n['id']}: not idle at the end ({n['running']} running, {n['waiting']} waiting)")
    if tolerance >= 0:
        for name, before in first.rss.items():
            after = last.rss.get(name, 0)
            if not before or not after:
                problems.append(f"{name}: process gone (RSS {before} -> {after})")
            elif abs(after - before) > tolerance * before:
                problems.append(f"{name}: RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB, "
                                f"off by more than {tolerance:.0%}")
    return problems


def report(n: int, warm: int, concurrency: int, duration: float, records, first: Sample, last: Sample) -> None:
    failed = sum(r.status != OK for r in records)
    tokens = sum(r.output_tokens for r in records)
    print(f"soak: {n} requests ({warm} warm-up + {n - warm}), concurrency {concurrency}, "
          f"{duration:.1f} s, {n / duration:.1f} req/s, {tokens} output tokens, {failed} failed")
    for p in last.pages:
        print(f"soak: pages {p['id']} ({p['role']}): {p['pages_free']}/{p['pages_total']} device free, "
              f"{p['host_pages_free']}/{p['host_pages_total']} host free")
    for name, before in first.rss.items():
        after = last.rss.get(name, 0)
        change = (after - before) / before * 100 if before else float("nan")
        print(f"soak: rss {name}: {before / MiB:.1f} MiB after {first.done} requests -> "
              f"{after / MiB:.1f} MiB after {last.done} ({change:+.1f}%)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.client.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="router base URL")
    ap.add_argument("--run-dir", required=True, type=Path, help="the cluster's run dir (pid files)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1000, help="requests before the first RSS sample")
    ap.add_argument("--rss-tolerance", type=float, default=0.10, help="fraction; negative: no RSS check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    a = ap.parse_args(argv)
    if a.requests < 2 or a.concurrency < 1:
        ap.error("--requests must be at least 2 and --concurrency at least 1")
    url, warm = a.url.rstrip("/"), min(a.warmup, a.requests // 2)
    specs = soak_specs(a.requests, a.seed)
    t0 = time.monotonic()
    res1 = asyncio.run(send(url, specs[:warm], a.concurrency, a.seed, not a.quiet))
    first = sample(url, a.run_dir, warm)
    res2 = asyncio.run(send(url, specs[warm:], a.concurrency, a.seed + 1, not a.quiet))
    duration = res1.duration + res2.duration
    last = sample(url, a.run_dir, a.requests)
    records = res1.records + res2.records
    report(a.requests, warm, a.concurrency, duration, records, first, last)
    problems = check(first, last, records, a.rss_tolerance)
    for p in problems:
        print(f"soak: FAIL {p}")
    print(f"soak: {'FAIL' if problems else 'PASS'} ({time.monotonic() - t0:.0f} s wall)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
