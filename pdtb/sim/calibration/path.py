"""The request path's fixed latencies, read from real runs' results files (`pdtb sim calibrate
--results`), so that the simulator's messages take as long as the machine's do.

From each finished request's stamps (wall clock, every process on one host) and the client's own
times:

    rpc_latency_s        router_arrival -> prefill_queued, the router's dispatch and one message to
                         a node, at no prompt (the simulator's latency of every process-to-process
                         message): the intercept of a median (least absolute deviations) line in
                         the prompt's tokens, whose slope is
    dispatch_s_per_token the router's and the node's work per prompt token on the way in
    client_latency_s     (median of the client's TTFT - (first_token - router_arrival)) minus one
                         rpc latency, halved: the client's leg each way
    transfer_latency_s   of requests handed off without being held (first_token -> transfer_end):
                         the median of that time less its bytes over the link, less the time the
                         decode node was inside a step (a simulated decode node takes a landing
                         after the step in progress, so a fit that kept those waits would count
                         them twice), less one rpc latency (the header's)
    modes                the same fit of each mode's runs apart (a mode with MIN_REQUESTS or more;
                         the results files' meta.mode): the two paths differ, and a simulated
                         cluster takes its own mode's
"""
from __future__ import annotations

import bisect
import statistics

MIN_REQUESTS = 5  # fewer finished requests with stamps: nothing is fitted


def fit_path(results: list[dict], bytes_per_s: float, steps: list[tuple[float, float]] | None = None) -> dict | None:
    """The path latencies of the runs in `results` (results files' objects), or None when they
    hold fewer than MIN_REQUESTS finished requests with the stamps. `steps`: the (start, end)
    times of the same runs' decode nodes' steps, any order."""
    out = _fit(results, bytes_per_s, steps)
    if out is None:
        return None
    modes = {}
    for mode in sorted({m for d in results if (m := (d.get("meta") or {}).get("mode"))}):
        if got := _fit([d for d in results if (d.get("meta") or {}).get("mode") == mode], bytes_per_s, steps):
            modes[mode] = got
    return {**out, "modes": modes} if modes else out


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
    out = {"rpc_latency_s": round(rpc, 6), "dispatch_s_per_token": round(per_token, 9),
           "client_latency_s": round(max(0.0, (statistics.median(overhead) - rpc) / 2), 6),
           "requests": len(dispatch)}
    if len(transfer) >= MIN_REQUESTS:
        out.update(transfer_latency_s=round(max(0.0, statistics.median(transfer) - rpc), 6),
                   transfers=len(transfer), steps_left_out=bool(steps))
    return out


def median_line(x: list[float], y: list[float], rounds: int = 50) -> tuple[float, float]:
    """(intercept, slope) of the least-absolute-deviations line through the points (a median of y
    given x, so a few slow dispatches do not tilt it; iteratively reweighted least squares), both
    clamped at 0; with one distinct x, (median y, 0)."""
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
    """The union of (start, end) spans, in any order, asked how much of a window it covers."""

    def __init__(self, spans: list[tuple[float, float]] = ()) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        for a, b in sorted(spans):
            if self.starts and a <= self.ends[-1]:
                self.ends[-1] = max(self.ends[-1], b)
            elif b > a:
                self.starts.append(a)
                self.ends.append(b)

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] inside the spans."""
        got, i = 0.0, max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.starts) and self.starts[i] < b:
            got += max(0.0, min(b, self.ends[i]) - max(a, self.starts[i]))
            i += 1
        return got
