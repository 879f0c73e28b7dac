"""Shared prompt blocks (trace `hash_ids`, tenants' system prompts), ideal and achieved prefix hit
rates.

Shared prompt prefixes: prompts built from blocks that recur across requests, and the prefix
cache hit rates of a run.

A RequestSpec with `blocks` (ids) and `block_len` (tokens per block) has the prompt

    | block(b0) | block(b1) | block(b2)  ...  | tail (the request's own) |
    |<-- block_len -->|                                     cut at prompt_len

block(b) is `block_len` pseudo-random token ids drawn from (run seed, BLOCK_STREAM, b): the same
in every request of a run that names b, different in another run seed (the warm-up's seed never
warms the run's blocks). Only the blocks the prompt reaches are used (the last one is usually
cut); when the blocks end before the prompt does, the rest comes from the request's own stream
(seed, index), as the whole prompt of a request without blocks does.

Ideal hit rate (an unbounded cache, empty at the first request): requests in send order; the
leading run of a request's blocks that earlier requests sent are hit tokens, each block for as
much of it as was sent before (an earlier request that sent only the first 76 tokens of a block
leaves 76 to hit, and the run stops there); hit tokens / all prompt tokens.

Achieved hit rate: from two `/cluster` readings, right before the first request and right after
the last one ended: over the nodes that compute prompts (roles prefill and colocated), the
increase of `prefix_hit_tokens` / the increase of `prefix_query_tokens` (cumulative NodeStats
counters). A node whose counters went down restarted: it counts from zero.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import numpy as np

from pdtb.figures.records import RequestSpec

BLOCK_STREAM = 0x5EED_B10C  # a seed word no request index stream uses (those are (seed, index))
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces, before --length-scale
PROMPT_ROLES = ("prefill", "colocated")  # the nodes whose caches spare prompt computation


def block_tokens(seed: int, block_id: int, length: int, low: int, vocab: int) -> np.ndarray:
    """The token ids of block `block_id` in a run of `seed`: `length` ids in [low, vocab)."""
    return np.random.default_rng([seed, BLOCK_STREAM, block_id]).integers(low, vocab, length)


def used_blocks(spec: RequestSpec) -> tuple[int, ...]:
    """The blocks the prompt reaches (the last may be cut)."""
    if not spec.blocks:
        return ()
    return spec.blocks[:math.ceil(spec.prompt_len / spec.block_len)]


def prompt_ids(seed: int, index: int, spec: RequestSpec, low: int, vocab: int) -> list[int]:
    """The prompt of request `index`: its blocks, then ids from its own stream (seed, index)."""
    rng = np.random.default_rng([seed, index])
    if not spec.blocks:
        return rng.integers(low, vocab, spec.prompt_len).tolist()
    parts = [block_tokens(seed, b, spec.block_len, low, vocab) for b in used_blocks(spec)]
    covered = spec.block_len * len(parts)
    if covered < spec.prompt_len:
        parts.append(rng.integers(low, vocab, spec.prompt_len - covered))
    return np.concatenate(parts)[:spec.prompt_len].tolist()


def ideal_hit_tokens(specs: list[RequestSpec]) -> tuple[int, int] | None:
    """(hit tokens, prompt tokens) with an unbounded cache (see the module doc); None when no
    request has blocks."""
    if not any(s.blocks for s in specs):
        return None
    sent: dict[int, int] = {}  # block id -> the most tokens of it any request sent
    hit = total = 0
    for s in specs:
        total += s.prompt_len
        leading, pos, mine = True, 0, {}
        for b in used_blocks(s):
            own = min(s.block_len, s.prompt_len - pos)
            if leading:
                got = min(own, sent.get(b, 0))
                hit += got
                leading = got == own
            mine[b] = max(mine.get(b, 0), own)
            pos += own
        for b, n in mine.items():  # after the request: it cannot hit its own blocks
            sent[b] = max(sent.get(b, 0), n)
    return hit, total


def ideal_hit_rate(specs: list[RequestSpec]) -> float | None:
    """Hit tokens / prompt tokens with an unbounded cache; None without blocks."""
    got = ideal_hit_tokens(specs)
    return None if got is None or got[1] == 0 else got[0] / got[1]


def salted_blocks(specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
    """The specs with every block id moved by the workload seed (seed 0: unchanged). Shared
    blocks stay shared within the list; a sweep's periods of one trace (seeds seed + k) share
    none, as new users of the service would not."""
    if not seed:
        return specs
    shift = seed * 0x9E37_79B9_7F4A_7C15
    return [replace(s, blocks=tuple((b + shift) % (1 << 63) for b in s.blocks)) if s.blocks else s for s in specs]


def _stable_id(key: str) -> int:
    """A 63-bit block id from a name (the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def system_prompt_blocks(tenants: list[str], shared: int | None = None) -> dict[str, int]:
    """The system prompt's block id of each tenant: its own, or with `shared` K the
    (i mod K)-th of K prompts for the i-th tenant in the order given."""
    if shared is None:
        return {t: _stable_id(f"system-prompt/tenant/{t}") for t in tenants}
    if shared < 1:
        raise ValueError(f"--shared-system-prompts must be at least 1, got {shared}")
    return {t: _stable_id(f"system-prompt/shared/{i % shared}") for i, t in enumerate(tenants)}


def with_system_prompts(specs: list[RequestSpec], tokens: int, tenants: list[str] | None = None,
                        shared: int | None = None) -> list[RequestSpec]:
    """Every request's prompt opens with its tenant's system prompt of `tokens` tokens (one
    block; a shorter prompt is its first prompt_len tokens). `tenants`: the order --shared-system-prompts
    maps (default: the requests' tenants by name); tenants not in it get prompts of their own."""
    if tokens < 1:
        raise ValueError(f"--system-prompt-tokens must be at least 1, got {tokens}")
    if any(s.blocks for s in specs):
        raise ValueError("--system-prompt-tokens: the requests already share blocks (a trace with hash_ids)")
    order = list(dict.fromkeys(tenants or sorted({s.tenant for s in specs})))
    ids = system_prompt_blocks(order, shared)
    own = system_prompt_blocks(sorted({s.tenant for s in specs} - set(ids)))
    ids.update(own)
    return [replace(s, blocks=(ids[s.tenant],), block_len=tokens) for s in specs]


def _counters(nodes) -> dict[str, tuple[int, int]]:
    """(queried, hit) prefix tokens of each prompt-computing node of a /cluster answer."""
    out = {}
    for n in nodes if isinstance(nodes, list) else []:
        if not isinstance(n, dict) or n.get("role") not in PROMPT_ROLES:
            continue
        extra = n.get("extra") if isinstance(n.get("extra"), dict) else {}
        q = n.get("prefix_query_tokens", extra.get("prefix_query_tokens")) or 0
        h = n.get("prefix_hit_tokens", extra.get("prefix_hit_tokens")) or 0
        out[str(n.get("id"))] = (int(q), int(h))
    return out


def counter_increase(before, after) -> tuple[int, int] | None:
    """(queried, hit) prefix tokens between two /cluster answers, summed over the prompt nodes;
    None when a reading is missing."""
    if before is None or after is None:
        return None
    start = _counters(before)
    queried = hit = 0
    for node, (q, h) in _counters(after).items():
        q0, h0 = start.get(node, (0, 0))
        if q < q0 or h < h0:  # restarted during the run: its counters began again at zero
            q0 = h0 = 0
        queried, hit = queried + q - q0, hit + h - h0
    return queried, hit


def achieved_hit_rate(before, after) -> float | None:
    """Hit / queried prefix tokens over the run; None when no node reported a query."""
    got = counter_increase(before, after)
    return got[1] / got[0] if got and got[0] > 0 else None


def prefix_figures(specs: list[RequestSpec], before, after) -> dict:
    """The results summary's prefix keys."""
    got = counter_increase(before, after)
    return {"prefix_hit_rate": achieved_hit_rate(before, after), "prefix_hit_rate_ideal": ideal_hit_rate(specs),
            "prefix_tokens_queried": None if got is None else got[0],
            "prefix_tokens_hit": None if got is None else got[1]}
