"""The prefill side of `pdtb bench lockstep`: a child process that sends hand-offs on command.

    python -m pdtb.microbench.lockstep_peer --backend zmq --spec JSON

Its first line on stdin names the receiver, {"endpoint": E}; it answers {"ready": true} once
its sender is up, then each command line, one at a time, with one JSON line once that
transfer has ended:

    {"rid": ID, "num_tokens": N, "seed": S, "meta": {TransferMeta fields}}
    -> {"rid": ID, "state": "DONE" | "FAILED", "code": null | a FailCode | "timeout"}

The payload is N tokens of KV drawn from `seed` (the same bytes on every backend), sealed with
the meta as a prefill node seals its hand-offs (pdtb/nodes/kv_meta.py). With --dist-port it
joins the parent's 2-rank gloo group as rank 1 first (`--backend torch`). It exits when its
stdin closes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

import torch

from kv_transport import TransferMeta, TransferState, TransportConfig, make_sender
from pdtb.microbench.transport_peer import emit, init_dist_pair
from pdtb.engine.kv_export import export_request
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool
from pdtb.nodes import kv_meta


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdtb.microbench.lockstep_peer")
    p.add_argument("--backend", required=True)
    p.add_argument("--spec", required=True, help="the decode node's KVSpec fields, as JSON")
    p.add_argument("--max-pages", type=int, default=256, help="pages of the largest hand-off")
    p.add_argument("--dist-port", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    return p.parse_args(argv)


def payload(pool: PagePool, rid: str, num_tokens: int, seed: int, tx=None):
    """`num_tokens` tokens of KV for `rid`, the same bytes for the same seed; gathered into
    `tx`'s export_buffer where it has one, as the prefill node gathers a hand-off's."""
    pages = pool.allocate(rid, pool.spec.pages_for(num_tokens))
    if pages is None:
        raise ValueError(f"{rid}: {num_tokens} tokens need more than --max-pages")
    g = torch.Generator().manual_seed(seed)
    pool.kv[:, :, pages] = torch.randn(pool.kv[:, :, pages].shape, generator=g).to(pool.kv.dtype)
    try:
        out = tx.export_buffer(len(pages) * pool.spec.bytes_per_page) if tx is not None else None
        return export_request(pool, rid, num_tokens, out=out)
    finally:
        pool.free(rid)


async def serve(a: argparse.Namespace) -> None:
    spec = KVSpec(**json.loads(a.spec))
    pool = PagePool(spec, a.max_pages)
    loop = asyncio.get_running_loop()
    first = await loop.run_in_executor(None, sys.stdin.readline)
    if not first:
        return
    tx = make_sender(TransportConfig(backend=a.backend, endpoint=json.loads(first)["endpoint"],
                                     transfer_timeout_s=a.timeout_s), spec)
    await tx.start()
    kept = {}  # request id -> the export of a deferred hand-off
    emit({"ready": True})
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            rid = cmd["rid"]
            export = kept.pop(rid, None) or payload(pool, rid, cmd["num_tokens"], cmd["seed"], tx)
            h = export.header
            meta = kv_meta.seal(TransferMeta(**cmd["meta"]), h.request_id, h.num_tokens, h.num_pages)
            tid = tx.send(export, meta)
            st = await tx.wait(tid, a.timeout_s + 5)
            if not st.state.finished:  # (the transport's own timeout should have ended it)
                tx.cancel(tid, "no end within the transfer timeout")
                emit({"rid": rid, "state": "FAILED", "code": "timeout"})
                continue
            code = None if st.state is TransferState.DONE else str(st.code or "unknown")
            if code == "no_pages":  # deferred: the same bytes go again at its retry
                kept[rid] = export
            emit({"rid": rid, "state": st.state.name, "code": code})
    finally:
        await tx.close()


def main(argv: list[str] | None = None) -> int:
    import uvloop

    a = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    if a.dist_port:
        init_dist_pair(a.dist_port, rank=1)
    uvloop.run(serve(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
