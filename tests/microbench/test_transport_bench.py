"""`pdtb bench transport` end to end on a small size: every figure present, ratios computed
from the printed figures (three peer processes each time, all stopped)."""
from __future__ import annotations

import json

import pytest

from tests.project.test_cli import run_pdtb

pytestmark = pytest.mark.slow  # sender and receiver processes per figure


@pytest.mark.parametrize("endpoint", ["ipc", "tcp"])
def test_bench_transport_prints_every_figure_and_its_ratios(endpoint):
    r = run_pdtb("bench", "transport", "--endpoint", endpoint, "--size-mib", "2", "--small-requests", "8",
                 "--reps", "1", "--chunk-mib", "0.5", "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("gbps", "raw_zmq_gbps", "raw_land_gbps", "memcpy_gbps", "small_pages_per_s", "export_gbps"):
        assert out[key] > 0, key
    assert out["ratio_vs_raw_zmq"] == pytest.approx(out["gbps"] / out["raw_zmq_gbps"], rel=0.01)
    assert out["ratio_vs_raw_land"] == pytest.approx(out["gbps"] / out["raw_land_gbps"], rel=0.01)
    assert (out["endpoint"], out["size_mib"], out["chunk_mib"]) == (endpoint, 2, 0.5)


def test_bench_transport_shm_against_zmq_ipc_and_a_pool_copy():
    r = run_pdtb("bench", "transport", "--backend", "shm", "--size-mib", "2", "--reps", "2", "--chunk-mib", "0.5",
                 "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("shm_gbps", "shm_write_gbps", "shm_unchecked_gbps", "zmq_ipc_gbps", "pool_copy_gbps",
                "pool_landing_copy_gbps", "pool_index_copy_gbps", "checked_copy_gbps"):
        assert out[key] > 0, key
    for kind, name in (("shm", ""), ("shm_write", "write_"), ("shm_unchecked", "unchecked_")):
        assert out[name + "ratio_vs_zmq_ipc"] == pytest.approx(out[kind + "_gbps"] / out["zmq_ipc_gbps"], rel=0.01)
        assert out[name + "ratio_vs_pool_copy"] == pytest.approx(out[kind + "_gbps"] / out["pool_copy_gbps"], rel=0.01)
        assert out[kind + "_gbps_median"] <= out[kind + "_gbps"]
    assert out["write_ratio_vs_checked_copy"] == pytest.approx(out["shm_write_gbps"] / out["checked_copy_gbps"], rel=0.01)
    assert out["pool_copy_gbps"] == max(out["pool_landing_copy_gbps"], out["pool_index_copy_gbps"])
    assert out["read_by_receiver"] == 3  # the warm-up and two reps, each read by the receiver from the arena
    assert out["written_one_sided"] == 3  # those from outside the arena: written, none as chunks
    assert out["local_links"] == 1  # connected after the first Grant, kept
