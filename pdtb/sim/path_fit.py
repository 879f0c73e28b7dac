"""The request path's fixed latencies, read from real runs' results files (`pdtb sim calibrate
--results`), so that the simulator's messages take as long as the machine's do.

From each finished request's stamps (wall clock, every process on one host) and the client's
own times:

    rpc_latency_s      median of router_arrival -> prefill_queued: the router's dispatch and one
                       message to a node (the simulator's rpc latency, every process-to-process
                       message)
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
    busy = Cover(steps or [])
    dispatch, overhead, transfer = [], [], []
    for doc in results:
        for r in doc.get("requests", []):
            t = r.get("server_timing") or {}
            s = t.get("stamps") or {}
            if r.get("status") != "ok" or r.get("first_token_time") is None or \
                    not {"router_arrival", "prefill_queued", "first_token"} <= set(s):
                continue
            dispatch.append(s["prefill_queued"] - s["router_arrival"])
            overhead.append((r["first_token_time"] - r["send_time"]) - (s["first_token"] - s["router_arrival"]))
            held = ((t.get("slo") or {}).get("components") or {}).get("held_at_prefill") or 0.0
            if "transfer_start" in s and "transfer_end" in s and not held > 0:
                a, b = s["first_token"], s["transfer_end"]
                nbytes = (t.get("kv_bytes") or {}).get("received", 0)
                transfer.append(b - a - busy.within(a, b) - nbytes / bytes_per_s)
    if len(dispatch) < MIN_REQUESTS:
        return None
    rpc = max(0.0, statistics.median(dispatch))
    client = max(0.0, (statistics.median(overhead) - rpc) / 2)
    out = {"rpc_latency_s": round(rpc, 6), "client_latency_s": round(client, 6), "requests": len(dispatch)}
    if len(transfer) >= MIN_REQUESTS:
        out["transfer_latency_s"] = round(max(0.0, statistics.median(transfer) - rpc), 6)
        out["transfers"] = len(transfer)
        out["steps_left_out"] = bool(steps)
    levels = overhead_quantiles([max(0.0, x - rpc) for x in transfer], MIN_DRAWN)
    if levels:
        out["transfer_latency_q"] = levels
    return out


class Cover:
    """The union of (start, end) spans, asked how much of a window it covers."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            elif b > a:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.spans = merged

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] inside the spans."""
        got, i = 0.0, max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.spans) and self.spans[i][0] < b:
            got += max(0.0, min(b, self.spans[i][1]) - max(a, self.spans[i][0]))
            i += 1
        return got
