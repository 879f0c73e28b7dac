"""`pdtb sim` end to end: a run writes `bench serve`'s results schema that `pdtb compare` and
`pdtb report` read; a sweep writes a file `pdtb frontier` reads; bad flags fail in one line."""
from __future__ import annotations

import json

import pytest

from pdtb.figures.compare import rows_of
from pdtb.figures.frontier import load_sweep
from pdtb.figures.results import load_results
from pdtb.cli import main

SMALL = ["--workload", "whale-minnow", "--duration", "4", "--whales", "1", "--whale-prompt", "512",
         "--whale-output", "64", "--minnow-rate", "4", "--minnow-prompt", "24", "--minnow-output", "8"]


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_run_is_a_results_file(tmp_path, capsys, mode):
    out = {p: tmp_path / f"{mode}-{p}.json" for p in ("fcfs", "memfair")}
    for pol, path in out.items():
        assert main(["sim", *SMALL, "--mode", mode, "--policy", pol, "--kv-pages", "256", "--host-kv-pages", "64",
                     "--cost", "calibrated", "--out", str(path)]) == 0
    res = load_results(out["memfair"])
    assert res["meta"]["simulated"] and res["meta"]["mode"] == mode and res["meta"]["policy"] == "memfair"
    assert res["meta"]["cost"].startswith("calibrated:")
    assert len(res["requests"]) == res["summary"]["overall"]["count"] > 10
    assert all(r["status"] == "ok" for r in res["requests"])
    sim = res["meta"]["sim"]
    assert set(sim["evictions"]) == {"minnow", "whale"} and 0 <= sim["top5_share_pool_max"] <= 1
    assert res["samples"] and "tenant_pages" in res["samples"][0]["nodes"][0]
    rows = rows_of([str(p) for p in out.values()], "minnow", "whale")
    assert {r["policy"] for r in rows} == {"fcfs", "memfair"}
    assert main(["report", *map(str, out.values()), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.md").exists()
    assert "sim: " in capsys.readouterr().out


def test_a_sweep_is_a_sweep_file(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    assert main(["sim", *SMALL, "--rates", "1,2", "--warmup-s", "1", "--span-s", "3", "--cost", "roofline",
                 "--slo", "ttft_ms=500", "--out", str(path)]) == 0
    doc = load_sweep(path)
    assert [lv["load"] for lv in doc["levels"]] == [1.0, 2.0] and doc["meta"]["simulated"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["max_goodput_rps"] is not None
    assert main(["frontier", str(path), "--out", str(tmp_path / "f")]) == 0


@pytest.mark.parametrize("args, says", [
    (["--mode", "disagg", "--prefill", "0"], "--prefill and --decode must be at least 1"),
    (["--cost", "calibrated", "--calibration", "no-such-calibration"], "no-such-calibration"),
    (["--cost", "roofline", "--model-config", "llama-3-70b", "--tp", "3"], "tp=3"),
    (["--concurrency-levels", "1,4"], "belong to the real client"),
])
def test_bad_flags_fail_in_one_line(capsys, args, says):
    assert main(["sim", *SMALL, *args]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_a_missing_workload_fails_in_one_line(capsys):
    assert main(["sim", "--mode", "disagg"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--workload is required" in err, err


def test_decode_policy_runs_the_decode_nodes_under_their_own_policy(tmp_path, capsys):
    """--decode-policy: the prefill node keeps --policy with its settings, the decode node runs the
    other at its defaults, and the samples carry each node's shares; a colocated run refuses it."""
    path = tmp_path / "d.json"
    assert main(["sim", *SMALL, "--mode", "disagg", "--policy", "memfair", "--policy-arg", "starve_after_s=3",
                 "--decode-policy", "fcfs", "--kv-pages", "256", "--cost", "calibrated", "--out", str(path)]) == 0
    nodes = load_results(path)["meta"]["policy_info"]["nodes"]
    pre = next(v for k, v in nodes.items() if k.startswith("prefill"))
    dec = next(v for k, v in nodes.items() if k.startswith("decode"))
    assert pre["name"] == "memfair" and pre["settings"]["starve_after_s"] == 3.0
    assert dec == {"name": "fcfs", "source": "built in", "settings": {}}
    assert main(["sim", *SMALL, "--mode", "colocated", "--decode-policy", "fcfs"]) != 0
    assert "--decode-policy is for --mode disagg" in capsys.readouterr().err
