"""The nodes' per-tenant shares and queues on the router's /metrics: what their reports carry (as `/cluster` shows
them) and their own /metrics do not.

    pdtb_cluster_tenant_quota_pages{role, node, tenant}   the device pages the node's policy entitles a
                                                          quota owner to (`extra.quota`: by tenant
                                                          under the default --quota-by, else by class
                                                          or tier name)
    pdtb_cluster_tenant_waiting{role, node, tenant}       requests of the tenant waiting at a decode node:
                                                          parked, queued, or deferred arrivals still
                                                          retried there (`extra.tenant_waiting`)

Read at each scrape from the latest report of every healthy node, so a dashboard draws a tenant's
pages held (`pdtb_tenant_kv_pages`, the node's own) against its share on the same labels."""
from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily

LABELS = ("role", "node", "tenant")


class ClusterCollector:
    """A prometheus_client collector over `reports()`: (role, node id, NodeStats.extra) of each
    healthy node."""

    def __init__(self, reports: Callable[[], Iterable[tuple[str, str, dict]]]) -> None:
        self.reports = reports

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("pdtb_cluster_tenant_quota_pages", "device KV pages a node's policy entitles "
                                  "each quota owner to (its share)", labels=LABELS),
                GaugeMetricFamily("pdtb_cluster_tenant_waiting", "requests per tenant waiting at a decode node: "
                                  "parked, queued, or deferred arrivals retried there", labels=LABELS))

    def describe(self):
        return self._families()

    def collect(self):
        quota, waiting = self._families()
        for role, node, extra in self.reports():
            for family, key in ((quota, "quota"), (waiting, "tenant_waiting")):
                values = extra.get(key)
                if isinstance(values, dict):
                    for tenant, v in sorted(values.items()):
                        if isinstance(v, (int, float)):
                            family.add_metric([role, node, str(tenant)], float(v))
        return [quota, waiting]
