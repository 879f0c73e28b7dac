"""One admission decision per verdict through every backend (shm: both ways, written by the
sender and read by the receiver), receiver in a child process:
ACCEPT lands in the device pool, PARK in the host tier, DEFER fails the transfer no_pages,
REFUSE fails it with the refusal's code. Every backend gives the same outcome, bytes
checked by a sha256 the peer computes from the pages it reads back; nothing stays reserved.
"""
from __future__ import annotations

import datetime

import pytest

from kv_transport import TransferState, TransportConfig, make_sender
from kv_transport.testing import TINY_SPEC, PeerProcess, make_export, make_pool, sha256_of, staged
from tests.transport.test_transport_procs import peers, run  # noqa: F401 (fixture)

CHUNK = 64 * 1024  # two pages: the 9-page payloads stream (or are written one-sided) in 5 pieces
INLINE = 4096  # below one page: no payload rides inline
EXPECTED = {"accept-1": ("done", "device"), "park-1": ("done", "host"),
            "defer-1": ("no_pages", None), "refuse-1": ("too_large", None),
            "accept-2": ("done", "device"), "park-2": ("done", "host")}


async def send_all(config: TransportConfig, peer: PeerProcess, read: bool = False) -> tuple[dict, int | None, int | None]:
    """(outcome per request, transfers written one-sided, transfers the receiver read); `read`:
    each export gathered into the sender's arena first (shm: the receiver reads it)."""
    pool = make_pool(128, seed=11)
    exports = {rid: make_export(pool, rid, 9 if rid.endswith("1") else 2, tail=3) for rid in EXPECTED}
    tx = make_sender(config, TINY_SPEC)
    await tx.start()
    outcome = {}
    try:
        for rid, e in exports.items():  # one at a time: torch's dist ops are ordered anyway
            st = await tx.wait(tx.send(staged(tx, e) if read else e), 20.0)
            outcome[rid] = "done" if st.state is TransferState.DONE else str(st.code)
    finally:
        await tx.close()
    landed = {}
    for _ in [r for r in outcome.values() if r == "done"]:
        r = peer.read_json(10.0)
        assert r["sha256"] == sha256_of(exports[r["request_id"]]), r["request_id"]
        landed[r["request_id"]] = r["tier"]
    counts = peer.counts()
    assert counts["reserved"] == 0 and counts["resident"] == 0
    return ({rid: (o, landed.get(rid)) for rid, o in outcome.items()}, getattr(tx, "one_sided", None),
            getattr(tx, "read_by_receiver", None))


@pytest.mark.parametrize("way", ["zmq", "shm-write", "shm-read", "torch"])
def test_every_verdict_has_one_outcome_on_every_backend(way, peers):  # noqa: F811
    backend = way.split("-")[0]
    args = ["--backend", backend, "--verdicts", "--chunk-bytes", str(CHUNK), "--inline-max-bytes", str(INLINE)]
    store = None
    if backend == "torch":
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
        args += ["--dist-port", str(store.port)]
    peer = peers(*args)
    try:
        if store is not None:
            dist.init_process_group("gloo", store=store, rank=0, world_size=2,
                                    timeout=datetime.timedelta(seconds=30))
        config = TransportConfig(backend=backend, endpoint=peer.endpoint(), chunk_bytes=CHUNK,
                                 inline_max_bytes=INLINE, transfer_timeout_s=20.0)
        outcome, one_sided, read = run(send_all(config, peer, read=way == "shm-read"))
        assert outcome == EXPECTED
        # every landed payload written straight into the pool, or read by the receiver from the arena
        assert (one_sided, read) == {"shm-write": (4, 0), "shm-read": (0, 4)}.get(way, (None, None))
    finally:
        if store is not None and dist.is_initialized():
            dist.destroy_process_group()
