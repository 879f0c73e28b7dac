"""`pdtb bench transport --backend shm`: the shm backend's two ways against ZeroMQ ipc and
against an in-process copy between two pools, in one run.

- shm_gbps: one `size_mib` transfer over the shm backend as a node sends it, send() -> DONE:
  the header, the receiver (a separate process) copying the payload from the sender's arena
  into its pool pages and summing it in the same pass (the read path, shm_read.py), Ack. The
  export is gathered into the arena once, before the reps (a node gathers each hand-off into
  the arena instead of into a new tensor: the same copy, untimed for every way). Best of `reps`.
- shm_write_gbps: the same export from outside the arena, written one-sided: header, Grant,
  the sender's copy into the receiver's shared pool, Commit, the receiver reading the pages
  back against the checksum, Ack (control on the local link, which the warm-up connects).
- shm_unchecked_gbps: that write to a receiver with `shm_verify=False`, which takes the
  sender's checksum for the pages instead of reading them back (what the check costs).
- zmq_ipc_gbps: the same transfer over the zmq backend on an ipc endpoint, to another
  receiving process; the reps of all four alternate, so each set sees the same machine.
- pool_copy_gbps: the best in-process copy of the same pages from one pool into another's
  (both in this process, no transport): the export's bytes landed in the other pool's pages
  by the C landing copy, and a torch index copy pool to pool; the better of the two.
- checked_copy_gbps: a checked one-sided write's own work with no transport, in this process:
  the sender's pieces (the same sizes) copied and summed into a shared pool by one thread while
  a second reads each finished piece back and sums it, as the receiver does. Three passes over
  the bytes (read, write, read back) where the pool copy and the read path make two: the bound
  a checked write meets on this machine's memory, whatever its protocol. Best of `reps`.
- ratio_vs_zmq_ipc, ratio_vs_pool_copy: shm_gbps over each (best / best); ratio_paired_median:
  the median of per-pair shm/zmq ratios; write_* and unchecked_*: the same for those two.
"""
from __future__ import annotations

import json
import queue
import statistics
import threading
import time

import torch

from pdtb.microbench.exports import make_exports, sig
from kv_transport.config import MiB, TransportConfig
from kv_transport.page_writer import PageWriter
from kv_transport.shm_backend import piece_rows
from kv_transport.testing import TINY_SPEC as SPEC, PeerProcess, make_pool, staged
from pdtb.engine.kv_export import KVExport
from pdtb.engine.page_pool import PagePool


KINDS = {"shm": ("shm", []), "shm_write": ("shm", []), "shm_unchecked": ("shm", ["--no-shm-verify"]),
         "zmq": ("zmq", [])}


def _peer(args, kind: str, chunk: int, pages: int) -> PeerProcess:
    backend, extra = KINDS[kind]
    return PeerProcess(["--backend", backend, "--endpoint", f"ipc://{args.ipc_dir}/{kind}.sock",
                        "--num-pages", str(pages), "--chunk-bytes", str(chunk),
                        "--checksum", args.checksum, "--window", str(args.window), *extra])


async def _reps(args, big: KVExport, chunk: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    from kv_transport import TransferState, make_sender
    pages = 2 * big.header.num_pages + 64
    peers = {k: _peer(args, k, chunk, pages) for k in KINDS}
    senders = {}
    try:
        for k, peer in peers.items():
            senders[k] = make_sender(TransportConfig(backend=KINDS[k][0], endpoint=peer.endpoint(), chunk_bytes=chunk,
                                                     checksum=args.checksum, window=args.window,
                                                     transfer_timeout_s=60.0), SPEC)
            await senders[k].start()
        in_arena = staged(senders["shm"], big)
        if in_arena is big:
            raise RuntimeError("the shm sender has no export arena room for the payload")
        rates: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(args.reps + 1):  # the first round warms up connections, mappings and pages
            for b, tx in senders.items():
                t0 = time.perf_counter()
                st = await tx.wait(tx.send(in_arena if b == "shm" else big), 60)
                assert st.state is TransferState.DONE, f"{b}: {st.reason}"
                rates[b].append(big.header.payload_bytes / (time.perf_counter() - t0) / 1e9)
        return {k: v[1:] for k, v in rates.items()}, {"read_by_receiver": senders["shm"].read_by_receiver,
                                                      "written_one_sided": senders["shm_write"].one_sided,
                                                      "local_links": senders["shm_write"].links}
    finally:
        for tx in senders.values():
            await tx.close()
        for peer in peers.values():
            peer.stop()


def pool_copy_gbps(src: PagePool, big: KVExport, reps: int) -> tuple[float, float]:
    """(landing copy of the export into another pool, torch index copy pool to pool), best of reps."""
    n = big.header.num_pages
    dst = PagePool(SPEC, n + 8)
    dst.kv.fill_(1.0)  # faulted in, as the receiving peers' pools are
    dst_pages = dst.allocate("copy", n)
    src_pages = src.allocate("copy", n)
    writer = PageWriter(dst)
    plan = writer.plan(dst_pages)
    view = memoryview(big.data.reshape(-1).view(torch.uint8).numpy())
    src_idx, dst_idx = torch.tensor(src_pages), torch.tensor(dst_pages)
    land = index = 0.0
    for rep in range(reps + 1):  # (the first round warms up)
        t0 = time.perf_counter()
        if writer.write_bytes_sum64(plan, 0, view, 0) is None:
            writer.write_bytes(plan, 0, view)
        t1 = time.perf_counter()
        dst.kv[:, :, dst_idx] = src.kv[:, :, src_idx]
        t2 = time.perf_counter()
        if rep:
            land, index = max(land, len(view) / (t1 - t0) / 1e9), max(index, len(view) / (t2 - t1) / 1e9)
    src.free("copy")
    return land, index


def checked_copy_gbps(big: KVExport, chunk: int, reps: int, timeout: float = 60.0) -> float:
    """The export written piece by piece into a shared pool (copy and sum in one pass) while a
    second thread reads every finished piece back and sums it; best of `reps` after a warm-up
    round. The C copy and numpy's sum let go of the GIL, so the two run at once, as sender and
    receiver do."""
    n = big.header.num_pages
    dst = PagePool(SPEC, n + 8, shared=True)
    try:
        dst.kv.fill_(1.0)  # faulted in, as the receiving peers' pools are
        writer = PageWriter(dst)
        plan = writer.plan(dst.reserve("checked", n))
        view = memoryview(big.data.reshape(-1).view(torch.uint8).numpy())
        row = writer.row_bytes
        total, chunk_rows = len(view) // row, max(1, chunk // row)
        best = 0.0
        for rep in range(reps + 1):
            done: queue.SimpleQueue = queue.SimpleQueue()  # rows written so far, then None
            got: list = []  # the read-back sum, or what stopped the reader

            def read_back() -> None:
                try:
                    acc = row0 = 0
                    while (row1 := done.get(timeout=timeout)) is not None:
                        acc = writer.checksum(plan, "sum64", row0, row1, acc)
                        row0 = row1
                    got.append(acc)
                except BaseException as e:  # noqa: BLE001 - handed to the writing thread, raised there
                    got.append(e)

            reader = threading.Thread(target=read_back, name="read-back", daemon=True)
            reader.start()
            t0 = time.perf_counter()
            acc = r = 0
            try:
                while r < total:
                    k = piece_rows(total - r, chunk_rows)
                    acc, r = writer.write_summed(plan, r, view[r * row:(r + k) * row], "sum64", acc), r + k
                    done.put(r)
            finally:
                done.put(None)
                reader.join(timeout)
            dt = time.perf_counter() - t0
            if reader.is_alive() or not got:
                raise RuntimeError(f"the read-back thread did not finish within {timeout}s")
            if isinstance(got[0], BaseException):
                raise RuntimeError("the read-back failed") from got[0]
            if got[0] != acc:
                raise RuntimeError(f"read back {got[0]:#x}, written {acc:#x}")
            if rep:
                best = max(best, len(view) / dt / 1e9)
        return best
    finally:
        dst.shared.close()


def run_shm_bench(args) -> int:
    import uvloop

    torch.set_num_threads(1)
    torch.manual_seed(0)
    chunk = int(args.chunk_mib * MiB)
    n_pages = args.size_mib * MiB // SPEC.bytes_per_page
    pool = make_pool(2 * n_pages + 8, seed=0)
    big = make_exports(pool, [n_pages], "big")[0]
    rates, counts = uvloop.run(_reps(args, big, chunk))
    land, index = pool_copy_gbps(pool, big, args.reps)
    checked = checked_copy_gbps(big, chunk, args.reps)
    copy, zmq_ipc = max(land, index), rates["zmq"]
    out = {"backend": "shm", "size_mib": args.size_mib, "chunk_mib": args.chunk_mib, "checksum": args.checksum,
           "reps": args.reps}
    for kind, name in (("shm", ""), ("shm_write", "write_"), ("shm_unchecked", "unchecked_")):
        best, key = max(rates[kind]), kind + "_gbps"
        out.update({key: sig(best), key + "_median": sig(statistics.median(rates[kind])),
                    name + "ratio_vs_zmq_ipc": sig(best / max(zmq_ipc)),
                    name + "ratio_paired_median": sig(statistics.median(a / b for a, b in zip(rates[kind], zmq_ipc))),
                    name + "ratio_vs_pool_copy": sig(best / copy)})
    out.update({"write_ratio_vs_checked_copy": sig(max(rates["shm_write"]) / checked),
                "zmq_ipc_gbps": sig(max(zmq_ipc)), "zmq_ipc_gbps_median": sig(statistics.median(zmq_ipc)),
                "pool_copy_gbps": sig(copy), "pool_landing_copy_gbps": sig(land),
                "pool_index_copy_gbps": sig(index), "checked_copy_gbps": sig(checked),
                **counts})
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"transport bench: shm (read, write) vs ZeroMQ ipc vs in-process pool copy, size={out['size_mib']} MiB "
          f"chunk={out['chunk_mib']} MiB checksum={out['checksum']} reps={out['reps']} (best / median)")

    def ratios(name: str) -> str:
        return (f"{out[name + 'ratio_vs_zmq_ipc']:.2f}x zmq ipc (pairs' median {out[name + 'ratio_paired_median']:.2f}x), "
                f"{out[name + 'ratio_vs_pool_copy']:.2f}x pool copy")
    rows = [("shm, receiver reads", f"{out['shm_gbps']:.2f} / {out['shm_gbps_median']:.2f} GB/s ({ratios('')})"),
            ("shm, sender writes", f"{out['shm_write_gbps']:.2f} / {out['shm_write_gbps_median']:.2f} GB/s "
                                   f"({ratios('write_')}, {out['write_ratio_vs_checked_copy']:.2f}x checked copy)"),
            ("shm, written, not read back", f"{out['shm_unchecked_gbps']:.2f} / {out['shm_unchecked_gbps_median']:.2f} "
                                            f"GB/s ({ratios('unchecked_')})"),
            ("zmq ipc", f"{out['zmq_ipc_gbps']:.2f} / {out['zmq_ipc_gbps_median']:.2f} GB/s"),
            ("in-process pool copy", f"{out['pool_copy_gbps']:.2f} GB/s (landing copy "
                                     f"{out['pool_landing_copy_gbps']:.2f}, index copy {out['pool_index_copy_gbps']:.2f})"),
            ("in-process checked copy", f"{out['checked_copy_gbps']:.2f} GB/s (copy and read-back on two threads)"),
            ("transfers the receiver read", str(out["read_by_receiver"])),
            ("transfers written one-sided", str(out["written_one_sided"])),
            ("control on a local link", "yes" if out["local_links"] else "no")]
    for name, value in rows:
        print(f"  {name:<30} {value}")
    return 0
