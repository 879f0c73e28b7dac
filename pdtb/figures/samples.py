"""Server-side samples and their series.

Server-side samples taken during a run (pdtb/client/load.py reads `/cluster`), and the series the plots need.

A sample is {"t": s since the run's start, "nodes": [{"role", "id", "pages_total", "pages_free",
"host_pages_total", "host_pages_free", "running", "waiting", "tenant_pages": {tenant: pages},
"tenant_pages_charged": {tenant: pages}, "tenant_pages_shared": {tenant: pages}, "tenant_host_pages":
{tenant: pages}, "quota": {tenant: device pages of its share}, "kv_bytes_sent",
"kv_bytes_not_sent", "admissions"}]}; each tenant map is {} unless the node reports it in `extra` (pages
charged and shared under the prefix cache's charge rule), the byte counters (prefill nodes'
hand-off payloads, and the bytes left out because the decode node had them cached) None;
`admissions` is a decode node's count of hand-off verdicts so far ({} elsewhere).
"""
from __future__ import annotations

NODE_KEYS = ("role", "id", "pages_total", "pages_free", "host_pages_total", "host_pages_free", "running", "waiting",
             "stale")


def cluster_sample(t: float, nodes: list[dict]) -> dict:
    """One sample from a `/cluster` answer. A `stale` node's figures are its last answer's, not
    what it holds: its pages count for no tenant and as none in use."""
    out = []
    for n in nodes:
        row = {k: n.get(k) for k in NODE_KEYS}
        pages = {} if n.get("stale") else (n.get("extra") or {}).get("tenant_pages") or {}
        row["tenant_pages"] = {str(k): v for k, v in pages.items()} if isinstance(pages, dict) else {}
        extra = n.get("extra") or {}
        for key in ("tenant_pages_charged", "tenant_pages_shared", "tenant_host_pages", "quota"):
            m = extra.get(key)
            row[key] = {str(k): v for k, v in m.items()} if isinstance(m, dict) else {}
        for key in ("kv_bytes_sent", "kv_bytes_not_sent"):
            row[key] = extra.get(key)
        adm = extra.get("admissions")
        row["admissions"] = {str(k): v for k, v in adm.items()} if isinstance(adm, dict) else {}
        out.append(row)
    return {"t": t, "nodes": out}


def tenant_pages_series(samples: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per tenant: sample times and KV pages held, summed over nodes (0 where a sample lacks it).
    Empty when no node ever reported tenant pages."""
    tenants = sorted({t for s in samples for n in s["nodes"] for t in n["tenant_pages"]})
    times = [s["t"] for s in samples]
    return {t: (times, [sum(n["tenant_pages"].get(t, 0) for n in s["nodes"]) for s in samples]) for t in tenants}


def used_pages_series(samples: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Per node role: sample times and pages in use (total - free), summed over that role's nodes."""
    roles = sorted({n["role"] for s in samples for n in s["nodes"]})
    times = [s["t"] for s in samples]
    return {r: (times, [sum((n["pages_total"] or 0) - (n["pages_free"] or 0) for n in s["nodes"]
                            if n["role"] == r and not n.get("stale")) for s in samples]) for r in roles}
