"""Router Prometheus metrics.

Prometheus metrics measured at the router, in a per-process CollectorRegistry; with several
routers behind one port, in prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set
before prometheus_client is imported: pdtb/router/main.py), where any router renders the sum."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from pdtb.router.tenant_latency import TenantLatency

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


class RouterMetrics:
    """Request counts by HTTP status, latency histograms, in-flight gauge, token counters.

    status: the HTTP status the request ended with; "499" when the client went away first. A
    stream that failed after its 200 went out counts under the status of its error event (e.g.
    "503" when its node stopped answering): the client got that error, in the stream.
    ITL: a batch of k tokens arriving `gap` seconds after the previous one counts k times gap/k.
    The same TTFT and ITL by tenant: `tenants` (pdtb/router/tenant_latency.py).
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir  # render every router process's values, summed
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdtb_router_requests", "Completion requests by final status",
                                ["status"], registry=r)
        self.ttft = Histogram("pdtb_router_ttft_seconds", "Time to first token at the router",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdtb_router_itl_seconds", "Inter-token latency at the router",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdtb_router_e2e_seconds", "Request latency, arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("pdtb_router_requests_in_flight", "Requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.prompt_tokens = Counter("pdtb_router_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("pdtb_router_generation_tokens", "Tokens returned to clients",
                                         registry=r)
        self.recomputes = Counter("pdtb_router_recomputes", "Requests sent anew (prompt plus the tokens "
                                  "streamed so far) because a node they depended on died", registry=r)
        self.migrations = Counter("pdtb_router_migrations", "Live migrations between decode nodes that ended, "
                                  "by why they started and how they ended", ["reason", "outcome"], registry=r)
        self.migration_downtime = Histogram("pdtb_router_migration_downtime_seconds",
                                            "Pause a migrated request saw: the source's last step to the "
                                            "target's first token", buckets=ITL_BUCKETS, registry=r)
        self.prefix_hit_requests = Counter("pdtb_router_prefix_hit_requests",
                                           "Requests routed (--route cache) to a node believed to hold a "
                                           "prefix of their prompt", ["node"], registry=r)
        self.prefix_overlap_tokens = Counter("pdtb_router_prefix_overlap_tokens",
                                             "Prompt tokens of routed requests believed cached at their node",
                                             ["node"], registry=r)
        self.tenant_ttft = Histogram("pdtb_router_tenant_ttft_seconds", "Time to first token at the router, "
                                     "by tenant", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_itl = Histogram("pdtb_router_tenant_itl_seconds", "Inter-token latency at the router, by tenant",
                                    ["tenant"], buckets=ITL_BUCKETS, registry=r)
        self.tenants = TenantLatency(self.tenant_ttft, self.tenant_itl)
        self._cluster = None  # a collector of the nodes' own reports (attach_cluster)

    def attach_cluster(self, collector) -> None:
        """Render `collector`'s families too (pdtb/router/cluster_metrics.py): they come from this
        process's view of the nodes, not from anything summed over the routers."""
        self._cluster = collector
        self.registry.register(collector)

    def observe_migration(self, m) -> None:
        """A live migration ended (pdtb/router/migration.py)."""
        self.migrations.labels(reason=m.reason, outcome=m.state).inc()

    def observe_route(self, node_id: str, overlap_tokens: int) -> None:
        """A request went to `node_id`, which was believed to hold `overlap_tokens` of its prompt."""
        if overlap_tokens > 0:
            self.prefix_hit_requests.labels(node_id).inc()
            self.prefix_overlap_tokens.labels(node_id).inc(overlap_tokens)

    def observe_tokens(self, num_tokens: int, gap: float | None) -> None:
        """`num_tokens` arrived `gap` seconds after the previous batch (None: the first batch)."""
        self.generation_tokens.inc(num_tokens)
        if gap is not None and num_tokens > 0:
            for _ in range(num_tokens):
                self.itl.observe(gap / num_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self.multiprocess_dir)
        if self._cluster is not None:
            summed.register(self._cluster)
        return generate_latest(summed), CONTENT_TYPE_LATEST
