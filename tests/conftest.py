"""Shared fixtures and small factories for the test suite."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The helpers beside this file (cluster_util, chaos_util, app_thread, sched_sim) import by name
# from the test files in every folder below it.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# Triton reads TRITON_INTERPRET when first imported, by whichever test module comes first in a
# worker: without a GPU its kernels run in the interpreter (tests/engine/test_triton_decode.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny checkpoint per supported family, written once per pytest run."""
    from pdtb.engine.tiny_model import ARCHS, init_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(init_tiny_model(root / arch, arch=arch, seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    """Reference models on plain sdpa, for equality checks against transformers.generate."""
    from pdtb.engine.loader import load_model

    return {arch: load_model(d, attn_implementation="sdpa")[0] for arch, d in model_dirs.items()}


def make_engine(model_dir: str, policy=None, **kw):
    """Factory: an LLMEngine with small defaults, overridable per test."""
    from pdtb.engine.config import EngineConfig
    from pdtb.engine.engine import LLMEngine

    kw.setdefault("num_pages", 1024)
    return LLMEngine(EngineConfig(model_dir, **kw), policy=policy)


def make_prompts(lengths, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# Logits this close are a tie in float32: the same prefix computed with other matmul shapes (a
# recomputed stream's prefill against generate's one row a step) may order them either way.
TIE = 1e-4


def assert_greedy_matches(model, prompt: list[int], got: list[int], max_new_tokens: int) -> None:
    """`got` is transformers' greedy output (end-of-sequence ignored), or follows it up to a
    token where the two candidates' logits are within TIE; past a tie the continuations differ."""
    ref = hf_greedy(model, prompt, max_new_tokens, ignore_eos=True)
    if got == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert i is not None, f"{len(got)} tokens against generate's {len(ref)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]], device=model.device)).logits[0, -1].float()
    gap = (logits[ref[i]] - logits[got[i]]).item()
    assert gap <= TIE, f"token {i}: {got[i]} against generate's {ref[i]}, logits {gap:.2e} apart (not a tie)"


def hf_greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers.generate, one prompt at a time, on the model's device: the independent reference."""
    # ignore_eos: keep going past an end-of-sequence token, as the engine does, rather than
    # suppressing it (min_new_tokens would change the token wherever EOS is the top choice)
    kw = {"eos_token_id": -1} if ignore_eos else {}
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=model.config.pad_token_id, **kw)
    return out[0, len(prompt):].tolist()


def prefill_and_move(a, b, prompts: list[list[int]], params) -> tuple[list, list]:
    """Prefill each prompt on engine `a` until its first token, export its pages, import them
    into engine `b`'s pool and hand the sequence to `b`'s scheduler; then decode on `b` until
    done. Returns (sequences, exports), in prompt order."""
    from pdtb.engine.kv_export import export_request, import_request

    moved, exports = [], []
    for p in prompts:
        seq = a.make_sequence(p, params)
        a.add(seq)
        while seq.num_output_tokens == 0:  # prefill until the first token is sampled
            a.step()
        exp = export_request(a.pool, seq.request_id, seq.num_computed_tokens)
        a.scheduler.finish(seq, seq.status, "moved")
        b.pool.allocate("filler-" + seq.request_id, 3)  # make B's page ids differ from A's
        assert import_request(b.pool, exp) is not None
        moved.append(seq)
        exports.append(exp)
    b.scheduler.running.extend(moved)  # inherited requests skip prefill on B
    while b.has_work():
        b.step()
    return moved, exports
