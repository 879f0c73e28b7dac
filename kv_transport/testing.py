"""Pools of random pages, exports and a started receiver linked to a sender, for tests and the
benchmark.

Helpers shared by the transport tests and the benchmark: pools of random pages, exports, a
started receiver linked to a sender, and a bench_peer child process with bounded reads and a kill
that always runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import torch

from kv_transport import TransportConfig, make_receiver, make_sender
from pdtb.engine.kv_export import KVExport, export_request
from pdtb.engine.kv_spec import KVSpec
from pdtb.engine.page_pool import PagePool

REPO = Path(__file__).resolve().parent.parent
TINY_SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, page_size=16, dtype="float32")


def make_pool(num_pages: int, spec: KVSpec = TINY_SPEC, seed: int | None = None,
              device: str = "cpu") -> PagePool:
    """A pool; with a seed, every page holds reproducible random values (drawn on the CPU, so
    a seed gives the same bytes on every device)."""
    pool = PagePool(spec, num_pages, device=device)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=g).to(pool.kv.dtype))
    return pool


def make_export(pool: PagePool, request_id: str, num_pages: int, tail: int = 0) -> KVExport:
    """Allocate `num_pages` for `request_id` and export them (last page `tail` tokens short)."""
    if pool.allocate(request_id, num_pages) is None:
        raise RuntimeError(f"pool cannot hold {num_pages} more pages")
    return export_request(pool, request_id, num_pages * pool.spec.page_size - tail)


@contextlib.asynccontextmanager
async def linked(config: TransportConfig, dst: PagePool, **sender):
    """A started receiver into `dst` and a sender to it, of config's backend, both closed on the
    way out; `sender`: the sender's config fields that differ from config's (faults=...)."""
    rx = make_receiver(config, dst)
    await rx.start()
    tx = make_sender(dataclasses.replace(config, endpoint=rx.endpoint, **sender), TINY_SPEC)
    await tx.start()
    try:
        yield tx, rx
    finally:
        await tx.close()
        await rx.close()


def staged(tx, export: KVExport) -> KVExport:
    """`export` gathered into the sender's export_buffer (the shm sender's arena), as a node's
    export_request(out=...) gathers it; the export itself where the sender has none."""
    buf = tx.export_buffer(export.header.payload_bytes)
    if buf is None:
        return export
    buf.copy_(export.data.reshape(-1).view(torch.uint8))
    return KVExport(export.header, buf.view(export.data.dtype).view(export.data.shape), export.block_sums)


def sha256_of(export: KVExport) -> str:
    """Digest of an export's bytes, computed independently of the transport's checksum."""
    return hashlib.sha256(export.data.contiguous().cpu().numpy().tobytes()).hexdigest()


class PeerProcess:
    """`python -m pdtb.microbench.transport_peer ARGS`; reads its JSON lines with timeouts."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdtb.microbench.transport_peer", *args], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buf = bytearray()

    def read_json(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer sent no line in {timeout}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise EOFError(f"peer exited with {self.proc.wait(5)}")
                self._buf += data
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return json.loads(line)

    def counts(self, timeout: float = 10.0) -> dict:
        """The peer pool's page state counts (it checks the pool's invariants first)."""
        self.proc.stdin.write(b"stats\n")
        self.proc.stdin.flush()
        msg = self.read_json(timeout)
        while "counts" not in msg:  # skip transfer reports still in the pipe
            msg = self.read_json(timeout)
        return msg["counts"]

    def endpoint(self, timeout: float = 60.0) -> str:
        return self.read_json(timeout)["endpoint"]

    def stop(self, timeout: float = 5.0) -> int:
        """Close stdin (the peer's signal to exit); kill it if it does not. Returns its code."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
