"""The campaign's independent checker. It knows nothing of the cluster's engine: its reference
is transformers' own `generate` on the same checkpoint (greedy, end-of-sequence ignored as the
load asks), computed here once per prompt of the pool at the longest output asked for. A
greedy output of n tokens is the first n of a longer one.

    outcome      what it is                                                   a violation?
    completed    [DONE], a finish reason, no error, the tokens equal generate's  no
    wrong        completed, but the tokens differ (lost, duplicated, other)    yes
    cut-router   its stream broke, and the router was killed while it was open  no
    cut-client   closed by its client (a client-cut fault)                      no
    refused      never taken (connection refused, 503) within the retry bound: no if a router kill
                 came in that time, else yes
    error        an error event or an HTTP error                               yes
    broken       the stream broke with no router kill in its life              yes
    unended      no end within the bound                                        yes
"""
from __future__ import annotations

from pdtb.chaos.load import END_S, Request


def holds_nothing(nodes: list[dict]) -> bool:
    """Every node (its /stats, or its /cluster entry) holds no page, device or host, and runs
    and queues nothing; False for no node at all."""
    return bool(nodes) and all(n["pages_free"] == n["pages_total"] and n["host_pages_free"] == n["host_pages_total"]
                               and n["running"] == 0 and n["waiting"] == 0 for n in nodes)


def reference(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers.generate, greedy, one prompt at a time, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early: the load asks ignore_eos
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
            out.append(ids[0, len(p):].tolist())
    return out


def outcome(r: Request, ref: list[list[int]], router_kills: list[float]) -> tuple[str, str]:
    """(outcome, what is wrong: "" unless a violation)."""
    killed = any(r.t_sent - 1.0 <= t <= (r.t_end or r.t_sent + END_S) for t in router_kills)
    if r.cut == "client":
        return "cut-client", ""
    if r.exc and r.exc.startswith("did not end"):
        return "unended", r.exc
    if r.status == 0 and r.exc:
        return ("refused", "") if killed else ("refused", f"never taken, with no router kill meanwhile: {r.exc}")
    if r.error or r.status != 200:
        return "error", r.error or f"HTTP {r.status}"
    if r.exc or not r.done:
        return ("cut-router", "") if killed else ("broken", r.exc or "no [DONE]")
    want = ref[r.prompt][:r.max_tokens]
    if r.token_ids != want:
        i = next((i for i, (a, b) in enumerate(zip(r.token_ids, want)) if a != b), min(len(r.token_ids), len(want)))
        return "wrong", (f"{len(r.token_ids)} tokens against generate's {len(want)}; first difference at token {i}: "
                         f"{r.token_ids[i:i + 4]} against {want[i:i + 4]}")
    return "completed", ""


def verdicts(requests: list[Request], ref: list[list[int]], router_kills: list[float],
             faults: list[dict]) -> tuple[dict[str, int], list[dict]]:
    """Requests by outcome, and each violation with its request's timeline and the faults
    injected in its life."""
    counts: dict[str, int] = {}
    violations = []
    for r in requests:
        kind, wrong = outcome(r, ref, router_kills)
        counts[kind] = counts.get(kind, 0) + 1
        if wrong:
            end = r.t_end or r.t_sent + END_S
            violations.append({"kind": kind, "what": wrong, "request": r.to_json(),
                               "faults_meanwhile": [f for f in faults if r.t_sent - 20.0 <= f["done_at_s"] <= end]})
    return counts, violations


def rss_growth(samples: dict[str, list[tuple[float, int]]], settle_s: float) -> dict[str, dict]:
    """Per node process (NAME pid N), RSS at its first sample `settle_s` after its first one, at
    its last sample, and their ratio (a process sampled for less than that is left out)."""
    out = {}
    for key, pts in samples.items():
        if not pts or pts[-1][0] - pts[0][0] < 2 * settle_s:
            continue
        base = next(rss for t, rss in pts if t - pts[0][0] >= settle_s)
        out[key] = {"rss_mib_settled": round(base / 2**20, 1), "rss_mib_last": round(pts[-1][1] / 2**20, 1),
                    "growth": round(pts[-1][1] / base, 4), "seconds": round(pts[-1][0] - pts[0][0], 1)}
    return out
