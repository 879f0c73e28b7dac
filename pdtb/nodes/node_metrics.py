"""Prometheus metrics of one node, on its own registry, served over HTTP with /stats JSON."""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pdtb.common import host_port

LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class NodeMetrics:
    def __init__(self, role: str, node_id: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl = {"role": role, "node": node_id}
        self.labels = lbl
        self.pages_total = Gauge("pdtb_kv_pages_capacity", "KV pages in a tier (free or not)", ["role", "node", "tier"], registry=r)
        self.pages_free = Gauge("pdtb_kv_pages_free", "free KV pages in a tier", ["role", "node", "tier"], registry=r)
        self.running = Gauge("pdtb_requests_running", "requests running", ["role", "node"], registry=r).labels(**lbl)
        self.waiting = Gauge("pdtb_requests_waiting", "requests waiting: queued, or parked in the host tier (as /stats)", ["role", "node"], registry=r).labels(**lbl)
        self.prompt_tokens = Counter("pdtb_prompt_tokens", "prompt tokens prefilled", ["role", "node"], registry=r).labels(**lbl)
        self.gen_tokens = Counter("pdtb_generation_tokens", "tokens generated", ["role", "node"], registry=r).labels(**lbl)
        self.kv_sent = Counter("pdtb_kv_bytes_sent", "KV payload bytes sent", ["role", "node"], registry=r).labels(**lbl)
        self.kv_recv = Counter("pdtb_kv_bytes_received", "KV payload bytes received", ["role", "node"], registry=r).labels(**lbl)
        self.transfers = Counter("pdtb_kv_transfers", "KV transfers by outcome", ["role", "node", "outcome"], registry=r)
        self.transfer_s = Histogram("pdtb_kv_transfer_seconds", "KV transfer latency", ["role", "node"],
                                    buckets=LAT_BUCKETS, registry=r).labels(**lbl)
        self.ttft = Histogram("pdtb_ttft_seconds", "server-side time to first token", ["role", "node"],
                              buckets=LAT_BUCKETS, registry=r).labels(**lbl)
        self.itl = Histogram("pdtb_itl_seconds", "server-side gap between tokens", ["role", "node"],
                             buckets=LAT_BUCKETS, registry=r).labels(**lbl)
        self.finished = Counter("pdtb_requests_finished", "requests ended by reason", ["role", "node", "reason"], registry=r)
        self.steps = Counter("pdtb_engine_steps", "engine steps", ["role", "node"], registry=r).labels(**lbl)
        self.conservation_errors = Counter("pdtb_page_conservation_errors", "page state checks that failed",
                                           ["role", "node"], registry=r).labels(**lbl)
        # info-style (always 1): the labels carry the policy, so a dashboard can join it onto any series
        self.policy_info = Gauge("pdtb_policy_info", "the admission policy this node runs: name, source, settings",
                                 ["role", "node", "policy", "source", "settings"], registry=r)

    def set_policy(self, name: str, source: str, settings: dict) -> None:
        """Name the node's policy; the previous one's series goes (a node runs one policy)."""
        self.policy_info.clear()
        self.policy_info.labels(policy=name, source=source, settings=settings_text(settings), **self.labels).set(1)

    def count_finished(self, reason: str) -> None:
        """One request ended on this node: stop, length, error or abort."""
        self.finished.labels(reason=reason, **self.labels).inc()

    def set_pages(self, tier: str, total: int, free: int) -> None:
        self.pages_total.labels(tier=tier, **self.labels).set(total)
        self.pages_free.labels(tier=tier, **self.labels).set(free)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def settings_text(settings: dict) -> str:
    """Settings as one label value, `k=v,k=v` sorted by key, values spelled as --policy-arg takes them."""
    return ",".join(f"{k}={_value_text(v)}" for k, v in sorted(settings.items()))


def _value_text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "none" if v is None else str(v)


async def start_http(metrics: NodeMetrics, stats_fn, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve /metrics and /stats; returns (runner, "http://host:port")."""
    app = web.Application()

    async def get_metrics(_req):
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_stats(_req):
        return web.json_response(stats_fn())

    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/stats", get_stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    real_port = site._server.sockets[0].getsockname()[1]  # port 0 -> the ephemeral one
    return runner, f"http://{host_port(host, real_port)}"
