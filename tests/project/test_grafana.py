"""docs/grafana/pdtb.json asks only for metrics the project exports: every metric name of its PromQL, checked
against the names the code registers (fast) and against a real router's and node's /metrics
after requests of two tenants (slow), with the labels its selectors filter on."""
from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chaos_util import http_client, stream
from cluster_util import ROOT, colocated_with_router, get_json

DASHBOARD = ROOT / "docs" / "grafana" / "pdtb.json"
NAME = re.compile(r"\b(pdtb_[A-Za-z0-9_]+)")
SELECTOR = re.compile(r"\b(pdtb_[A-Za-z0-9_]+)\{([^}]*)\}")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
            "info": ("_info",)}  # sample names by family type (others: the family's own name)


def expressions(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets (rows' panels too) and its
    template variables' queries."""
    out = []

    def panels(ps):
        for p in ps:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            panels(p.get("panels", []))

    panels(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            out.append(v["definition"])
            q = v["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def used_names(dash: dict) -> set[str]:
    return {m for e in expressions(dash) for m in NAME.findall(e)}


def exported(families) -> dict[str, set[str]]:
    """{sample name: label names seen on its samples} of metric families (the names a family has
    by its type, with or without samples yet)."""
    out: dict[str, set[str]] = {}
    for f in families:
        for suffix in SUFFIXES.get(f.type, ("",)):
            out.setdefault(f.name + suffix, set())
        for s in f.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_the_dashboard_is_grafana_json_with_a_row_per_tenant():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and expressions(dash)
    tenant_rows = [p for p in dash["panels"] if p["type"] == "row" and p.get("repeat") == "tenant"]
    assert len(tenant_rows) == 1 and "tenant" in {v["name"] for v in dash["templating"]["list"]}
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    for e in expressions(dash):
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
    for name in ("pdtb_tenant_kv_pages", "pdtb_cluster_tenant_quota_pages", "pdtb_evictions_total",
                 "pdtb_router_tenant_ttft_seconds_bucket", "pdtb_router_tenant_itl_seconds_bucket",
                 "pdtb_cluster_tenant_waiting"):
        assert name in used_names(dash), name


def test_every_metric_of_the_dashboard_is_registered_by_the_code():
    from pdtb.nodes.accounting import NodeAccounting
    from pdtb.nodes.node_metrics import NodeMetrics
    from pdtb.router.cluster_metrics import ClusterCollector
    from pdtb.router.metrics import RouterMetrics

    node = SimpleNamespace(metrics=NodeMetrics("decode", "de-0"))
    NodeAccounting(node)  # (registers the per-tenant families on the node's registry)
    router = RouterMetrics()
    router.attach_cluster(ClusterCollector(lambda: []))
    names = exported([*node.metrics.registry.collect(), *router.registry.collect()])
    missing = used_names(json.loads(DASHBOARD.read_text())) - set(names)
    assert missing == set(), f"the dashboard asks for metrics nobody exports: {sorted(missing)}"


def scrape(url: str) -> list:
    with urllib.request.urlopen(url, timeout=10) as r:
        return list(text_string_to_metric_families(r.read().decode()))


@pytest.mark.slow
def test_every_metric_of_the_dashboard_is_exported_by_a_real_cluster(llama_dir, tmp_path):
    async def two_tenants(url):
        async with http_client() as http:
            outs = await asyncio.gather(*(stream(http, url, [5] * 20, 8, user=t) for t in ("alice", "bob")))
        assert all(o.tokens == 8 for o in outs), outs

    with colocated_with_router(llama_dir, tmp_path / "c", "--kv-pages", "200", "--policy", "memfair") as (_, url, _):
        asyncio.run(asyncio.wait_for(two_tenants(url), 120))
        nodes = get_json(f"{url}/cluster")
        families = scrape(f"{url}/metrics") + [f for n in nodes for f in scrape(n["metrics_addr"] + "/metrics")]
    names = exported(families)
    dash = json.loads(DASHBOARD.read_text())
    missing = used_names(dash) - set(names)
    assert missing == set(), f"the dashboard asks for metrics no process exports: {sorted(missing)}"
    # a series that is there carries the labels the dashboard filters it by
    for e in expressions(dash):
        for name, body in SELECTOR.findall(e):
            wanted = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
            if names[name]:
                assert wanted <= names[name], (name, wanted, names[name])
    assert {"alice", "bob"} <= {s.labels.get("tenant") for f in families for s in f.samples
                                if s.name == "pdtb_router_tenant_ttft_seconds_count"}
