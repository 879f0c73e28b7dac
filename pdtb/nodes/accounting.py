"""Tier-move stamps, KV metering, SLO attribution, per-tenant pages and metrics.

Per-node bookkeeping of the fairness controller's effects: tier moves stamped on request
timelines, KV bandwidth metering, SLO attribution, per-tenant pages for /cluster and metrics."""
from __future__ import annotations

from collections import Counter

from fairness.attribution import attribute, timing_summary
from fairness.metering import KVMeter
from fairness.owners import quota_owner
from prometheus_client import Counter as PCounter
from prometheus_client import Gauge


MAX_TENANT_LABELS = 512  # distinct tenant names a node keeps per-tenant series for; the rest are OTHER
OTHER = "_other"


class NodeAccounting:
    """Per-tenant figures (metrics label values, /cluster stats, KV bytes) are kept for at most
    MAX_TENANT_LABELS tenant names, first come first kept; later ones count under "_other".
    Tenant names come from clients (the OpenAI `user`): unbounded, they grew every node's
    /metrics and its stats reply to each ping without limit (1.5 MB per 2,000 names), until
    the reply would pass the control plane's frame limit."""

    def __init__(self, node) -> None:
        self.node = node
        self._labels: set[str] = set()
        self.meter = KVMeter(tenant_key=self.label)
        self.evictions: Counter = Counter()  # (tenant, kind) -> count
        r, lbl = node.metrics.registry, ["role", "node"]
        self.m_tenant_pages = Gauge("pdtb_tenant_kv_pages", "KV pages held per tenant and tier", lbl + ["tenant", "tier"], registry=r)
        self.m_evictions = PCounter("pdtb_evictions", "demotions/promotions/preemptions by tenant", lbl + ["tenant", "kind"], registry=r)
        self.m_bytes = PCounter("pdtb_tenant_kv_bytes", "KV bytes by tenant and kind", lbl + ["tenant", "kind"], registry=r)
        self.m_slo = PCounter("pdtb_slo_misses", "SLO misses by tenant and attributed cause", lbl + ["tenant", "cause"], registry=r)
        self.m_shared = Gauge("pdtb_tenant_kv_pages_shared",
                              "device KV pages per tenant held together with other requests (kind=shared) and "
                              "what the charge rule counts against its quota (kind=charged)",
                              lbl + ["tenant", "kind"], registry=r)
        self.m_prefix = PCounter("pdtb_prefix_cache_tokens", "prompt tokens looked up in the prefix cache (kind=query) "
                                 "and served from it (kind=hit: not computed, or not sent)", lbl + ["tenant", "kind"],
                                 registry=r)
        self._prefix_seen: dict[tuple[str, str], int] = {}
        self.m_conservation = node.metrics.conservation_errors
        self._tenants_seen: set[str] = set()

    def label(self, tenant: str) -> str:
        """The name `tenant`'s figures are kept under (see the class doc)."""
        if tenant in self._labels:
            return tenant
        if len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
            return tenant
        return OTHER

    def on_output(self, out, now: float) -> None:
        """Stamp tier moves on timelines and meter bytes, after one scheduler step."""
        eng, seqs, lbl = self.node.engine, self.node.seqs, self.node.metrics.labels
        for c in out.chunks:
            self.meter.tenant_of[c.seq.request_id] = c.seq.tenant
        for m in out.moves:
            seq = seqs.get(m.request_id)
            if seq is None:
                continue
            tl = seq.timeline
            self.evictions[(self.label(seq.tenant), m.kind)] += 1
            self.m_evictions.labels(tenant=self.label(seq.tenant), kind=m.kind, **lbl).inc()
            if m.kind != "promote":  # from here on it is parked or dropped, not waiting a turn
                tl.end_wait("turn_wait", now)
            if m.kind == "demote":
                tl.parked_since = now
            elif m.kind == "promote":  # (parked before its first token: part of its TTFT)
                tl.end_wait("parked", now, into="parked_ttft_s" if tl.first_token is None else None)
            elif m.kind == "preempt":
                tl.preempted_since = now
                tl.num_preemptions += 1
        for c in out.chunks:
            tl = c.seq.timeline
            if c.wants_logits and tl.preempted_since is not None:
                # preempted before its first token: the wait for recompute is part of its TTFT
                tl.end_wait("preempted", now, into="recompute_ttft_s" if tl.first_token is None else None)
            if tl.turn_wait_since is not None:
                tl.end_wait("turn_wait", now)
        for seq in out.unserved:  # resident, but its turn did not come (read share, bandwidth cap, budget)
            if seq.num_output_tokens:
                seq.timeline.start_wait("turn_wait", now)
        for (t, k), d in self.meter.on_step(out, eng.pool.spec.page_size, eng.pool.bytes_per_page).items():
            if d:
                self.m_bytes.labels(tenant=t, kind=k, **lbl).inc(d)

    def meter_reads(self, reads) -> None:
        """Attention reads of a run of decode steps taken at once (the simulator's, pdtb/sim/coast.py):
        what `on_output` meters for them, with no tier move or wait to stamp."""
        lbl = self.node.metrics.labels
        for t, d in self.meter.add_reads(reads).items():
            if d:
                self.m_bytes.labels(tenant=t, kind="attn_read", **lbl).inc(d)

    def add_received(self, seq, nbytes: int) -> None:
        self.add_bytes(seq, "received", nbytes)

    def add_bytes(self, seq, kind: str, nbytes: int) -> None:
        """Meter `nbytes` of KV of `kind` for `seq` ("received"; "cached": pages a hand-off did
        not send because this node had them; "not_sent" at the prefill side)."""
        self.meter.add(seq.request_id, seq.tenant, kind, nbytes)
        self.m_bytes.labels(tenant=self.label(seq.tenant), kind=kind, **self.node.metrics.labels).inc(nbytes)

    def forget(self, request_id: str) -> None:
        """A request ended without a final timing (aborted, failed): drop its meters."""
        self.meter.finish(request_id)

    def final_timing(self, seq) -> dict:
        """Extension object for the final event: phases, SLO attribution, KV bytes."""
        out = timing_summary(seq.timeline)
        slo = attribute(seq.timeline, seq.num_output_tokens, seq.priority, self.node.config.fairness)
        out["slo"] = slo
        out["kv_bytes"] = self.meter.finish(seq.request_id)
        out["num_preemptions"] = seq.timeline.num_preemptions
        if seq.slo_tier:
            out["slo_tier"] = seq.slo_tier
        if slo["cause"]:
            self.m_slo.labels(tenant=self.label(seq.tenant), cause=slo["cause"], **self.node.metrics.labels).inc()
        return out

    def tenant_stats(self) -> dict:
        eng = self.node.engine
        dev, host = Counter(), Counter()
        for s in self.node.seqs.values():  # the node's live requests (a prefill's held hand-offs too)
            dev[self.label(s.tenant)] += len(eng.pool.pages_of(s.request_id))
            if eng.host_pool is not None:
                host[self.label(s.tenant)] += len(eng.host_pool.pages_of(s.request_id))
        shared, charged = self.shared_pages()
        lbl = self.node.metrics.labels
        for t in self._tenants_seen | set(dev) | set(host):
            self.m_tenant_pages.labels(tenant=t, tier="device", **lbl).set(dev.get(t, 0))
            self.m_tenant_pages.labels(tenant=t, tier="host", **lbl).set(host.get(t, 0))
            self.m_shared.labels(tenant=t, kind="shared", **lbl).set(shared.get(t, 0))
            self.m_shared.labels(tenant=t, kind="charged", **lbl).set(charged.get(t, 0))
        self._tenants_seen |= set(dev) | set(host)
        prefix = self.prefix_stats()
        quotas = self.node.policy.quotas()
        return {"tenant_pages": dict(dev), "tenant_host_pages": dict(host), "owner_pages": self.owner_pages(),
                "tenant_pages_shared": dict(shared), "tenant_pages_charged": {t: round(v, 2) for t, v in charged.items()},
                "charge_rule": eng.pool.charge, **prefix,
                "quota": {t: round(v, 1) for t, v in quotas.by_name.items()},
                "owner_quota": {o: round(v, 1) for o, v in quotas.by_owner.items()},
                "evictions": {f"{t}/{k}": n for (t, k), n in self.evictions.items()},
                "kv_bytes": {t: dict(v) for t, v in self.meter.per_tenant.items()}}

    def shared_pages(self) -> tuple[Counter, Counter]:
        """Device pages per tenant held together with other requests, and charged to it."""
        pool = self.node.engine.pool
        shared, charged = Counter(), Counter()
        if not pool.num_shared:
            return shared, charged  # (then charged is held: `tenant_pages`)
        by_req_shared, by_req_charged = pool.shared_counts(), pool.charged_counts()
        for s in self.node.seqs.values():
            t = self.label(s.tenant)
            shared[t] += by_req_shared.get(s.request_id, 0)
            charged[t] += by_req_charged.get(s.request_id, 0)
        return shared, charged

    def prefix_stats(self) -> dict:
        """The scheduler's prefix counters per tenant (prompt tokens looked up, served from the
        cache) and the node's cache state, with the Prometheus counters brought up to date."""
        eng = self.node.engine
        c = eng.scheduler.prefix
        lbl = self.node.metrics.labels
        for kind, table in (("query", c.query_by_tenant), ("hit", c.hit_by_tenant)):
            for t, n in table.items():
                key = (self.label(t), kind)
                d = n - self._prefix_seen.get((t, kind), 0)
                if d:
                    self._prefix_seen[(t, kind)] = n
                    self.m_prefix.labels(tenant=key[0], kind=kind, **lbl).inc(d)
        return {"prefix_tokens": {"query": c.query_tokens, "hit": c.hit_tokens, "recompute_hit": c.recompute_hit_tokens},
                "tenant_prefix_hit_tokens": {self.label(t): n for t, n in c.hit_by_tenant.items()},
                "prefix_cached_pages": eng.pool.num_cached, "prefix_registered_pages": eng.pool.num_registered}

    def owner_pages(self) -> dict[str, int]:
        """Device pages per quota owner (fairness/owners.py: "t:<tenant>", "p:<class>",
        "r:<request>", "s:<tier>") holding any; beyond MAX_TENANT_LABELS owners (one per request
        under request quotas) the smallest count under "_other"."""
        eng, cfg = self.node.engine, self.node.config.fairness
        pages: Counter = Counter()
        for s in self.node.seqs.values():
            n = len(eng.pool.pages_of(s.request_id))
            if n:
                pages[quota_owner(s, cfg)] += n
        if len(pages) <= MAX_TENANT_LABELS:
            return dict(pages)
        top = dict(pages.most_common(MAX_TENANT_LABELS - 1))
        top[OTHER] = sum(pages.values()) - sum(top.values())
        return top

    def check_conservation(self) -> bool:
        """free + reserved + resident + parked == total on each tier; counted if it breaks."""
        from pdtb.engine.page_pool import PoolError

        eng = self.node.engine
        try:
            for pool in (eng.pool, eng.host_pool):
                if pool is not None:
                    pool.check()
            return True
        except PoolError:
            self.m_conservation.inc()
            return False
