"""`pdtb bench serve`: build a workload, run it against a router, summarize, write the results.

  pdtb bench serve --url http://127.0.0.1:8000 --workload whale-minnow --seed 1 --out r.json
  pdtb bench serve --url URL --workload multi-tenant --tenants-file tenants.json --concurrency 8
  pdtb bench serve --url URL --workload trace:../shared/traces/vtc_multitenant_600s.jsonl \\
      --time-scale 0.1 --length-scale 0.25 --max-context 1024 --max-requests 200
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

import aiohttp

from pdtb.client import workloads as wl
from pdtb.client.prefix import ideal_hit_rate, prefix_figures, salted_blocks, with_system_prompts
from pdtb.figures.records import OK
from pdtb.figures.results import build_results, format_table, server_labels, server_policy_info, write_results
from pdtb.client.load import RunConfig, run
from pdtb.figures.service import ServiceWeights
from pdtb.figures.summary import SLO_KEYS, summarize
from pdtb.client.traces import read_trace, trace_specs
from pdtb.common import freeze_heap


def _at_least(least: int):
    """An argparse type: a whole number >= `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        return value
    return parse


def _positive(kind):
    """An argparse type: a number of `kind` above zero (a clear usage error otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < value < float("inf"):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def _float_in(lo: float, hi: float = float("inf")):
    """An argparse type: a finite number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (lo <= value <= hi and value < float("inf")):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{lo:g}, {hi:g}], got {text}" if hi < float("inf")
                                             else f"must be {lo:g} or more, got {text}")
        return value
    return parse


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdtb bench serve", description="Load-test a pd-testbed router.")
    ap.add_argument("--url", help="router base URL, e.g. http://127.0.0.1:8000 (not needed with --dry-run)")
    ap.add_argument("--workload", required=True, help="whale-minnow | multi-tenant | trace:FILE")
    ap.add_argument("--out", help="results JSON to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=_positive(int), help="closed loop with N in flight (default: open loop)")
    ap.add_argument("--warmup", type=_positive(int), default=0,
                    help="N requests (4 output tokens each) sent and awaited first, not recorded")
    ap.add_argument("--max-concurrency", type=_positive(int),
                    help="at most N requests in flight; later arrivals wait for a slot (open loop too)")
    ap.add_argument("--duration", type=_positive(float), help="seconds of arrivals (whale-minnow: 30, multi-tenant: 60)")
    ap.add_argument("--max-requests", type=_positive(int), help="keep only the first N requests")
    ap.add_argument("--burstiness", type=_positive(float), default=1.0,
                    help="random arrivals (minnows, multi-tenant): 1 Poisson, <1 burstier, >1 more even (gamma gaps)")
    g = ap.add_argument_group("whale-minnow (lengths: N | uniform:LO:HI | lognormal:MEDIAN:SIGMA)")
    d = wl.WhaleMinnowConfig()
    g.add_argument("--whales", type=int, default=d.whales)
    g.add_argument("--whale-prompt", default=d.whale_prompt)
    g.add_argument("--whale-output", default=d.whale_output)
    g.add_argument("--whale-start", type=float, default=d.whale_start, help="first whale's send time, s")
    g.add_argument("--whale-interval", type=float, default=None,
                   help="seconds between whales (default: spread evenly over the duration)")
    g.add_argument("--minnow-rate", type=float, default=d.minnow_rate, help="minnows per second")
    g.add_argument("--minnow-prompt", default=d.minnow_prompt)
    g.add_argument("--minnow-output", default=d.minnow_output)
    g.add_argument("--whale-tenants", type=_csv, default=d.whale_tenants, help="comma list")
    g.add_argument("--minnow-tenants", type=_csv, default=d.minnow_tenants, help="comma list")
    g.add_argument("--whale-priority", type=int)
    g.add_argument("--minnow-priority", type=int)
    g.add_argument("--whale-tier", help="SLO tier sent with every whale (slo_tier; default: the router's tenant default)")
    g.add_argument("--minnow-tier", help="SLO tier sent with every minnow")
    g.add_argument("--context-whales", type=int, default=d.context_whales,
                   help="long-context whales besides --whales: nearly all prompt (as the longest requests "
                        "of real traces), in class whale")
    g.add_argument("--context-whale-prompt", default=d.context_whale_prompt)
    g.add_argument("--context-whale-output", default=d.context_whale_output)
    g.add_argument("--context-whale-start", type=float, help="first long-context whale's send time, s "
                   "(default: --whale-start)")
    g.add_argument("--context-whale-interval", type=float,
                   help="seconds between long-context whales (default: spread evenly over the duration)")
    g = ap.add_argument_group("multi-tenant (or --tenants-file, see pdtb/client/workloads.py)")
    g.add_argument("--tenants-file", help="JSON tenants spec")
    g.add_argument("--num-tenants", type=int, default=4)
    g.add_argument("--rate", type=float, default=4.0, help="total requests/s, split by --weights")
    g.add_argument("--weights", type=lambda s: [float(x) for x in _csv(s)], help="comma list, one per tenant")
    g.add_argument("--prompt", default="lognormal:128:0.5", help="prompt length distribution")
    g.add_argument("--output", default="uniform:16:64", help="output length distribution")
    g.add_argument("--on", type=float, help="on-phase seconds (with --off)")
    g.add_argument("--off", type=float, default=0.0, help="off-phase seconds")
    g = ap.add_argument_group("trace replay")
    g.add_argument("--length-scale", type=_positive(float), default=1.0, help="multiply both lengths (at most 1e6)")
    g.add_argument("--max-context", type=_at_least(2), help="clamp prompt+output to this many tokens (>= 2)")
    g.add_argument("--time-scale", type=_positive(float), default=1.0, help="multiply arrival offsets (0.1 = 10x faster)")
    g.add_argument("--block-tokens", type=_at_least(1),
                   help="tokens per hash_ids block (default: 512 x --length-scale, rounded, at least 1)")
    g = ap.add_argument_group("shared prefixes (whale-minnow, multi-tenant, traces without hash_ids)")
    g.add_argument("--system-prompt-tokens", type=_at_least(1),
                   help="each tenant's prompts open with its own fixed system prompt of N tokens")
    g.add_argument("--shared-system-prompts", type=_at_least(1), metavar="K",
                   help="with --system-prompt-tokens: K system prompts, the tenants taking turns over them")
    g = ap.add_argument_group("requests")
    g.add_argument("--model", help="model name to send (default: the served one)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="completions: token-id prompts to /v1/completions; chat: the same ids as text, one user "
                        "message to /v1/chat/completions (prompt lengths then are what the template makes: the "
                        "server's usage is recorded)")
    g.add_argument("--tokenizer", help="chat: checkpoint dir whose tokenizer turns prompt ids into text "
                                       "(default: the embedded model)")
    g.add_argument("--vocab-size", type=_at_least(1), help="default: from /v1/models")
    g.add_argument("--max-model-len", type=_at_least(2), help="default: from /v1/models")
    g.add_argument("--min-token-id", type=_at_least(0), default=16, help="prompt ids are drawn from [this, vocab)")
    g.add_argument("--temperature", type=_float_in(0.0, 2.0), default=0.0, help="in [0, 2], as the router takes it")
    g.add_argument("--no-token-ids", action="store_true", help="count tokens by chunk, not token_ids")
    g.add_argument("--request-timeout", type=_positive(float), default=600.0, help="s without a byte before failing")
    g.add_argument("--api-key")
    g = ap.add_argument_group("measurement and labels")
    g.add_argument("--sample-interval", type=_float_in(0.0), default=0.5, help="s between /cluster samples (0: off)")
    g.add_argument("--slo", action="append", default=[], metavar="KEY=MS", help=f"{', '.join(SLO_KEYS)}")
    g.add_argument("--service-weights", default="1,2", help="service per input,output token")
    g.add_argument("--fairness-window", type=_positive(float), default=1.0, help="s per window of the service gap")
    g.add_argument("--label-mode", help="mode label (default: from /cluster)")
    g.add_argument("--label-policy", help="policy label (default: from /cluster)")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    g.add_argument("--dry-run", action="store_true", help="print the request list's shape; send nothing")
    return ap


def arrival_label(a: argparse.Namespace) -> str:
    """How requests were sent, for the results' meta and the report."""
    if a.concurrency:
        label = f"closed-loop x{a.concurrency}"
    elif a.workload.startswith("trace:"):
        label = "trace replay (open loop)"
    elif a.workload == "whale-minnow":
        minnows = "poisson" if a.burstiness == 1.0 else f"gamma (burstiness {a.burstiness:g})"
        label = f"whales at fixed times, {minnows} minnows (open loop)"
    else:
        label = "poisson (open loop)" if a.burstiness == 1.0 else f"gamma, burstiness {a.burstiness:g} (open loop)"
    return label + (f", at most {a.max_concurrency} in flight" if a.max_concurrency else "")


def parse_slos(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo {item!r}: want KEY=MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: the target must be a number of ms") from None
        if not 0 < out[key] < float("inf"):
            raise ValueError(f"--slo {item!r}: the target must be a positive number of ms")
    return out


def build_workload(a: argparse.Namespace) -> tuple[list[wl.RequestSpec], dict]:
    """The request list and what describes it in meta (trace scaling included)."""
    if not a.workload.startswith("trace:"):  # (a trace flag on a generated workload would be ignored)
        given = [flag for flag, v, unset in (("--time-scale", a.time_scale, 1.0), ("--length-scale", a.length_scale, 1.0),
                                             ("--max-context", a.max_context, None),
                                             ("--block-tokens", getattr(a, "block_tokens", None), None)) if v != unset]
        if given:
            raise ValueError(f"{', '.join(given)}: trace replay only; the {a.workload} workload takes its own rates "
                             f"and lengths")
    if a.workload == "whale-minnow":
        cfg = wl.WhaleMinnowConfig(a.whales, a.whale_prompt, a.whale_output, a.whale_start, a.minnow_rate,
                                   a.minnow_prompt, a.minnow_output, a.duration or 30.0, a.whale_tenants,
                                   a.minnow_tenants, a.whale_priority, a.minnow_priority,
                                   whale_interval=a.whale_interval, burstiness=a.burstiness,
                                   context_whales=a.context_whales, context_whale_prompt=a.context_whale_prompt,
                                   context_whale_output=a.context_whale_output,
                                   context_whale_start=a.context_whale_start,
                                   context_whale_interval=a.context_whale_interval,
                                   whale_tier=a.whale_tier, minnow_tier=a.minnow_tier)
        specs, info = wl.whale_minnow(cfg, a.seed), {"whale_minnow": vars(cfg)}
        tenants = list(dict.fromkeys(cfg.whale_tenants + cfg.minnow_tenants))
    elif a.workload == "multi-tenant":
        if a.tenants_file:
            with open(a.tenants_file) as f:
                tenants, file_duration = wl.parse_tenants(json.load(f))
        else:
            tenants, file_duration = wl.even_tenants(a.num_tenants, a.rate, a.weights, a.prompt, a.output,
                                                     a.on, a.off), None
        duration = a.duration or file_duration or 60.0
        specs = wl.multi_tenant(tenants, duration, a.seed, a.burstiness)
        info = {"tenants": [dict(vars(t), prompt=vars(t.prompt), output=vars(t.output)) for t in tenants],
                "duration": duration, "burstiness": a.burstiness}
        tenants = [t.name for t in tenants]
    elif a.workload.startswith("trace:"):
        path = a.workload[len("trace:"):]
        rows, fmt = read_trace(path)
        specs, scaling = trace_specs(rows, a.length_scale, a.max_context, a.time_scale, a.max_requests,
                                     getattr(a, "block_tokens", None))
        specs = salted_blocks(specs, a.seed)  # a sweep's periods (seed + k) are other users' prompts
        info, tenants = {"trace": {"file": path, "format": fmt, "rows": len(rows), **scaling}}, None
    else:
        raise ValueError(f"unknown workload {a.workload!r} (whale-minnow, multi-tenant or trace:FILE)")
    if a.max_requests is not None:
        specs = specs[:a.max_requests]
    tokens, shared = getattr(a, "system_prompt_tokens", None), getattr(a, "shared_system_prompts", None)
    if shared and not tokens:
        raise ValueError("--shared-system-prompts needs --system-prompt-tokens")
    if tokens:
        specs = with_system_prompts(specs, tokens, tenants, shared)
        info["system_prompts"] = {"tokens": tokens, "shared": shared}
    return specs, info


async def server_info(url: str, api_key: str | None) -> tuple[dict, list | None]:
    """(`/v1/models` data[0], `/cluster` nodes or None)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15), headers=headers) as s:
        async with s.get(url + "/v1/models") as r:
            r.raise_for_status()
            model = (await r.json())["data"][0]
        try:
            async with s.get(url + "/cluster") as r:
                nodes = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, ValueError):
            nodes = None
    return model, nodes


def describe(specs: list[wl.RequestSpec]) -> str:
    """One paragraph about a request list (for --dry-run)."""
    if not specs:
        return "0 requests"
    by_class = Counter(s.klass for s in specs)
    parts = [f"{len(specs)} requests over {specs[-1].send_time:.1f} s, {len({s.tenant for s in specs})} tenants"]
    for k, n in sorted(by_class.items()):
        ks = [s for s in specs if s.klass == k]
        parts.append(f"  class {k}: {n} requests, mean prompt {sum(s.prompt_len for s in ks) / n:.0f}, "
                     f"mean output {sum(s.output_len for s in ks) / n:.0f} tokens")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        slos = parse_slos(a.slo)
        try:
            w_in, w_out = (float(x) for x in _csv(a.service_weights))
        except ValueError:
            w_in = w_out = -1.0  # (not two numbers)
        if not (0 <= w_in < float("inf") and 0 <= w_out < float("inf") and w_in + w_out > 0):
            raise ValueError(f"--service-weights {a.service_weights!r}: two finite numbers >= 0, not both 0")
        specs, workload_info = build_workload(a)
    except (ValueError, OSError, KeyError) as e:
        print(f"pdtb bench serve: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(describe(specs))
        trace = workload_info.get("trace")
        if trace and (trace["clamped_by_max_context"] or trace["outputs_raised_to_one"]):
            print(f"  trace: {trace['clamped_by_max_context']} request(s) clamped by --max-context "
                  f"(prompt cut, output kept), {trace['outputs_raised_to_one']} output length(s) of 0 sent as 1")
        ideal = ideal_hit_rate(specs)
        if ideal is not None:
            print(f"  ideal prefix hit rate {ideal:.3f} (an unbounded cache; before clamping to the model's context)")
        return 0
    if not a.url:
        print("pdtb bench serve: --url is required (except with --dry-run)", file=sys.stderr)
        return 2
    if not specs:
        print("pdtb bench serve: the workload has no requests", file=sys.stderr)
        return 2
    if a.out:  # found out now, not after the whole run
        problem = _unwritable(a.out)
        if problem:
            print(f"pdtb bench serve: cannot write --out {a.out}: {problem}", file=sys.stderr)
            return 2
    return asyncio.run(_serve(a, specs, workload_info, slos, ServiceWeights(w_in, w_out)))


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written as a results file, or None."""
    import os

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a directory"
    if not os.path.isdir(parent):
        return f"no such directory {parent}"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "permission denied"
    return None


def _why(e: BaseException) -> str:
    """A readable reason for a failed request to the server (aiohttp's reprs are long)."""
    if isinstance(e, aiohttp.ClientResponseError):
        hint = " (pass --api-key)" if e.status == 401 else ""
        return f"HTTP {e.status} {e.message}{hint}"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect to {e.host}:{e.port} ({e.os_error.strerror or e.os_error})"
    if isinstance(e, asyncio.TimeoutError):
        return "no answer in 15 s"
    return f"{type(e).__name__}: {e}"


async def _serve(a, specs, workload_info: dict, slos: dict, weights: ServiceWeights) -> int:
    url = a.url.rstrip("/")
    try:
        model, nodes = await server_info(url, a.api_key)
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        auth = isinstance(e, aiohttp.ClientResponseError) and e.status in (401, 403)
        if auth or isinstance(e, aiohttp.ClientConnectorError) or a.vocab_size is None or a.max_model_len is None:
            extra = "" if auth or isinstance(e, aiohttp.ClientConnectorError) else \
                "; pass --vocab-size and --max-model-len to go on without it"
            print(f"pdtb bench serve: cannot read {url}/v1/models: {_why(e)}{extra}", file=sys.stderr)
            return 1
        model, nodes = {}, None
    vocab, max_len = a.vocab_size or model["vocab_size"], a.max_model_len or model["max_model_len"]
    if a.min_token_id >= vocab:
        print(f"pdtb bench serve: --min-token-id {a.min_token_id} leaves no prompt id below the vocabulary's "
              f"{vocab}", file=sys.stderr)
        return 2
    clamped = 0
    for i, s in enumerate(specs):
        specs[i], changed = wl.clamp_to_context(s, max_len)
        clamped += changed
    if clamped:  # said out loud: a replayed trace is not what it was (also in meta.clamped_to_context)
        print(f"pdtb bench serve: {clamped} request(s) longer than the model's context ({max_len} tokens) "
              f"were shortened to fit it (prompt cut, output kept; --max-context sets a smaller limit)",
              file=sys.stderr)
    trace = workload_info.get("trace")
    if trace and trace["outputs_raised_to_one"]:
        print(f"pdtb bench serve: {trace['outputs_raised_to_one']} trace output length(s) of 0 are sent as 1 token",
              file=sys.stderr)
    mode, policy = server_labels(nodes)
    detokenize = None
    if a.api == "chat":
        from pdtb.engine.tokenizer import load_tokenizer
        from pdtb.engine.model_info import resolve_model_arg

        tok = load_tokenizer(resolve_model_arg(a.tokenizer))
        detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    cfg = RunConfig(url, a.model, vocab, a.min_token_id, a.seed, a.concurrency, a.request_timeout,
                    a.sample_interval, not a.no_token_ids, a.temperature, not a.quiet, a.api_key,
                    a.max_concurrency, a.warmup, api=a.api, detokenize=detokenize)
    freeze_heap()  # the client's own collections would shift the token times it records
    res = await run(specs, cfg)
    summary = summarize(res.records, res.duration, slos, weights, a.fairness_window)
    summary.update(prefix_figures(specs, res.cluster_before, res.cluster_after))
    meta = {"workload": a.workload, "options": vars(a), "seed": a.seed, "url": url,
            "mode": a.label_mode or mode, "policy": a.label_policy or policy,
            "policy_info": server_policy_info(nodes), "start_time": res.start_time, "duration_s": res.duration,
            "arrival": arrival_label(a), "warmup": {"requests": a.warmup, "failed": res.warmup_failed},
            "model": {"id": model.get("id"), "vocab_size": vocab, "max_model_len": max_len},
            "clamped_to_context": clamped, "client_overhead": res.client_overhead, **workload_info}
    print(format_table(summary))  # (first: a results file that cannot be written loses no figure)
    if a.out:
        try:
            write_results(a.out, build_results(meta, res.records, summary, res.samples))
        except OSError as e:
            print(f"pdtb bench serve: cannot write {a.out}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"results: {a.out}")
    if res.records and not any(r.status == OK for r in res.records):
        reasons = Counter((r.error or r.status) for r in res.records)
        print("pdtb bench serve: every request failed; " + "; ".join(
            f"{n} x {why}" for why, n in reasons.most_common(3)), file=sys.stderr)
        return 1
    return 0
