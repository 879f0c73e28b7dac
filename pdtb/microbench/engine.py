"""`pdtb bench engine`: paged engine vs transformers `generate` on a padded batch, same run."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from pdtb.figures.results import decode_path_label


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # ragged around prompt_len so the padded baseline pays for padding as real batches do
    lens = [max(1, prompt_len + rng.randint(-prompt_len // 4, prompt_len // 4)) for _ in range(batch)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def run_hf(model, prompts, max_tokens: int, pad_id: int) -> float:
    """Seconds for transformers generate over a left-padded batch (fixed output length)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad_id)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + max_tokens
    return dt


def run_paged(engine, prompts, max_tokens: int) -> tuple[float, list[float]]:
    from pdtb.engine.sequence import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add(engine.make_sequence(p, params))
    steps = []
    t0 = time.perf_counter()
    while engine.has_work():
        ts = time.perf_counter()
        engine.step()
        if all(not c.seq.in_prefill or c.seq.num_output_tokens > 1 for c in engine.last_output.chunks):
            steps.append(time.perf_counter() - ts)
    return time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdtb bench engine", description=__doc__)
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: embedded tiny model)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--decode-attention", choices=["auto", "torch"], default="auto",
                    help="the paged engine's decode attention (see EngineConfig.decode_attention)")
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                    help="on a GPU: decode steps replayed from CUDA graphs (see EngineConfig.cuda_graphs)")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved runs per side; the best of each is reported (noise on shared machines only slows a run down)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if min(a.batch, a.prompt_len, a.max_tokens, a.page_size, a.repeat) < 1:
        ap.error("--batch, --prompt-len, --max-tokens, --page-size and --repeat must be at least 1")
    from pdtb.engine.config import EngineConfig
    from pdtb.engine.engine import LLMEngine
    from pdtb.engine.loader import load_model
    from pdtb.engine.loader import resolve_model

    model_dir = resolve_model(a.model)
    try:  # EngineConfig's own checks of the device and dtype, before anything is loaded
        EngineConfig(model_dir, page_size=a.page_size, device=a.device, dtype=a.dtype)
    except ValueError as e:
        ap.error(str(e))
    hf_model, tok, info = load_model(model_dir, a.device, a.dtype, attn_implementation="sdpa")
    longest = a.prompt_len + a.prompt_len // 4 + a.max_tokens  # prompts are drawn up to 1.25x --prompt-len
    if longest > info.max_model_len:
        ap.error(f"--prompt-len and --max-tokens need up to {longest} tokens; the model's context is {info.max_model_len}")
    prompts = _prompts(a.batch, a.prompt_len, info.vocab_size, a.seed)
    pages = sum(-(-(len(p) + a.max_tokens) // a.page_size) for p in prompts) + a.batch
    engine = LLMEngine(EngineConfig(model_dir, page_size=a.page_size, num_pages=pages, device=a.device,
                                    dtype=a.dtype, max_num_batched_tokens=max(2048, a.batch * (a.prompt_len + 32)),
                                    decode_attention=a.decode_attention, cuda_graphs=a.cuda_graphs == "on",
                                    max_num_seqs=max(a.batch, 8)))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    run_hf(hf_model, prompts[:2], 4, pad)  # warm-up both sides
    engine.warm_up()  # on a GPU: every decode bucket's CUDA graph captured here, not in a timed run
    run_paged(engine, prompts[:2], 4)
    hf_s, paged_s, steps = [], [], []
    for _ in range(a.repeat):  # interleaved so machine noise hits both sides alike
        hf_s.append(run_hf(hf_model, prompts, a.max_tokens, pad))
        dt, st = run_paged(engine, prompts, a.max_tokens)
        paged_s.append(dt)
        steps.extend(st)
    total = a.batch * a.max_tokens
    res = {"paged_tok_s": total / min(paged_s), "hf_padded_tok_s": total / min(hf_s)}
    res["ratio"] = res["paged_tok_s"] / res["hf_padded_tok_s"]
    res["ratio_paired_median"] = statistics.median(h / p for h, p in zip(hf_s, paged_s))
    res["step_ms_median"] = 1000 * statistics.median(steps) if steps else None
    res.update(batch=a.batch, prompt_len=a.prompt_len, max_tokens=a.max_tokens, page_size=a.page_size,
               device=a.device, dtype=a.dtype, repeat=a.repeat, torch_threads=torch.get_num_threads(),
               decode_kernel=getattr(engine.runner.kernel, "name", None),
               cuda_graphs=engine.runner.graphs is not None and engine.runner.graphs.disabled is None,
               graph_replays=0 if engine.runner.graphs is None else engine.runner.graphs.replays,
               model=str(model_dir))
    if a.json:
        print(json.dumps(res))
    else:
        how = decode_path_label(res)
        print(f"paged engine : {res['paged_tok_s']:9.1f} tok/s  (median decode step {res['step_ms_median']:.2f} ms; {how})")
        print(f"hf generate  : {res['hf_padded_tok_s']:9.1f} tok/s  (padded batch of {a.batch})")
        print(f"ratio        : {res['ratio']:.2f}x  (best / best; median of the {a.repeat} run pairs "
              f"{res['ratio_paired_median']:.2f}x)")
    return 0
