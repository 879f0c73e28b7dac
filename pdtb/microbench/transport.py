"""`pdtb bench transport`: KV transport throughput against its own ceilings, in one run.

    pdtb bench transport [--backend zmq|torch|shm] [--endpoint ipc|tcp] [--size-mib 64]
                         [--small-requests N] [--reps 10] [--checksum sum64|crc32] [--json]
                         [--chunk-mib 4] [--window 4] [--socket-buffer-mib 0]

Measured, all with the tiny model's page geometry (4 layers, 2 KV heads, head_dim 32,
page_size 16, float32: 32 KiB per page) and real exported pages of random data:
- gbps: one `size_mib` transfer, send() -> DONE (receiver verified, wrote the pages, ACKed),
  best of `reps`; the receiver is a separate process (pdtb.microbench.transport_peer).
- raw_zmq_gbps: plain pyzmq DEALER -> ROUTER, the same bytes in the same chunk size over
  the same kind of endpoint, receiver only counting bytes; best of `reps`. Each raw rep
  runs right after a transport rep, so each pair sees the same (shared, noisy) machine;
  `ratio_paired_median` is the median of the per-pair ratios.
- raw_land_gbps: the same raw pyzmq run with the receiver copying every frame into a
  preallocated buffer: the landing copy any receiver that keeps the bytes makes (libzmq owns
  its receive buffers), with none of the transport's work. `ratio_vs_raw_land` compares the
  transport with it; the gap between the two raw figures is the price of that copy alone.
- memcpy_gbps: in-process copy into a preallocated tensor (the same-host ceiling).
- small_pages_per_s: `small_requests` requests of 1-2 pages each, all sent, all DONE.
- export_gbps / gather_gbps: the sender's export before a transfer (not in `gbps`): the page
  gather plus the 64 KiB block sums the transport reuses as its checksums, and the gather alone.
Each process runs torch with one thread. `--backend shm` measures other figures
(pdtb/microbench/shm.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import zmq

from kv_transport.config import MiB, TransportConfig
from kv_transport.testing import TINY_SPEC as BENCH_SPEC, PeerProcess, make_pool
from kv_transport.zmq_backend import apply_socket_options
from pdtb.engine.kv_export import KVExport, export_request
from pdtb.microbench.exports import make_exports, sig
from pdtb.engine.page_pool import PagePool


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdtb bench transport")
    p.add_argument("--backend", choices=("zmq", "torch", "shm"), default="zmq",
                   help="shm: one-sided writes, against ZeroMQ ipc and an in-process pool-to-pool copy")
    p.add_argument("--endpoint", choices=("ipc", "tcp"), default="ipc")
    p.add_argument("--size-mib", type=int, default=64)
    p.add_argument("--small-requests", type=int, default=2000)
    p.add_argument("--reps", type=int, default=10,
                   help="interleaved reps of each side (a 64 MiB rep takes ~20 ms: the best of 5 was noisy)")
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--checksum", choices=("sum64", "crc32"), default="sum64")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--socket-buffer-mib", type=float, default=0.0)
    p.add_argument("--device", default="cpu", help="where both pools live: cpu or cuda[:N]")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if min(a.size_mib, a.reps, a.window, a.small_requests) < 1:
        p.error("--size-mib, --reps, --window and --small-requests must be at least 1")
    if not (0 < a.chunk_mib <= 1024 and 0 <= a.socket_buffer_mib <= 1024):
        p.error("--chunk-mib must be in (0, 1024] and --socket-buffer-mib in [0, 1024]")
    return a


def endpoint_for(kind: str, tag: str, ipc_dir: str) -> str:
    if kind == "tcp":
        return "tcp://127.0.0.1:0"
    return f"ipc://{ipc_dir}/{tag}.sock"


def config_for(args, endpoint: str, chunk: int) -> TransportConfig:
    return TransportConfig(backend=args.backend, endpoint=endpoint or "tcp://127.0.0.1:0",
                           chunk_bytes=chunk, checksum=args.checksum, window=args.window,
                           socket_buffer_bytes=int(args.socket_buffer_mib * MiB))


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in once
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def export_gbps(pool: PagePool, n_pages: int, reps: int) -> tuple[float, float]:
    """Sender-side work before a transfer, outside the transport's figure: export_request
    (gather + the block sums the transport reuses as checksums) and the gather alone."""
    pages = pool.allocate("export-bench", n_pages)
    assert pages is not None, "bench pool too small"
    nbytes = n_pages * BENCH_SPEC.bytes_per_page
    best_export = best_gather = 0.0
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        export_request(pool, "export-bench", n_pages * BENCH_SPEC.page_size)
        t1 = time.perf_counter()
        pool.export_pages(pages)
        if pool.kv.device.type == "cuda":
            torch.cuda.synchronize(pool.kv.device)
        t2 = time.perf_counter()
        best_export, best_gather = max(best_export, nbytes / (t1 - t0) / 1e9), \
            max(best_gather, nbytes / (t2 - t1) / 1e9)
    pool.free("export-bench")
    return best_export, best_gather


class RawZmq:
    """Plain pyzmq baseline: a DEALER pushing the same bytes in the same chunks to a ROUTER
    peer that only counts them; one rep ends when the peer confirms the byte count."""

    def __init__(self, args, chunk: int, land_bytes: int = 0) -> None:
        cfg = config_for(args, "", chunk)
        self.chunk = chunk
        self.peer = PeerProcess(["--role", "raw",
                                 "--endpoint", endpoint_for(args.endpoint, f"raw{land_bytes}", args.ipc_dir),
                                 "--socket-buffer", str(cfg.socket_buffer_bytes),
                                 "--land-bytes", str(land_bytes)])
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.DEALER)
        apply_socket_options(self.sock, cfg)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.connect(self.peer.endpoint())

    def rep(self, data: torch.Tensor) -> float:
        view = memoryview(data.reshape(-1).view(torch.uint8).cpu().numpy())
        t0 = time.perf_counter()
        for off in range(0, len(view), self.chunk):
            self.sock.send(view[off:off + self.chunk], copy=False)
        self.sock.send(b"end")
        got = int(self.sock.recv())
        assert got == len(view), (got, len(view))
        return len(view) / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        self.peer.stop()


async def transport_run(args, big: KVExport, small: list[KVExport], chunk: int,
                        raw: RawZmq, raw_land: RawZmq) -> dict:
    """Alternate one transport rep and one rep of each raw baseline, so each set sees the
    same machine."""
    from kv_transport import make_sender
    from kv_transport.base import TransferState
    peer_args = ["--backend", args.backend,
                 "--endpoint", endpoint_for(args.endpoint, "kv", args.ipc_dir),
                 # room for the big transfer twice over and for every small request at once (they are
                 # all sent before any is waited for; a 1 MiB --size-mib left too few pages for them)
                 "--num-pages", str(2 * big.header.num_pages + sum(e.header.num_pages for e in small) + 64),
                 "--chunk-bytes",
                 str(chunk), "--checksum", args.checksum, "--window", str(args.window),
                 "--socket-buffer", str(config_for(args, "", chunk).socket_buffer_bytes),
                 "--device", args.device]
    store = None
    if args.backend == "torch":
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                              wait_for_workers=False)
        peer_args += ["--dist-port", str(store.port)]
    peer = PeerProcess(peer_args)
    try:
        if store is not None:
            import datetime
            dist.init_process_group("gloo", store=store, rank=0, world_size=2,
                                    timeout=datetime.timedelta(seconds=60))
        tx = make_sender(config_for(args, peer.endpoint(), chunk), BENCH_SPEC)
        await tx.start()
        try:
            rates, raw_rates, land_rates = [], [], []
            for _ in range(args.reps + 1):  # the first pair warms up connections and pages
                t0 = time.perf_counter()
                st = await tx.wait(tx.send(big), 60)
                assert st.state is TransferState.DONE, st.reason
                rates.append(big.header.payload_bytes / (time.perf_counter() - t0) / 1e9)
                raw_rates.append(raw.rep(big.data))
                land_rates.append(raw_land.rep(big.data))
            pages = sum(e.header.num_pages for e in small)
            t0 = time.perf_counter()
            tids = [tx.send(e) for e in small]
            for tid in tids:
                st = await tx.wait(tid, 60)
                assert st.state is TransferState.DONE, st.reason
            small_rate = pages / (time.perf_counter() - t0)
        finally:
            await tx.close()
        return {"rates": rates[1:], "raw_rates": raw_rates[1:], "land_rates": land_rates[1:],
                "small_pages_per_s": small_rate}
    finally:
        peer.stop()
        if store is not None and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="pdtb-bench-") as ipc_dir:
        args.ipc_dir = ipc_dir
        return run_bench(args)


def run_bench(args: argparse.Namespace) -> int:
    if args.backend == "shm":
        from pdtb.microbench.shm import run_shm_bench
        return run_shm_bench(args)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    chunk = int(args.chunk_mib * MiB)
    n_pages = args.size_mib * MiB // BENCH_SPEC.bytes_per_page
    pool = make_pool(n_pages + 8, seed=0, device=args.device)
    big = make_exports(pool, [n_pages], "big")[0]
    small = make_exports(pool, [1 + i % 2 for i in range(args.small_requests)], "small")

    import uvloop
    raw = RawZmq(args, chunk)
    raw_land = RawZmq(args, chunk, land_bytes=big.header.payload_bytes)
    try:
        res = uvloop.run(transport_run(args, big, small, chunk, raw, raw_land))
    finally:
        raw.close()
        raw_land.close()
    mem = memcpy_gbps(big.header.payload_bytes, args.reps)
    export, gather = export_gbps(pool, n_pages, args.reps)
    raw_rates = res["raw_rates"]
    gbps, raw_best, land_best = max(res["rates"]), max(raw_rates), max(res["land_rates"])
    paired = statistics.median(t / r for t, r in zip(res["rates"], raw_rates))
    out = {"backend": args.backend, "endpoint": args.endpoint, "size_mib": args.size_mib,
           "chunk_mib": args.chunk_mib, "checksum": args.checksum, "reps": args.reps,
           "window": args.window, "socket_buffer_mib": args.socket_buffer_mib,
           "small_requests": args.small_requests, "gbps": sig(gbps),
           "gbps_median": sig(statistics.median(res["rates"])),
           "raw_zmq_gbps": sig(raw_best),
           "raw_zmq_gbps_median": sig(statistics.median(raw_rates)),
           "raw_land_gbps": sig(land_best), "ratio_vs_raw_land": sig(gbps / land_best),
           "memcpy_gbps": sig(mem), "ratio_vs_raw_zmq": sig(gbps / raw_best),
           "ratio_paired_median": sig(paired),
           "small_pages_per_s": sig(res["small_pages_per_s"], 1),
           "export_gbps": sig(export), "gather_gbps": sig(gather)}
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


def print_table(out: dict) -> None:
    print(f"transport bench: backend={out['backend']} endpoint={out['endpoint']} "
          f"size={out['size_mib']} MiB chunk={out['chunk_mib']} MiB checksum={out['checksum']}"
          f" reps={out['reps']} (best / median)")
    rows = [("kv transport", f"{out['gbps']:.2f} / {out['gbps_median']:.2f} GB/s"),
            ("raw pyzmq, same chunks", f"{out['raw_zmq_gbps']:.2f} / "
                                       f"{out['raw_zmq_gbps_median']:.2f} GB/s"),
            ("raw pyzmq + landing copy", f"{out['raw_land_gbps']:.2f} GB/s"),
            ("memcpy, preallocated", f"{out['memcpy_gbps']:.2f} GB/s"),
            ("ratio vs raw pyzmq (best/best)", f"{out['ratio_vs_raw_zmq']:.2f}"),
            ("ratio, median of rep pairs", f"{out['ratio_paired_median']:.2f}"),
            ("ratio vs raw + landing copy", f"{out['ratio_vs_raw_land']:.2f}"),
            (f"{out['small_requests']} small requests (1-2 pages)",
             f"{out['small_pages_per_s']:.0f} pages/s"),
            ("export: gather + block sums", f"{out['export_gbps']:.2f} GB/s "
                                            f"(gather alone {out['gather_gbps']:.2f})")]
    for name, value in rows:
        print(f"  {name:<34} {value}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
