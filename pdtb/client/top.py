"""`pdtb top URL`: a live terminal view of a running cluster, redrawn every `--interval` seconds from the router's
`/cluster` and `/cluster/latency` (the frame: pdtb/client/top_view.py).

`--once` prints one frame, after two polls `--interval` apart so that it has rates, and exits (for
pipes and tests); `--iterations N` stops after N frames. A router that cannot be reached at the
first poll is a one-line error (exit 2); one lost later is a line over the last frame until it
answers again. The screen is cleared with an ANSI sequence only when stdout is a terminal."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

from pdtb.client.top_view import Snapshot, frame
from pdtb.common import CliError

CLEAR = "\x1b[H\x1b[2J"


class Unreachable(Exception):
    """The router did not answer a poll."""


def get_json(url: str, timeout: float):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, a body that is not JSON
        raise Unreachable(f"{url}: {getattr(e, 'reason', None) or e}") from None


def poll(base: str, interval: float, timeout: float) -> Snapshot:
    """One snapshot of the router at `base`. A router without /cluster/latency still gives one."""
    at, clock = time.monotonic(), time.strftime("%H:%M:%S")
    nodes = get_json(f"{base}/cluster", timeout)
    if not isinstance(nodes, list):
        raise Unreachable(f"{base}/cluster: not a list of nodes")
    try:
        latency = get_json(f"{base}/cluster/latency", timeout)
    except Unreachable:
        latency = None
    return Snapshot(nodes, latency if isinstance(latency, dict) else None, at, clock, base, interval)


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


def draw(lines: list[str], out) -> None:
    if out.isatty():
        cols = shutil.get_terminal_size().columns
        out.write(CLEAR + "\n".join(line[:cols] for line in lines) + "\n")
    else:
        out.write("\n".join(lines) + "\n\n")
    out.flush()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb top", description="a live view of a running cluster: pages per node and "
                                 "tenant against each tenant's share, inherited pages, queues, tier moves per second, "
                                 "recent TTFT and ITL per tenant")
    ap.add_argument("url", help="the router, e.g. http://127.0.0.1:8000")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    ap.add_argument("--once", action="store_true", help="print one frame (after two polls, for rates) and exit")
    ap.add_argument("--iterations", type=int, default=None, help="stop after N frames")
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each answer (default 5)")
    a = ap.parse_args(argv)
    if a.interval < 0 or a.timeout <= 0 or (a.iterations is not None and a.iterations < 1):
        raise CliError("--interval must be at least 0, --timeout and --iterations above 0")
    base = base_url(a.url)
    try:
        snap = poll(base, a.interval, a.timeout)
    except Unreachable as e:
        raise CliError(f"cannot reach the router: {e}") from None
    prev = None
    if a.once:
        time.sleep(a.interval)
        fresh, lost = _next(base, a, snap)
        draw(frame(replace(snap, notes=[lost])) if lost else frame(fresh, snap), sys.stdout)
        return 0
    shown = 0
    while True:
        draw(frame(snap, prev), sys.stdout)
        shown += 1
        if a.iterations is not None and shown >= a.iterations:
            return 0
        time.sleep(a.interval)
        fresh, lost = _next(base, a, snap)
        if lost:  # the last frame again, under the reason
            snap = replace(snap, notes=[lost])
        else:
            prev, snap = snap, fresh


def _next(base: str, a, last: Snapshot) -> tuple[Snapshot, str]:
    """The next snapshot, or the last one and why the router did not answer."""
    try:
        return poll(base, a.interval, a.timeout), ""
    except Unreachable as e:
        return last, f"router not answering at {time.strftime('%H:%M:%S')}: {e}"
