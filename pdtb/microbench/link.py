"""`python -m pdtb.microbench.link`: a control round trip through pyzmq's asyncio sockets against
the local link.

Round trips of a small control message between two processes of this host: through pyzmq's
asyncio sockets (DEALER -> ROUTER over ipc, what the zmq backend sends its control on) and
through a local link (local_link.py, what the shm backend switches to). Same message, same
event loop (uvloop), one echoing child process each (started as `--echo zmq|link`).

    python -m pdtb.microbench.link [--n 2000] [--json]

Prints the median and the 10th percentile round trip of each, and their ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import select
import statistics
import subprocess
import sys
import tempfile
import time

import zmq
import zmq.asyncio

from kv_transport.local_link import LinkClient, LinkListener

MESSAGE = [b"x" * 64]  # about a Commit's size


async def _zmq_echo(n: int) -> None:
    ctx = zmq.asyncio.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    with tempfile.TemporaryDirectory(prefix="pdtb-link-") as d:
        sock.bind(f"ipc://{d}/echo.sock")
        print(json.dumps({"endpoint": f"ipc://{d}/echo.sock"}), flush=True)
        for _ in range(n + 1):
            sock.send_multipart(await asyncio.wait_for(sock.recv_multipart(copy=False), 30), copy=False)
        await asyncio.sleep(0.2)
        sock.close(linger=0)
    ctx.term()


async def _link_echo(n: int) -> None:
    listener = LinkListener(4, 1 << 20)
    await listener.start()
    print(json.dumps({"name": listener.name, "ticket": listener.ticket(b"peer")}), flush=True)
    for _ in range(n + 1):
        got = listener.take()
        while got is None:
            await asyncio.wait_for(listener.ready.wait(), 30)
            got = listener.take()
        listener.send(*got)
    await asyncio.sleep(0.2)
    await listener.close()


async def _zmq_rtts(endpoint: str, n: int) -> list[float]:
    ctx = zmq.asyncio.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    out = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        await sock.send_multipart(MESSAGE)
        await asyncio.wait_for(sock.recv_multipart(), 10)
        if i:
            out.append(time.perf_counter() - t0)
    sock.close(linger=0)
    ctx.term()
    return out


async def _link_rtts(name: str, ticket: str, n: int) -> list[float]:
    link = LinkClient(4, 1 << 20)
    await link.connect(name, ticket, 10)
    out = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        link.send(MESSAGE)
        while link.take() is None:
            await asyncio.wait_for(link.ready.wait(), 10)
        if i:
            out.append(time.perf_counter() - t0)
    link.close()
    return out


def _echo(kind: str, n: int) -> subprocess.Popen:
    """The echoing process; its first stdout line says where it listens."""
    return subprocess.Popen([sys.executable, "-m", "pdtb.microbench.link", "--echo", kind, "--n", str(n)],
                            stdout=subprocess.PIPE, text=True)


def _address(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise RuntimeError(f"the echo process said nothing in {timeout}s (exit {proc.poll()})")
    return json.loads(line)


def _measure(kind: str, n: int) -> list[float]:
    import uvloop

    proc = _echo(kind, n)
    try:
        where = _address(proc)
        if kind == "zmq":
            return uvloop.run(_zmq_rtts(where["endpoint"], n))
        return uvloop.run(_link_rtts(where["name"], where["ticket"], n))
    finally:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _summary(rtts: list[float]) -> dict:
    rtts = sorted(rtts)
    return {"median_us": round(statistics.median(rtts) * 1e6, 1), "p10_us": round(rtts[len(rtts) // 10] * 1e6, 1)}


def run(n: int) -> dict:
    out = {"n": n, "zmq": _summary(_measure("zmq", n)), "link": _summary(_measure("link", n))}
    out["ratio_median"] = round(out["zmq"]["median_us"] / out["link"]["median_us"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdtb.microbench.link", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="round trips of each")
    p.add_argument("--json", action="store_true")
    p.add_argument("--echo", choices=["zmq", "link"], help=argparse.SUPPRESS)  # the echoing child
    args = p.parse_args(argv)
    if args.echo:
        import uvloop

        uvloop.run(_zmq_echo(args.n) if args.echo == "zmq" else _link_echo(args.n))
        return 0
    out = run(args.n)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"control round trip, {args.n} messages of {len(MESSAGE[0])} bytes (median / p10):")
        print(f"  zmq asyncio (ipc)  {out['zmq']['median_us']:8.1f} / {out['zmq']['p10_us']:.1f} us")
        print(f"  local link         {out['link']['median_us']:8.1f} / {out['link']['p10_us']:.1f} us")
        print(f"  ratio (median)     {out['ratio_median']:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
