"""The router's per-tenant TTFT and ITL (histograms and the recent window of /cluster/latency), and the nodes'
shares and queues on its /metrics, against figures computed by hand."""
from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdtb.router.cluster_metrics import ClusterCollector
from pdtb.router.metrics import RouterMetrics
from pdtb.router.tenant_latency import HORIZON_S, MAX_TENANTS, OTHER, WINDOW, figures


def sample(metrics: RouterMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_figures_are_nearest_rank_over_the_recent_samples():
    samples = [(0.0, 100.0)] + [(10.0, float(v)) for v in range(1, 101)]  # one old sample, then 1..100
    f = figures(samples, since=5.0)
    assert f == {"n": 100, "mean": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert figures([(1.0, 0.3)], since=0.0) == {"n": 1, "mean": 0.3, "p50": 0.3, "p90": 0.3, "p99": 0.3}
    assert figures(samples, since=11.0) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_ttft_and_itl_per_tenant_in_the_window_and_the_histograms():
    m = RouterMetrics()
    a, b = m.tenants.of("alice"), m.tenants.of("bob")
    assert m.tenants.of("alice") is a
    a.first_token(0.2, now=100.0)
    a.tokens(4, 0.1, now=100.1)  # 4 tokens 0.1 s after the first: 4 gaps of 0.025 s
    a.tokens(1, 0.05, now=100.15)
    b.first_token(1.5, now=100.0)
    s = m.tenants.summary(now=101.0)
    assert s["alice"]["ttft"] == {"n": 1, "mean": 0.2, "p50": 0.2, "p90": 0.2, "p99": 0.2}
    assert s["alice"]["itl"] == {"n": 5, "mean": 0.03, "p50": 0.025, "p90": 0.05, "p99": 0.05}
    assert s["bob"]["itl"]["n"] == 0 and s["bob"]["ttft"]["p50"] == 1.5
    assert sample(m, "pdtb_router_tenant_itl_seconds_count", tenant="alice") == 5
    assert sample(m, "pdtb_router_tenant_itl_seconds_sum", tenant="alice") == pytest.approx(0.15)
    assert sample(m, "pdtb_router_tenant_ttft_seconds_count", tenant="bob") == 1
    # past the horizon a tenant is left out of the summary; its histograms keep counting
    assert m.tenants.summary(now=100.0 + HORIZON_S + 1) == {}


def test_the_window_and_the_tenant_names_are_bounded():
    m = RouterMetrics()
    t = m.tenants.of("t")
    t.tokens(3 * WINDOW, 3.0 * WINDOW, now=1.0)
    assert len(t.itl) == WINDOW
    for i in range(MAX_TENANTS + 5):
        m.tenants.of(f"u{i}").first_token(1.0, now=1.0)
    names = set(m.tenants.summary(now=2.0))
    assert len(names) == MAX_TENANTS + 1 and OTHER in names and "u0" in names
    # the first 64 names (t, u0..u62) have series; u63..u68 share OTHER's
    assert sample(m, "pdtb_router_tenant_ttft_seconds_count", tenant=OTHER) == 6


def test_the_cluster_collector_exports_shares_and_waiting_per_tenant():
    reports = [("decode", "de-0", {"quota": {"minnow": 100.0, "whale": 50.5}, "tenant_waiting": {"whale": 2}}),
               ("prefill", "pr-0", {"quota": {}, "handoffs": 1}),
               ("decode", "de-1", {"quota": "not a map", "tenant_waiting": {"x": "?"}})]
    r = CollectorRegistry()
    r.register(ClusterCollector(lambda: reports))
    get = r.get_sample_value
    assert get("pdtb_cluster_tenant_quota_pages", {"role": "decode", "node": "de-0", "tenant": "whale"}) == 50.5
    assert get("pdtb_cluster_tenant_quota_pages", {"role": "decode", "node": "de-0", "tenant": "minnow"}) == 100.0
    assert get("pdtb_cluster_tenant_waiting", {"role": "decode", "node": "de-0", "tenant": "whale"}) == 2
    text = generate_latest(r).decode()
    assert "de-1" not in text and "pr-0" not in text


def test_the_router_renders_the_cluster_families():
    m = RouterMetrics()
    m.attach_cluster(ClusterCollector(lambda: [("decode", "de-0", {"quota": {"a": 10.0}})]))
    body, _ = m.render()
    assert 'pdtb_cluster_tenant_quota_pages{node="de-0",role="decode",tenant="a"} 10.0' in body.decode()


def test_several_routers_sum_the_tenant_histograms_and_add_the_cluster_families(tmp_path):
    """In prometheus_client's multiprocess mode (--metrics-dir, a fresh process): two routers'
    tenant histograms summed; the cluster families of the process that renders, once."""
    script = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from pdtb.router.cluster_metrics import ClusterCollector
from pdtb.router.metrics import RouterMetrics
ms = [RouterMetrics(sys.argv[1]) for _ in range(2)]
for m in ms:
    m.tenants.of("alice").first_token(0.5, now=1.0)
ms[0].attach_cluster(ClusterCollector(lambda: [("decode", "de-0", {"quota": {"alice": 7.0}})]))
print(ms[0].render()[0].decode())
"""
    (tmp_path / "m").mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert 'pdtb_router_tenant_ttft_seconds_count{tenant="alice"} 2.0' in lines
    assert [ln for ln in lines if ln.startswith("pdtb_cluster_tenant_quota_pages{")] == [
        'pdtb_cluster_tenant_quota_pages{node="de-0",role="decode",tenant="alice"} 7.0']
