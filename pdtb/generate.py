"""`pdtb generate` and shared engine flags.

`pdtb generate`: offline batched generation on one paged engine, its requests admitted and
evicted by a fairness policy (`--policy`, `--policy-arg`: pdtb/nodes/fairness_args.py) as a
node's are."""
from __future__ import annotations

import argparse
import json
import sys
import time

from pdtb.common import CliError
from pdtb.engine.loader import resolve_model_arg
from pdtb.nodes.fairness_args import add_fairness_args, fairness_config, policy_args


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine."""
    ap.add_argument("--model", default=None, help="local HF checkpoint dir (default: embedded tiny model)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    ap.add_argument("--kv-pages", type=int, default=4096, help="pages in the device KV pool")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--decode-attention", choices=["auto", "torch"], default="auto",
                    help="auto: decode rows of a float32 CPU pool use the C paged kernel, built at first use "
                         "(falls back to torch where no C compiler works); torch: read cache + batched matmuls")
    ap.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                    help="share the KV pages of full prompt pages among requests whose prompts start the same "
                         "way; a request skips the prefill of its cached prefix (default on)")
    ap.add_argument("--charge-shared", choices=["split", "first", "full"], default="split",
                    help="how a page shared by several requests counts against quotas: split evenly among its "
                         "holders, charged to the first holder, or in full to every holder (default split)")


def engine_config(a: argparse.Namespace, model_dir: str):
    from pdtb.engine.config import EngineConfig

    try:
        return EngineConfig(model_dir, page_size=a.page_size, num_pages=a.kv_pages, device=a.device,
                            dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                            max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                            decode_attention=a.decode_attention, prefix_cache=a.prefix_cache == "on",
                            charge=a.charge_shared)
    except ValueError as e:
        raise CliError(str(e)) from None


def _read_prompts(a: argparse.Namespace) -> list[str]:
    if a.prompts_file:
        try:
            with open(a.prompts_file, encoding="utf-8") as f:
                lines = [ln.rstrip("\n") for ln in f]
        except OSError as e:
            raise CliError(f"cannot read prompts file: {e}") from None
        prompts = [ln for ln in lines if ln]
    else:
        prompts = list(a.prompt or [])
    if not prompts:
        raise CliError("no prompts given (use --prompt TEXT or --prompts-file FILE)")
    return prompts


def make_policy(a: argparse.Namespace):
    """The policy the flags name, built with its settings; a bad reference or setting is a
    CliError before the model loads."""
    from fairness import make_policy as build

    return build(a.policy, fairness_config(a), policy_args(a))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="pdtb generate", description=__doc__)
    add_engine_args(ap)
    add_fairness_args(ap)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help="one prompt per line")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    a = ap.parse_args(argv)
    from pdtb.engine.sequence import SamplingParams

    if a.max_tokens < 1:
        raise CliError(f"--max-tokens must be a positive integer, got {a.max_tokens}")
    prompts = _read_prompts(a)
    policy = make_policy(a)
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                seed=a.seed, ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise CliError(str(e)) from None
    model_dir = resolve_model_arg(a.model)
    from pdtb.engine.engine import LLMEngine

    engine = LLMEngine(engine_config(a, model_dir), policy=policy)
    tok = engine.tokenizer
    ids = [tok.encode(p, add_special_tokens=False) or [tok.bos_token_id or 0] for p in prompts]
    max_len = engine.scheduler.config.max_model_len
    for i, p in enumerate(ids):
        if len(p) >= max_len:
            raise CliError(f"prompt {i} has {len(p)} tokens; the model's context is {max_len}")
        if len(p) + a.max_tokens > max_len:  # the router refuses this; offline, say so and go on
            print(f"pdtb generate: prompt {i}: {len(p)} + {a.max_tokens} tokens exceed the context "
                  f"({max_len}); its output stops at {max_len - len(p)} tokens (finish_reason "
                  f"\"length\")", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        seqs = engine.generate(ids, params)
    except ValueError as e:
        raise CliError(str(e)) from None
    dt = time.perf_counter() - t0
    n_out = sum(s.num_output_tokens for s in seqs)
    for text, s in zip(prompts, seqs):
        out = tok.decode(s.output_token_ids, skip_special_tokens=True)
        if a.json:
            print(json.dumps({"prompt": text, "prompt_token_ids": s.prompt_token_ids,
                              "token_ids": s.output_token_ids, "text": out,
                              "finish_reason": s.finish_reason}, ensure_ascii=False))
        else:
            print(f"--- {text!r}\n{out}")
    print(f"generated {n_out} tokens for {len(seqs)} prompts in {dt:.2f} s: {n_out / dt:.1f} tok/s",
          file=sys.stderr if a.json else sys.stdout)
    return 0
