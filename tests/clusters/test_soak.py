"""A short soak through scripts/soak.sh: a 1 prefill + 1 decode cluster, a few hundred short
closed-loop requests, then zero failed requests, zero leaked pages, no process left behind.
(The full 10,000-request run is `bash scripts/soak.sh`; its RSS check is loose here, where a
few hundred requests are too few for the allocators to settle.)"""
from __future__ import annotations

import re
import subprocess

import pytest

from chaos_util import procs_mentioning
from cluster_util import ROOT

pytestmark = pytest.mark.slow


def test_short_soak_no_failures_no_leaked_pages(llama_dir, tmp_path):
    run_dir = tmp_path / "soak"
    before = procs_mentioning(llama_dir)
    r = subprocess.run(["bash", str(ROOT / "scripts/soak.sh"), "--requests", "300", "--concurrency", "8",
                        "--warmup", "100", "--rss-tolerance", "0.5", "--model", llama_dir, "--run-dir", str(run_dir),
                        "--quiet"], capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr[-3000:]}"
    assert re.search(r"soak: 300 requests .* 0 failed$", out, re.M), out
    pages = re.findall(r"soak: pages (\S+) \((\w+)\): (\d+)/(\d+) device free, (\d+)/(\d+) host free", out)
    assert sorted(p[1] for p in pages) == ["decode", "prefill"], out
    assert all(p[2] == p[3] and p[4] == p[5] for p in pages), out
    assert len(re.findall(r"^soak: rss ", out, re.M)) == 3, out  # router, prefill, decode
    assert "soak: PASS" in out
    assert not list(run_dir.glob("*.pid"))
    assert not procs_mentioning(llama_dir) - before, "soak.sh left a process behind"
