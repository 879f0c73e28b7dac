"""Offline beside vLLM: seeded prompts, the paged engine and vLLM alternating, identical greedy
outputs and the tokens/s ratio.

Offline, side by side with vLLM: the same checkpoint, prompts and KV budget, greedy, one
thread each; identical outputs and the tokens/s ratio, measured in one run.

    python -m pdtb.vllm_compare.offline --vllm-python .venv-vllm/bin/python [--model DIR]
        [--prompts 32] [--prompt-len 48:80] [--max-tokens 128] [--reps 2] [--out FILE.json]

The vLLM side runs in vLLM's own environment (vllm_offline.py, a child process); the project's
paged engine runs here with one torch thread. The reps of the two alternate (vLLM's process is
started once per rep pair, its warm-up timed apart), so both see the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32  # vLLM's CPU attention takes block sizes that are multiples of 32


def make_prompts(vocab: int, special: set[int], n: int, seed: int, lo: int = 48, hi: int = 80) -> list[list[int]]:
    """`n` prompts of `lo`-`hi` token ids drawn from the vocabulary, special tokens left out."""
    rng = random.Random(seed)
    pool = [t for t in range(vocab) if t not in special]
    return [[rng.choice(pool) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_project(model_dir: str, prompts: list[list[int]], max_tokens: int, kv_tokens: int,
                max_batched: int) -> tuple[list[list[int]], float]:
    """The paged engine's greedy outputs and seconds (after a warm-up on the same prompts)."""
    import torch

    from pdtb.engine.config import EngineConfig
    from pdtb.engine.engine import LLMEngine
    from pdtb.engine.sequence import SamplingParams

    torch.set_num_threads(1)
    # (no prefix cache on either side: the warm-up and every rep run the same prompts, and a
    # cache would time lookups instead of prefills)
    engine = LLMEngine(EngineConfig(model_dir, page_size=16, num_pages=kv_tokens // 16,
                                    max_num_batched_tokens=max_batched, prefix_cache=False))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:4], params)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    return [list(s.output_token_ids) for s in seqs], time.perf_counter() - t0


def run_vllm(python: str, job: dict, tmp: Path) -> dict:
    (tmp / "job.json").write_text(json.dumps(job))
    script = Path(__file__).with_name("vllm_offline.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # (nothing of the project on vLLM's side)
    with open(tmp / "vllm.log", "w") as log:
        subprocess.run([python, str(script), str(tmp / "job.json"), str(tmp / "out.json")], env=env,
                       stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=True)
    return json.loads((tmp / "out.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdtb.vllm_compare.offline", description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the Python of vLLM's environment (scripts/vs_vllm.sh)")
    ap.add_argument("--model", help="checkpoint (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", default="48:80", metavar="LO:HI", help="prompt lengths, drawn uniformly")
    ap.add_argument("--kv-tokens", type=int, default=12800, help="KV budget in tokens, the same on both sides")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.kv_tokens % BLOCK or a.kv_tokens % 16:
        ap.error(f"--kv-tokens must be a multiple of {BLOCK}")
    try:
        lo, hi = (int(x) for x in a.prompt_len.split(":"))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--prompt-len takes LO:HI with 1 <= LO <= HI, not {a.prompt_len!r}")
    from pdtb.engine.model_info import read_model_info, resolve_model_arg
    from pdtb.engine.tokenizer import load_tokenizer

    model_dir = resolve_model_arg(a.model)
    info, tok = read_model_info(model_dir), load_tokenizer(model_dir)
    special = set(info.eos_token_ids) | {t for t in (getattr(tok, "bos_token_id", None), tok.eos_token_id) if t is not None}
    if hi + a.max_tokens > info.max_model_len:
        ap.error(f"--prompt-len {a.prompt_len} plus --max-tokens {a.max_tokens} exceeds the model's {info.max_model_len}")
    prompts = make_prompts(info.vocab_size, special, a.prompts, a.seed, lo, hi)
    job = {"model": model_dir, "prompts": prompts, "max_tokens": a.max_tokens, "kv_blocks": a.kv_tokens // BLOCK,
           "block_size": BLOCK, "max_num_batched_tokens": a.max_num_batched_tokens,
           "max_model_len": info.max_model_len, "reps": 1}
    ours_s, theirs_s, ours, theirs, version = [], [], None, None, ""
    with tempfile.TemporaryDirectory(prefix="pdtb-vs-vllm-") as tmp:
        for _ in range(a.reps):
            got = run_vllm(a.vllm_python, job, Path(tmp))
            theirs, version = got["token_ids"], got["vllm"]
            theirs_s += got["seconds"]
            ours, s = run_project(model_dir, prompts, a.max_tokens, a.kv_tokens, a.max_num_batched_tokens)
            ours_s.append(s)
    n = sum(len(x) for x in ours)
    same = sum(1 for x, y in zip(ours, theirs) if x == y)
    result = {"model": model_dir, "vllm": version, "prompts": len(prompts), "prompt_len": [lo, hi],
              "max_tokens": a.max_tokens,
              "identical": same, "project_tok_s": round(n / statistics.median(ours_s), 1),
              "vllm_tok_s": round(sum(len(x) for x in theirs) / statistics.median(theirs_s), 1),
              "project_s": ours_s, "vllm_s": theirs_s}
    result["ratio"] = round(result["project_tok_s"] / result["vllm_tok_s"], 3)
    print(f"offline, {Path(model_dir).name}, prompts of {lo}-{hi} tokens: greedy outputs identical {same}/{len(prompts)}; "
          f"project {result['project_tok_s']} tok/s, vLLM {version} {result['vllm_tok_s']} tok/s: "
          f"**{result['ratio']:.2f}x** (median of {a.reps}, one thread each)")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
