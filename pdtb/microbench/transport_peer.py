"""Receiving peer process for the transport benchmark and the process-level tests.

    python -m pdtb.microbench.transport_peer --role transport --backend zmq --endpoint tcp://127.0.0.1:0

Prints one JSON line {"endpoint": ...} once bound, then (role "transport", with --report)
one JSON line per completed transfer: request id, pages, and a sha256 of the received pages
read back from the pool (an independent check of what landed, not the transport's own
checksum). Every completed transfer's pages are freed right away. Role "raw" is the plain
pyzmq baseline: a ROUTER that counts bytes until an "end" frame and answers "done"; with
--land-bytes N it also copies every frame into a preallocated N-byte buffer (the landing copy
a receiver that keeps the bytes cannot avoid, without any of the transport's work).
With --verdicts, the admission answer depends on the request id's first word (accept-*,
park-* into a host tier of --num-pages pages, defer-*, refuse-*), and reports say which tier
each transfer landed in. Role "send" is a sender instead (chaos tests): it sends one --send-pages export to
--endpoint, prints {"sent": id} and then {"state", "code", "reason"} once it ends; with
--shm-stall-s it stalls inside its first one-sided piece, holding its write slot.
A "stats" line on stdin is answered with the pool's page state counts (after pool.check()).
The peer exits when its stdin closes (the parent died or is done), or after --max-s.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import time

import torch
import zmq

from kv_transport.config import MiB, TransportConfig
from kv_transport.zmq_backend import apply_socket_options
from kv_transport.malloc_tuning import keep_freed_memory
from kv_transport.testing import TINY_SPEC
from pdtb.engine import host_memory
from pdtb.engine.page_pool import PagePool



def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdtb.microbench.transport_peer")
    p.add_argument("--role", choices=("transport", "raw", "send"), default="transport")
    p.add_argument("--send-pages", type=int, default=64, help="role send: pages of the one export")
    p.add_argument("--shm-stall-s", type=float, default=0.0, help="FaultConfig.shm_stall_s (a sender's or a receiver's)")
    p.add_argument("--arena", action="store_true", help="role send: gather the export into the sender's arena")
    p.add_argument("--no-shm-verify", action="store_true", help="TransportConfig.shm_verify=False")
    p.add_argument("--backend", choices=("zmq", "torch", "shm", "auto"), default="zmq")
    p.add_argument("--verdicts", action="store_true", help="admit by request id: accept-, park-, defer-, refuse-")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    p.add_argument("--num-pages", type=int, default=9000)
    p.add_argument("--chunk-bytes", type=int, default=4 * MiB)
    p.add_argument("--checksum", default="sum64")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--inline-max-bytes", type=int, default=256 * 1024)
    p.add_argument("--max-message-bytes", type=int, default=8 * MiB)
    p.add_argument("--socket-buffer", type=int, default=0)
    p.add_argument("--land-bytes", type=int, default=0, help="raw role: copy frames into a buffer this big")
    p.add_argument("--device", default="cpu", help="the receiving pool's device")
    p.add_argument("--report", action="store_true")
    p.add_argument("--dist-port", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--max-s", type=float, default=600.0)
    return p.parse_args(argv)


def run_raw(args: argparse.Namespace) -> None:
    keep_freed_memory()  # the same process settings as the transport receiver
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    apply_socket_options(sock, TransportConfig(socket_buffer_bytes=args.socket_buffer))
    sock.bind(args.endpoint.replace(":0", ":*") if args.endpoint.startswith("tcp") else
              args.endpoint)
    emit({"endpoint": sock.getsockopt(zmq.LAST_ENDPOINT).decode()})
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    land = None
    if args.land_bytes:
        land = host_memory.zeros((args.land_bytes,), torch.uint8)  # the same memory as a node's pool
    nbytes, stop_at = 0, time.monotonic() + args.max_s
    while time.monotonic() < stop_at:
        ready = dict(poller.poll(1000))
        if sys.stdin.fileno() in ready or sys.stdin in ready:
            if not sys.stdin.readline():
                break
        if sock not in ready:
            continue
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"end":
            sock.send_multipart([frames[0].bytes, str(nbytes).encode()])
            nbytes = 0
        else:
            for f in frames[1:]:
                n = len(f.buffer)
                if land is not None and nbytes + n <= land.numel():
                    land[nbytes:nbytes + n].copy_(torch.frombuffer(f.buffer, dtype=torch.uint8))
                nbytes += n
    sock.close(linger=0)
    ctx.term()
    if args.endpoint.startswith("ipc:///"):
        with contextlib.suppress(OSError):
            os.unlink(args.endpoint[len("ipc://"):])


async def run_transport(args: argparse.Namespace) -> None:
    from kv_transport import FaultConfig, make_receiver
    shared = args.backend in ("shm", "auto")  # pools a one-sided sender can write into
    pool = PagePool(TINY_SPEC, args.num_pages, device=args.device, shared=shared)
    pool.kv.fill_(1.0)  # fault the pool's pages in now, as a long-running node would have
    host = PagePool(TINY_SPEC, args.num_pages, tier="host", shared=shared) if args.verdicts else None
    cfg = TransportConfig(backend=args.backend, endpoint=args.endpoint,
                          chunk_bytes=args.chunk_bytes, checksum=args.checksum,
                          window=args.window, socket_buffer_bytes=args.socket_buffer,
                          inline_max_bytes=args.inline_max_bytes,
                          max_message_bytes=args.max_message_bytes,
                          max_pages_per_transfer=args.num_pages,
                          transfer_timeout_s=args.timeout_s, shm_verify=not args.no_shm_verify,
                          faults=FaultConfig(shm_stall_s=args.shm_stall_s))
    if args.backend == "torch":
        init_dist_pair(args.dist_port, rank=1)
    rx = make_receiver(cfg, pool, admit=verdicts(host) if args.verdicts else None)
    await rx.start()
    emit({"endpoint": rx.endpoint})
    stdin_closed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:
        line = sys.stdin.readline()
        if not line:
            loop.remove_reader(sys.stdin.fileno())
            stdin_closed.set()
        elif line.strip() == "stats":
            pool.check()
            emit({"counts": pool.state_counts(), "host_counts": host.state_counts() if host else None})
    loop.add_reader(sys.stdin.fileno(), on_stdin)
    stop_at = time.monotonic() + args.max_s
    try:
        while not stdin_closed.is_set() and time.monotonic() < stop_at:
            t = await rx.next_completed(0.2)
            if t is None:
                continue
            landed = host if t.tier == "host" else pool
            if args.report:
                data = landed.export_pages(t.pages).cpu().numpy().tobytes()
                emit({"request_id": t.request_id, "num_pages": len(t.pages),
                      "num_tokens": t.num_tokens, "tenant": t.tenant,
                      "prompt_token_ids": t.prompt_token_ids,
                      "sha256": hashlib.sha256(data).hexdigest(),
                      "reserved": pool.state_counts()["reserved"], "tier": t.tier})
            landed.free(t.request_id)
    finally:
        loop.remove_reader(sys.stdin.fileno())
        await rx.close()
        pool.check()
        if host is not None:
            host.check()


def verdicts(host: PagePool):
    """An admission function that answers by the request id's first word (process tests)."""
    from kv_transport.admission import Admission
    from kv_transport.fail_codes import FailCode

    def admit(header) -> Admission:
        kind = header.request_id.split("-", 1)[0]
        if kind == "park":
            return Admission.park(host)
        if kind == "defer":
            return Admission.defer("deferred by name")
        if kind == "refuse":
            return Admission.refuse(FailCode.TOO_LARGE, "refused by name")
        return Admission.accept()
    return admit


async def run_send(args: argparse.Namespace) -> None:
    from kv_transport import FaultConfig, make_sender
    from kv_transport.testing import make_export, make_pool, staged
    cfg = TransportConfig(backend=args.backend, endpoint=args.endpoint, chunk_bytes=args.chunk_bytes,
                          inline_max_bytes=args.inline_max_bytes, transfer_timeout_s=args.timeout_s,
                          faults=FaultConfig(shm_stall_s=args.shm_stall_s))
    tx = make_sender(cfg, TINY_SPEC)
    await tx.start()
    try:
        export = make_export(make_pool(args.send_pages, seed=1), "sent", args.send_pages)
        tid = tx.send(staged(tx, export) if args.arena else export)
        emit({"sent": tid})
        st = await tx.wait(tid, args.timeout_s + 1)
        emit({"state": st.state.name, "code": str(st.code), "reason": st.reason})
    finally:
        await tx.close()


def init_dist_pair(port: int, rank: int) -> None:
    """Join a 2-rank gloo group whose TCPStore the parent (rank 0) hosts on `port`."""
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=(rank == 0),
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("PDTB_LOG_LEVEL", "WARNING").upper(), stream=sys.stderr,
                        format="%(asctime)s bench_peer %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    if args.role == "raw":
        run_raw(args)
    elif args.role == "send":
        import uvloop
        uvloop.run(run_send(args))
    else:
        import uvloop
        uvloop.run(run_transport(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
