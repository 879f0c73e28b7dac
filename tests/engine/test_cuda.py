"""The CUDA paths, on a GPU. Skipped where torch sees no CUDA device (CI has none).

On a GPU machine whose python3 has a CUDA build of torch (README, "On a GPU"):

    PDTB_SYSTEM_PYTHON=1 bash scripts/test.sh tests/engine/test_cuda.py

- the paged engine on a CUDA pool is token-identical to transformers.generate on the same GPU;
- pages exported from a CUDA pool continue identically in a CPU pool and back;
- tier moves between the CUDA device tier and the pinned host tier keep tokens identical;
- the ZeroMQ transport moves pages from a CUDA pool to a CUDA pool in another process,
  bit-identical.
Not here: the torch.distributed backend over NCCL. NCCL wants one GPU per rank, and no machine
with two has been available; its gloo twin runs in test_transport_procs.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, make_engine, make_prompts, prefill_and_move
from pdtb.engine.sequence import SamplingParams
from tests.transport.test_transport_procs import peers, run, send_ragged  # noqa: F401  (peers: a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
LENGTHS = (1, 5, 17, 100, 333)


@pytest.fixture(scope="module")
def hf_cuda(model_dirs):
    """Reference models on the GPU, plain sdpa."""
    from pdtb.engine.loader import load_model

    return {arch: load_model(d, device="cuda", attn_implementation="sdpa")[0] for arch, d in model_dirs.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_cuda_batched_greedy_matches_generate(model_dirs, hf_cuda, arch, page_size):
    engine = make_engine(model_dirs[arch], page_size=page_size, num_pages=4096, device="cuda")
    assert engine.pool.kv.is_cuda
    prompts = make_prompts(LENGTHS, engine.info.vocab_size, seed=page_size)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(hf_cuda[arch], p, 24, ignore_eos=True), f"prompt of {len(p)} tokens"
    if HAVE_TRITON:  # decode rows read their pages in place, steps replayed from CUDA graphs
        assert engine.runner.kernel.name == "triton"
        assert engine.runner.graphs.disabled is None and engine.runner.graphs.replays > 0
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("src,dst", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_export_import_across_devices(llama_dir, hf_models, hf_cuda, src, dst):
    """Prefill on one device, import the pages into a pool on another, decode there. CPU and
    GPU kernels round differently, so each token is checked against generate on the device
    that produced it: the first (prefill) on `src`, the rest (decode) on `dst`."""
    ref = {"cpu": hf_models["llama"], "cuda": hf_cuda["llama"]}
    a = make_engine(llama_dir, page_size=16, device=src)
    b = make_engine(llama_dir, page_size=16, num_pages=512, device=dst)
    prompts = make_prompts((1, 23, 200), a.info.vocab_size, seed=7)
    moved, exports = prefill_and_move(a, b, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(e.data.device.type == src for e in exports)
    for p, s in zip(prompts, moved):
        first = s.output_token_ids[0]
        assert first == hf_greedy(ref[src], p, 1, ignore_eos=True)[0]
        assert s.output_token_ids[1:] == hf_greedy(ref[dst], p + [first], 19, ignore_eos=True), f"prompt of {len(p)} tokens"
    assert a.pool.num_free == a.pool.num_pages


@pytest.mark.parametrize("policy", ["memfair", "fcfs"])
def test_cuda_tier_moves_to_pinned_host(llama_dir, hf_cuda, policy):
    """Demotions to the pinned host tier and promotions back keep every token identical."""
    from fairness import make_policy

    engine = make_engine(llama_dir, page_size=4, num_pages=48, host_kv_pages=24, device="cuda",
                         policy=make_policy(policy))
    assert engine.host_pool.kv.is_pinned() and engine.pool.kv.is_cuda
    prompts = make_prompts((60, 50, 6, 9, 7, 12), engine.info.vocab_size, seed=11)
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=40, ignore_eos=True),
                                 tenant="whale" if len(p) > 20 else "minnow") for p in prompts]
    for s in seqs:
        engine.add(s)
    moves = []
    while engine.has_work():
        engine.step()
        moves += [m.kind for m in engine.last_output.moves]
        engine.pool.check()
        engine.host_pool.check()
    assert "demote" in moves or "preempt" in moves
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(hf_cuda["llama"], p, 40, ignore_eos=True)
    assert engine.pool.num_free == 48 and engine.host_pool.num_free == 24


@pytest.mark.parametrize("pages", [list(range(48)), [5, 9, 2, 40, 41, 7], list(range(63, 15, -1))])
def test_page_writer_into_cuda_pool(pages):
    """Raw bytes through the pinned staging buffers into a CUDA pool, pieces cut anywhere."""
    from tests.transport.test_transport_units import scatter_and_check

    n_rows = 8 * len(pages)
    scatter_and_check(pages, [], device="cuda")
    scatter_and_check(pages, [1, n_rows // 3, n_rows // 2 + 1, n_rows - 1], device="cuda")


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_zmq_cuda_pools_bit_identical(kind, peers, tmp_path):  # noqa: F811
    from kv_transport import TransportConfig

    endpoint = f"ipc://{tmp_path}/rx.sock" if kind == "ipc" else "tcp://127.0.0.1:0"
    peer = peers("--endpoint", endpoint, "--chunk-bytes", str(256 * 1024), "--device", "cuda")
    config = TransportConfig(endpoint=peer.endpoint(), chunk_bytes=256 * 1024, transfer_timeout_s=20.0)
    run(send_ragged(config, peer, device="cuda"))


@pytest.mark.parametrize("src", ["cuda", "cpu"])
def test_shm_over_cuda_ipc_bit_identical(src, peers, tmp_path):  # noqa: F811
    """--transport shm into a GPU pool of another process: the receiver shares its pool by a
    CUDA IPC handle, the sender writes each piece with a device copy (from a GPU pool) or
    from host bytes (a CPU pool). Strict shm: a pool it could not open fails the transfer."""
    from kv_transport import TransportConfig

    peer = peers("--backend", "shm", "--endpoint", f"ipc://{tmp_path}/rx.sock", "--chunk-bytes",
                 str(256 * 1024), "--device", "cuda")
    config = TransportConfig(backend="shm", endpoint=peer.endpoint(), chunk_bytes=256 * 1024, transfer_timeout_s=20.0)
    run(send_ragged(config, peer, device=src))


def test_disagg_on_one_gpu_over_cuda_ipc(llama_dir, hf_cuda, tmp_path):
    """A 1P+1D cluster on one GPU, --transport shm: the decode node's pool is shared by a CUDA
    IPC handle and the prefill node writes its hand-offs into it with device copies. Outputs
    equal generate on the same GPU; the prefill node counts its one-sided hand-offs."""
    import json
    import urllib.request

    from cluster_util import all_pages_free, get_json, launched, wait_until

    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--transport", "shm", "--kv-pages", "600",
                  "--", "--device", "cuda") as (url, _):
        vocab = get_json(f"{url}/v1/models")["data"][0]["vocab_size"]
        model = get_json(f"{url}/v1/models")["data"][0]["id"]
        for p in make_prompts((17, 300, 260), vocab, seed=5):
            body = json.dumps({"model": model, "prompt": p, "max_tokens": 6, "temperature": 0,
                               "return_token_ids": True, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got = json.loads(r.read())["choices"][0]["token_ids"]
            assert got == hf_greedy(hf_cuda["llama"], p, 6, ignore_eos=True), f"prompt of {len(p)} tokens"
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")
        wait_until(lambda: [n for n in get_json(f"{url}/cluster") if n["role"] == "prefill"][0]["extra"]
                   ["kv_transfers_one_sided"] == 2, 10, what="two one-sided hand-offs")
