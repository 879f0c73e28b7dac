"""`pdtb bench sweep` against a real disaggregated cluster (memfair with quotas per SLO tier: the
whales' tier from the router's tenant default, the minnows' in each request): every level's requests end, the figures are read from
the nodes' /cluster samples too, and no page is left held."""
from __future__ import annotations

import json

import pytest

from cluster_util import all_pages_free, get_json, launched, wait_until
from pdtb.client.sweep import main as sweep_main

pytestmark = pytest.mark.slow


def test_a_sweep_of_a_real_cluster(llama_dir, tmp_path):
    tiers = "--tenant-tier w=batch"  # the whales' tier from the router; the minnows name theirs
    with launched(tmp_path / "c", llama_dir, "--mode", "disagg", "--policy", "memfair", "--kv-pages", "160",
                  "--prefill-kv-pages", "96", "--router-args", tiers, "--", "--quota-by", "slo-tier") as (url, _):
        out = tmp_path / "s.json"
        rc = sweep_main(["--url", url, "--workload", "whale-minnow", "--duration", "4", "--whales", "1",
                         "--whale-prompt", "300", "--whale-output", "40", "--whale-start", "0.5",
                         "--minnow-rate", "3", "--minnow-prompt", "12", "--minnow-output", "4",
                         "--whale-tenants", "w", "--minnow-tenants", "m0,m1", "--minnow-tier", "interactive",
                         "--rates", "0.5,1",
                         "--warmup-s", "0.5", "--span-s", "3", "--drain-s", "60", "--sample-interval", "0.25",
                         "--slo", "ttft_ms=60000", "--out", str(out), "--quiet"])
        assert rc == 0
        doc = json.loads(out.read_text())
        assert [lv["load"] for lv in doc["levels"]] == [0.5, 1.0]
        for lv in doc["levels"]:
            assert lv["overall"]["count"] > 0 and lv["overall"]["failed"] == 0
            assert lv["overall"]["attainment"] == 1.0  # a minute's TTFT target: only a failure misses
            assert set(lv["per_tenant"]) <= {"w", "m0", "m1"}
        # twice the rate over the same span: about twice the requests (Poisson minnows, seed + k)
        assert doc["levels"][1]["overall"]["count"] > doc["levels"][0]["overall"]["count"]
        assert doc["meta"]["mode"] == "disagg" and doc["meta"]["policy"].startswith("memfair")
        # /cluster was sampled through every level (pages per tenant come from these samples;
        # whether a sample finds pages held depends on timing, so only the sampling is asserted)
        assert all(lv["samples"] and all(s["nodes"] for s in lv["samples"]) for lv in doc["levels"])
        decode = next(n for n in get_json(f"{url}/cluster") if n["role"] == "decode")
        assert set(decode["extra"]["owner_quota"]) <= {"s:batch", "s:interactive"}  # quotas per tier, not tenant
        wait_until(lambda: all_pages_free(url), 30, what="all pages free")
