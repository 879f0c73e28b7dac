"""The request path's fixed latencies, read from real runs' results files (`pdtb sim calibrate
--results`), so that the simulator's messages take as long as the machine's do.

From each finished request's stamps (wall clock, every process on one host) and the client's
own times:

    rpc_latency_s      router_arrival -> prefill_queued, the router's dispatch and one message to a
                       node, at no prompt (the simulator's rpc latency, every process-to-process
                       message): the intercept of a median (least absolute deviations) line in
                       the prompt's tokens, whose slope is
    dispatch_s_per_token the router's and the node's work per prompt token on the way in
                       (tokens to ids, the message's bytes; on the reference machine a
                       24-token prompt arrived in 1.2 ms, a 1984-token one in 3.6-4.0)
    client_latency_s   (median of the client's TTFT - (first_token - router_arrival), the client's
                       request up plus the first token's way back) minus one rpc latency, halved:
                       the client's leg each way
    transfer_latency_s of requests handed off without being held (first_token -> transfer_end:
                       the prefill node's loop after the step, the pages gathered, the transport;
                       no time held at the prefill node: the simulator makes deferrals and retries
                       itself): the median of that time less its bytes over the link, less the
                       time the decode node was inside a step (`steps`, its step logs' (start,
                       end) spans, where given: a simulated decode node takes the header and the
                       landing after the step in progress, so a fit that kept those waits would
                       count them twice; the prefill node's steps stay in, since a simulated
                       payload does not wait for them), less one rpc latency (the header's)
    transfer_latency_q the same at step_samples.OVERHEAD_QS, with MIN_DRAWN hand-offs or more:
                       what `pdtb sim calibrate --draw-handoff` draws each hand-off's from
    modes              the same fit of each mode's runs apart ({"colocated": {...}, "disagg":
                       {...}}, a mode with MIN_REQUESTS requests or more; the results files'
                       meta.mode): the two paths differ (on the reference machine a minnow's
                       client legs and first token back took 2.2 ms colocated, 2.8-3.0 from a
                       prefill node), and a simulated cluster takes its own mode's
"""
from __future__ import annotations

import bisect
import statistics

from pdtb.sim.step_samples import overhead_quantiles

MIN_REQUESTS = 5  # fewer finished requests with stamps: nothing is fitted
MIN_DRAWN = 20  # fewer hand-offs: no distribution to draw from


def fit_path(results: list[dict], bytes_per_s: float, steps: list[tuple[float, float]] | None = None) -> dict | None:
    """The path latencies of the runs in `results` (results files' objects), or None when they
    hold fewer than MIN_REQUESTS finished requests with the stamps. `steps`: the (start, end)
    times of the same runs' decode nodes' steps, any order, overlapping or not."""
    out = _fit(results, bytes_per_s, steps)
    if out is None:
        return None
    modes = {}
    for mode in sorted({m for d in results if (m := (d.get("meta") or {}).get("mode"))}):
        got = _fit([d for d in results if (d.get("meta") or {}).get("mode") == mode], bytes_per_s, steps)
        if got:
            got.pop("transfer_latency_q", None)  # (drawn from every run's hand-offs)
            modes[mode] = got
    if modes:
        out["modes"] = modes
    return out


def _fit(results: list[dict], bytes_per_s: float, steps: list[tuple[float, float]] | None) -> dict | None:
    busy = Cover(steps or [])
    dispatch, tokens, overhead, transfer = [], [], [], []
    for doc in results:
        for r in doc.get("requests", []):
            t = r.get("server_timing") or {}
            s = t.get("stamps") or {}
            if r.get("status") != "ok" or r.get("first_token_time") is None or \
                    not {"router_arrival", "prefill_queued", "first_token"} <= set(s):
                continue
            dispatch.append(s["prefill_queued"] - s["router_arrival"])
            tokens.append(int(r.get("prompt_tokens") or 0))
            overhead.append((r["first_token_time"] - r["send_time"]) - (s["first_token"] - s["router_arrival"]))
            held = ((t.get("slo") or {}).get("components") or {}).get("held_at_prefill") or 0.0
            if "transfer_start" in s and "transfer_end" in s and not held > 0:
                a, b = s["first_token"], s["transfer_end"]
                nbytes = (t.get("kv_bytes") or {}).get("received", 0)
                transfer.append(b - a - busy.within(a, b) - nbytes / bytes_per_s)
    if len(dispatch) < MIN_REQUESTS:
        return None
    rpc, per_token = median_line(tokens, dispatch)
    client = max(0.0, (statistics.median(overhead) - rpc) / 2)
    out = {"rpc_latency_s": round(rpc, 6), "dispatch_s_per_token": round(per_token, 9),
           "client_latency_s": round(client, 6), "requests": len(dispatch)}
    if len(transfer) >= MIN_REQUESTS:
        out["transfer_latency_s"] = round(max(0.0, statistics.median(transfer) - rpc), 6)
        out["transfers"] = len(transfer)
        out["steps_left_out"] = bool(steps)
    levels = overhead_quantiles([max(0.0, x - rpc) for x in transfer], MIN_DRAWN)
    if levels:
        out["transfer_latency_q"] = levels
    return out


def median_line(x: list[float], y: list[float], rounds: int = 50) -> tuple[float, float]:
    """(intercept, slope) of the least-absolute-deviations line through the points (a median
    of y given x, so a few slow dispatches do not tilt it; iteratively reweighted least
    squares), both clamped at 0; with one distinct x, (median y, 0)."""
    import numpy as np

    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(set(xs.tolist())) < 2:
        return max(0.0, float(np.median(ys))), 0.0
    a = np.vstack([np.ones_like(xs), xs]).T
    w = np.ones_like(ys)
    coef = np.zeros(2)
    for _ in range(rounds):
        coef = np.linalg.lstsq(a * w[:, None], ys * w, rcond=None)[0]
        w = 1.0 / np.sqrt(np.maximum(np.abs(ys - a @ coef), 1e-6))
    if coef[1] < 0:
        return max(0.0, float(np.median(ys))), 0.0
    return max(0.0, float(coef[0])), float(coef[1])


class Cover:
    """The union of (start, end) spans, asked how much of a window it covers. Built at once from
    spans in any order (the decode nodes' logged steps), or span by span in time order (a
    simulated node's steps, pdtb/sim/contention.py), keeping only a recent window if pruned."""

    def __init__(self, spans: list[tuple[float, float]] = ()) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        for a, b in sorted(spans):
            self.add(a, b)

    def add(self, start: float, end: float) -> None:
        """A span that starts no earlier than any before it; one that overlaps the last joins it."""
        if self.starts and start <= self.ends[-1]:
            self.ends[-1] = max(self.ends[-1], end)
        elif end > start:
            self.starts.append(start)
            self.ends.append(end)

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] inside the spans."""
        got, i = 0.0, max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.starts) and self.starts[i] < b:
            got += max(0.0, min(b, self.ends[i]) - max(a, self.starts[i]))
            i += 1
        return got

    def prune(self, before: float) -> None:
        """Forget spans that ended before `before` (a simulated node keeps the last window's alone)."""
        k = bisect.bisect_left(self.ends, before)
        if k > 64:  # (amortised: a list slice per 64 spans, not per step)
            del self.starts[:k], self.ends[:k]
