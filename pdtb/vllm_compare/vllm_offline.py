"""vLLM's side of the offline comparison, run by vLLM's own Python (scripts/vs_vllm.sh builds
it): nothing of the project is imported here, only the standard library and vllm.

    .venv-vllm/bin/python pdtb/vllm_compare/vllm_offline.py JOB.json OUT.json

JOB: {"model": DIR, "prompts": [[ids...], ...], "max_tokens": N, "kv_blocks": N, "block_size": 32,
      "max_num_batched_tokens": N, "reps": N}
OUT: {"token_ids": [[ids...], ...], "seconds": [rep, ...], "output_tokens": N, "vllm": VERSION}
Greedy, end-of-sequence ignored, so every prompt gives max_tokens tokens; the first rep warms
up (its time kept apart). No prefix caching: every rep runs the same prompts, and a cache
would time its lookups instead of the prefills.
"""
from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> int:
    with open(job_path) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", block_size=job.get("block_size", 32),
              num_gpu_blocks_override=job["kv_blocks"], max_num_batched_tokens=job["max_num_batched_tokens"],
              max_model_len=job["max_model_len"], seed=0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    seconds, outs = [], None
    for _ in range(1 + job.get("reps", 1)):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(out_path, "w") as f:
        json.dump({"token_ids": ids, "warmup_s": seconds[0], "seconds": seconds[1:],
                   "output_tokens": sum(len(x) for x in ids), "vllm": vllm.__version__}, f)
    return 0


if __name__ == "__main__":  # (vLLM starts its engine core with spawn: the module is imported again there)
    sys.exit(main(sys.argv[1], sys.argv[2]))
