"""A token's way from its node to the client, drawn token by token (`pdtb sim calibrate
--draw-delivery`).

Without it a simulated token reaches the client a fixed rpc and client latency after its step
ends. A real one does not: the router and the client read it when their loops get to it, on cores
shared with the nodes, and a stream's first tokens wait longest. On the reference machine (fcfs,
quick whale-minnow, colocated) a minnow's first token reached the client 0.9 / 1.3 / 4.5 ms after
its step (p10, p50, p90), its fourth 0.7 / 1.2 / 2.7, and a whale's hundredth 0.8 / 1.1 / 1.4.
The multi-tenant workload, not fitted on, shows the same decay: p90 5.2 ms at a stream's first
token, 2.2 at its fifth, 1.0 from its tenth on. A token read late is read with the next one (the
client stamps every token of one read with one time, pdtb/client/load.py): 9-13% of a real
minnow's intervals are under 0.5 ms and the ones before them are long, a tail a fixed latency
does not make.

Measured from a real run's results file and its decode-side nodes' step logs, on one host (the
results' `meta.start_time` is the wall clock of the client's time 0, the logs' times are wall
clock):
- a first token: the client's time of it less the node's `first_token` stamp;
- a later token k of a request: the client's time less the end of the k-th step that decoded on
  its node after the request got there (`first_token`, or `decode_admit` on a decode node). A
  request counts only where that reaches its `last_token` stamp within MATCH_S: one that sat out
  a step (preempted, parked) is left out, not matched to the wrong step;
- the client's leg up: per request, the client's time to first token less the node's (from
  `router_arrival`) less its first token's delay (it replaces the path's `client_latency_s` on
  the way up, which the path fits as half of up and down together).

Both the first token's delay and the leg up grow with the prompt: the first chunk echoes the
prompt's token ids, and the request carries its text. On the reference machine a 24-token
minnow's first token took 1.33 ms (median), a 1984-token whale's 1.92; their legs up 0.80 and
1.03. Each is a median line in the prompt's tokens (path_fit.median_line); the first token's
levels are of its delay less the line's slope times the prompt.

Kept: levels at step_samples.OVERHEAD_QS of the delay at each of a stream's first POSITIONS
tokens (0: the first token) and of every later one, per mode as the request path is; a position
with fewer than MIN_TOKENS delays takes the later tokens' levels. A simulated token's delay is a
draw from its position's levels, by its request and position alone (plus the first token's part
per prompt token), and a token is never read before the one before it (the same read, then).
"""
from __future__ import annotations

import bisect
import math

from pdtb.sim.path_fit import median_line
from pdtb.sim.step_samples import draw, overhead_quantiles, seconds_levels, unit

MATCH_S = 2e-4  # a request's last token and its k-th decoding step's end: this close, or left out
POSITIONS = 8  # a stream's first tokens, each position drawn from levels of its own
MIN_TOKENS = 20  # fewer delays at a position: no levels of its own (the first token's: no fit)
STREAM = 0xDE11_7E27_0C11_E27A  # keeps the deliveries' draws apart from the steps' and hand-offs'


def delays(doc: dict, ends: list[list[float]]) -> tuple[list[list[float]], list[float]]:
    """(per position under POSITIONS, the delays there; per request (prompt tokens, first token's
    delay, leg up)) of one results file's finished requests, `ends` the decode-side nodes' step
    logs (StepLogRead.decode_ends each, in order) of the run; the last position holds every later
    token's. Nothing without `meta.start_time`."""
    t0 = (doc.get("meta") or {}).get("start_time")
    at, firsts = [[] for _ in range(POSITIONS + 1)], []
    if t0 is None:
        return at, firsts
    for r in doc.get("requests", []):
        s = (r.get("server_timing") or {}).get("stamps") or {}
        times = r.get("token_times") or []
        if r.get("status") != "ok" or not times or not {"first_token", "router_arrival"} <= set(s):
            continue
        first = t0 + times[0] - s["first_token"]
        at[0].append(first)
        firsts.append((int(r.get("prompt_tokens") or 0), first,
                       (times[0] - r["send_time"]) - (s["first_token"] - s["router_arrival"]) - first))
        if len(times) < 2 or "last_token" not in s:
            continue
        start = max(s["first_token"], s.get("decode_admit", 0.0))
        for e in ends:
            i = bisect.bisect_right(e, start + 1e-6)
            j = i + len(times) - 2
            if j < len(e) and abs(e[j] - s["last_token"]) <= MATCH_S:
                for k, t in enumerate(times[1:], 1):
                    at[min(k, POSITIONS)].append(t0 + t - e[i + k - 1])
                break
    return at, firsts


def fit_delivery(runs: list[tuple[dict, list[list[float]]]]) -> dict | None:
    """{"positions": [levels of position 0, 1, ... or None], "later": levels, "first_s_per_token",
    "up_s", "up_s_per_token", "tokens"} of the runs' ((results file, its step logs' decode ends))
    delays; None with fewer than MIN_TOKENS first tokens or later ones."""
    at, firsts = [[] for _ in range(POSITIONS + 1)], []
    for doc, ends in runs:
        got, f = delays(doc, ends)
        for mine, more in zip(at, got):
            mine += more
        firsts += f
    if len(at[0]) < MIN_TOKENS or len(at[-1]) < MIN_TOKENS:
        return None
    prompts = [n for n, _, _ in firsts]
    _, per_token = median_line(prompts, [d for _, d, _ in firsts])
    up, up_per_token = median_line(prompts, [u for _, _, u in firsts])
    at[0] = [d - per_token * n for n, d, _ in firsts]
    return {"positions": [overhead_quantiles([max(0.0, x) for x in d], MIN_TOKENS) for d in at[:-1]],
            "later": overhead_quantiles([max(0.0, x) for x in at[-1]], MIN_TOKENS),
            "first_s_per_token": round(per_token, 10), "up_s": round(up, 6), "up_s_per_token": round(up_per_token, 10),
            "tokens": [len(d) for d in at]}


class Delivery:
    """Each simulated token's delay from its node to the client, by its request and place."""

    def __init__(self, levels: dict) -> None:
        self.later = seconds_levels(levels.get("later"), "delivery later")
        got = levels.get("positions") or []
        if not isinstance(got, list) or not got or got[0] is None:
            raise ValueError("delivery positions: the first token's levels, then each next position's or null")
        self.positions = tuple(self.later if q is None else seconds_levels(q, f"delivery position {i}") for i, q in enumerate(got))
        self.first_s_per_token, self.up_s, self.up_s_per_token = (
            float(levels.get(k, 0.0)) for k in ("first_s_per_token", "up_s", "up_s_per_token"))
        if not all(math.isfinite(x) and x >= 0 for x in (self.first_s_per_token, self.up_s, self.up_s_per_token)):
            raise ValueError("delivery first_s_per_token, up_s, up_s_per_token: non-negative seconds")

    def up(self, prompt_len: int) -> float:
        """The client's leg up with a prompt of `prompt_len` tokens."""
        return self.up_s + self.up_s_per_token * prompt_len

    def delay_s(self, request: int, token: int, prompt_len: int) -> float:
        """The delay of token `token` (0: the first) of the request numbered `request`, whose
        prompt has `prompt_len` tokens: the draw depends on the two numbers alone, so every way
        of simulating a run draws the same."""
        q = self.positions[token] if token < len(self.positions) else self.later
        got = draw(q, unit(((request << 24) | token) ^ STREAM))
        return got + self.first_s_per_token * prompt_len if token == 0 else got

