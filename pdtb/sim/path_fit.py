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
    transfer_latency_s of requests handed off (transfer_start -> transfer_end): the median of
                       that time less its bytes over the link and one rpc latency (the header's)
"""
from __future__ import annotations

import statistics

MIN_REQUESTS = 5  # fewer finished requests with stamps: nothing is fitted


def fit_path(results: list[dict], bytes_per_s: float) -> dict | None:
    """The path latencies of the runs in `results` (results files' objects), or None when they
    hold fewer than MIN_REQUESTS finished requests with the stamps."""
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
            if "transfer_start" in s and "transfer_end" in s:
                nbytes = (t.get("kv_bytes") or {}).get("received", 0)
                transfer.append(s["transfer_end"] - s["transfer_start"] - nbytes / bytes_per_s)
    if len(dispatch) < MIN_REQUESTS:
        return None
    rpc = max(0.0, statistics.median(dispatch))
    client = max(0.0, (statistics.median(overhead) - rpc) / 2)
    out = {"rpc_latency_s": round(rpc, 6), "client_latency_s": round(client, 6), "requests": len(dispatch)}
    if len(transfer) >= MIN_REQUESTS:
        out["transfer_latency_s"] = round(max(0.0, statistics.median(transfer) - rpc), 6)
        out["transfers"] = len(transfer)
    return out
