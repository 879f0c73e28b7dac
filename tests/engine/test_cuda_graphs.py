"""The GPU decode path (Triton paged kernel, steps served by bucketed CUDA graphs) against
transformers' generate.

On a GPU: the engine as it runs there (graphs captured and replayed, RMSNorms fused).
Elsewhere: the same runner with the Triton kernels (paged decode, fused RMSNorm) in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest.py) and each graph's function called where a
GPU would replay it, which checks the bucketing, the padding rows and the page tables
(pdtb/engine/cuda_graphs.py) token for token. Skipped where Triton is not installed.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import tests.engine.test_triton_decode  # noqa: E402,F401  (its import adapts Triton's interpreter to numpy 2.4)
from conftest import hf_greedy, make_engine, make_prompts  # noqa: E402
from pdtb.engine import triton_decode  # noqa: E402
from pdtb.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pdtb.engine.runner import ModelRunner  # noqa: E402
from pdtb.engine.sequence import SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gpu_path_engine(model_dir: str, page_size: int, max_num_seqs: int = 256, graphs: bool = True):
    """An engine whose runner decodes through the Triton kernel (and graphs): built by the
    engine itself on a GPU, put together by hand on the CPU."""
    eng = make_engine(model_dir, page_size=page_size, num_pages=2048, device=DEVICE, max_num_seqs=max_num_seqs,
                      cuda_graphs=graphs)
    if DEVICE == "cpu":
        from pdtb.engine.fused_norm import fuse_norms

        assert fuse_norms(eng.model) == 2 * eng.model.config.num_hidden_layers + 1  # as a GPU engine does
        kernel = triton_decode.DecodeKernel(torch.device("cpu"))
        eng.runner = ModelRunner(eng.model, eng.pool.kv, page_size, "cpu", kernel=kernel)
        if graphs:
            eng.runner.graphs = DecodeGraphs(eng.model, eng.pool.kv, page_size, kernel, max_rows=max_num_seqs,
                                             max_len=eng.scheduler.config.max_model_len)
    assert getattr(eng.runner.kernel, "name", "") == "triton"
    assert DEVICE == "cpu" or eng.fused_norms == 2 * eng.model.config.num_hidden_layers + 1
    assert (eng.runner.graphs is not None) == graphs
    return eng


@pytest.mark.parametrize("page_size", [16, 7])
def test_graph_decode_matches_generate(llama_dir, hf_models, page_size):
    """Five rows (bucket 8: three padding rows) whose lengths span pages, ending at different
    steps so the bucket shrinks; every token equals generate's, every page comes back."""
    eng = gpu_path_engine(llama_dir, page_size)
    prompts = make_prompts((1, 5, 17, 40, 70), eng.info.vocab_size, seed=page_size)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 6, 12, 3, 9)]
    hf = hf_models["llama"] if DEVICE == "cpu" else hf_models["llama"].to(DEVICE)
    seqs = eng.generate(prompts, params)
    for p, sp, s in zip(prompts, params, seqs):
        assert s.output_token_ids == hf_greedy(hf, p, sp.max_tokens, ignore_eos=True), f"prompt of {len(p)} tokens"
    graphs = eng.runner.graphs
    assert graphs.disabled is None and graphs.replays > 0
    assert {8, 4, 2} <= set(graphs.graphs)  # 5 rows, then 4, then 2, ... each its bucket
    eng.pool.check()
    assert eng.pool.num_free == eng.pool.num_pages


def test_eager_triton_decode_matches_generate(llama_dir, hf_models):
    """Without graphs: decode rows beside prefill chunks (mixed steps) through the kernel."""
    eng = gpu_path_engine(llama_dir, 16, graphs=False)
    prompts = make_prompts((3, 30, 90), eng.info.vocab_size, seed=1)
    seqs = []
    for p in prompts:  # staggered: later prompts prefill while earlier ones decode
        seqs.append(eng.make_sequence(p, SamplingParams(max_tokens=8, ignore_eos=True)))
        eng.add(seqs[-1])
        eng.step()
    while eng.has_work():
        eng.step()
    hf = hf_models["llama"] if DEVICE == "cpu" else hf_models["llama"].to(DEVICE)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == hf_greedy(hf, p, 8, ignore_eos=True)
    eng.pool.check()


def test_graph_falls_back_for_steps_it_does_not_serve(llama_dir):
    """More rows than the largest bucket, a prefill chunk, or a row past the page-table block
    run eagerly (run() answers None) and leave the graph buffers' padding as it was."""
    eng = gpu_path_engine(llama_dir, 16, max_num_seqs=2)
    graphs = eng.runner.graphs
    assert graphs.buckets == (1, 2)
    from pdtb.engine.runner import BatchChunk

    row = lambda pos, n=1: BatchChunk("r", [5] * n, pos, [0, 1, 2], True)  # noqa: E731
    assert graphs.run([row(3), row(4), row(5)]) is None  # 3 rows > bucket 2
    assert graphs.run([row(0, n=3)]) is None  # a prefill chunk
    assert graphs.run([row(graphs.width * 16)]) is None  # position past max_model_len
    assert graphs.replays == 0 and not graphs.graphs
