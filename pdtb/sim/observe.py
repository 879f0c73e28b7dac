"""What only a simulation sees: tier moves per class, the top 5%'s share of KV over time, pages per
tenant samples.

What a simulated run sees that a real run cannot see cheaply: every tier move by request
class, the share of KV pages held by the longest 5% of requests over time, and pages per
tenant at every sample (the same sample shape as the client's `/cluster` samples).

Top-5% share, at each sample: over the requests holding device pages on the KV-holding nodes
(decode and colocated), the k = ceil(5% of them) largest footprints; their pages over the pages
in use (`top5_share_used`) and over the whole device tier (`top5_share_pool`).
"""
from __future__ import annotations

import math
from collections import Counter

from pdtb.figures.samples import cluster_sample

TOP_FRAC = 0.05


def top_share(footprints: list[int], total_pages: int, frac: float = TOP_FRAC) -> tuple[float, float]:
    """(share of used pages, share of the pool) held by the largest `frac` of `footprints`."""
    if not footprints:
        return 0.0, 0.0
    k = max(1, math.ceil(frac * len(footprints)))
    top = sum(sorted(footprints, reverse=True)[:k])
    used = sum(footprints)
    return top / used, top / total_pages if total_pages else 0.0


class Observer:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.moves: Counter = Counter()  # (class, kind) -> tier moves
        self.move_pages: Counter = Counter()  # (class, kind) -> pages moved
        self.adopted: Counter = Counter()  # (class, "device" | "host") -> inherited requests landed there
        self.kv_bytes: Counter = Counter()  # class -> KV bytes transferred prefill -> decode
        self.samples: list[dict] = []
        self.top5: list[tuple[float, float, float, int]] = []  # (t, share of used, share of pool, requests)

    def start(self) -> None:
        self._sample()

    def on_step(self, node, out, t0: float, t1: float) -> None:
        klass = self.cluster.klass
        for m in out.moves:
            k = klass.get(m.request_id, "?")
            self.moves[(k, m.kind)] += 1
            self.move_pages[(k, m.kind)] += m.num_pages

    def on_transfer(self, rid: str, nbytes: int, seconds: float) -> None:
        self.kv_bytes[self.cluster.klass.get(rid, "?")] += nbytes

    def on_adopted(self, node, seq) -> None:
        where = "host" if node.host_pool is not None and node.host_pool.num_held(seq.request_id) else "device"
        self.adopted[(self.cluster.klass.get(seq.request_id, "?"), where)] += 1

    def _sample(self) -> None:
        c = self.cluster
        c.sync()
        now = c.loop.now
        rows, footprints, total = [], [], 0
        for nid, n in c.nodes.items():
            if n.dead:
                continue  # (its pages went with it)
            held = n.pool.held_counts()
            tenants: Counter = Counter()
            for rid, pages in held.items():
                seq = n.seqs.get(rid)
                if seq is not None:
                    tenants[seq.tenant] += pages
            host = n.host_pool
            rows.append({"role": n.shape.role, "id": nid, "pages_total": n.pool.num_pages, "pages_free": n.pool.num_free,
                         "host_pages_total": host.num_pages if host else 0, "host_pages_free": host.num_free if host else 0,
                         "running": len(n.scheduler.running), "waiting": len(n.scheduler.waiting) + len(n.scheduler.parked),
                         "extra": {"tenant_pages": dict(tenants)}})
            if n.shape.role != "prefill":
                footprints += [p for p in held.values() if p]
                total += n.pool.num_pages
        self.samples.append(cluster_sample(now, rows))
        used, pool = top_share(footprints, total)
        self.top5.append((now, used, pool, len(footprints)))
        if c._open:
            c.loop.after(c.shape.sample_interval_s, self._sample)

    def summary(self, records) -> dict:
        """The sim-only figures of a run, per class where it applies."""
        n_class = Counter(r.klass for r in records)
        classes = sorted(n_class)
        busy = [s for s in self.top5 if s[3]]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return {
            "evictions": {k: {kind: self.moves[(k, kind)] for kind in ("demote", "promote", "preempt")}
                          for k in classes},
            "evictions_per_request": {k: (self.moves[(k, "demote")] + self.moves[(k, "preempt")]) / n_class[k]
                                      for k in classes},
            "evicted_pages": {k: {kind: self.move_pages[(k, kind)] for kind in ("demote", "promote", "preempt")}
                              for k in classes},
            "adopted": {k: {w: self.adopted[(k, w)] for w in ("device", "host")} for k in classes},
            "kv_bytes_transferred": {k: self.kv_bytes[k] for k in classes},
            "top5_share_used_mean": mean([s[1] for s in busy]),
            "top5_share_pool_mean": mean([s[2] for s in busy]),
            "top5_share_pool_max": max((s[2] for s in busy), default=0.0),
            "top5_series": [[round(t, 3), round(u, 4), round(p, 4), n] for t, u, p, n in self.top5],
        }
