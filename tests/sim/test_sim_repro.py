"""`pdtb sim reproduce vtc` and `pdtb sim reproduce essay`: VTC's bound worked out by hand for a
tiny setting, the real fairness/vtc.py within it and fcfs beyond it; the service difference of
hand-written records; the essay command's figures at small sizes; one-line flag errors."""
from __future__ import annotations

import json

import pytest

from pdtb.figures.records import OK, RequestRecord
from pdtb.figures.service import ServiceWeights
from pdtb.cli import main as pdtb_main
from pdtb.sim.repro.vtc import VtcConfig, backlogged_since, difference, summarize, value_at, vtc_bound

# Two clients at 6 and 12 requests/s of 16+16 tokens into a 256-token pool: the node serves
# about 10 a second, so both stay backlogged under VTC (about 5 each) and under fcfs.
TINY_VTC = ["--duration", "40", "--rates", "6,12", "--prompt", "16", "--output", "16", "--kv-tokens", "256",
            "--host-tokens", "512", "--budget", "256"]
TINY_CFG = VtcConfig(duration=40, rates=(6, 12), prompt=16, output=16, kv_tokens=256, host_tokens=512, budget=256)


def _rec(tenant: str, send: float, first: float | None, tokens: list[float], prompt: int = 10) -> RequestRecord:
    r = RequestRecord(tenant, tenant, prompt, len(tokens), scheduled_time=send, send_time=send)
    r.first_token_time, r.token_times = first, list(tokens)
    r.output_tokens, r.status = len(tokens), OK
    return r


def test_bound_and_the_tiny_run_by_hand():
    # 2 * max(w_in * L_input, w_out * M) = 2 * max(1 * 16, 2 * 256)
    assert vtc_bound(16, 256, 1.0, 2.0) == 1024
    assert vtc_bound(600, 256, 1.0, 2.0) == 1200  # a long input dominates
    s = summarize(TINY_CFG)
    vtc, fcfs = s["runs"]["vtc"], s["runs"]["fcfs"]
    assert s["bound"] == 1024
    assert vtc["max_abs_diff"] <= 1024 and vtc["max_interval_diff_backlogged"] <= 1024
    assert abs(fcfs["end_diff"]) > 1024 and fcfs["end_diff"] > 0  # the faster client is ahead
    assert 1.6 < fcfs["end_over_half"] < 2.4  # grows about linearly
    for r in (vtc, fcfs):  # both clients still had requests waiting when sending stopped
        assert min(r["waiting_at_end"].values()) > 0 and r["both_backlogged_from_s"] is not None


def test_difference_of_hand_written_records():
    w = ServiceWeights(1.0, 2.0)
    recs = [_rec("client1", 0.0, 1.0, [1.0, 2.0]),  # 10 + 2 at t=1, 2 at t=2
            _rec("client2", 0.5, 1.5, [1.5, 3.0], prompt=4)]  # 4 + 2 at t=1.5, 2 at t=3
    times, diffs = difference(recs, w)
    assert [value_at(times, diffs, t) for t in (0.5, 1.0, 1.5, 2.0, 3.0)] == [0, -12, -6, -8, -6]
    assert backlogged_since(recs, "client1", 3.0) is None  # its request got its first token
    late = recs + [_rec("client1", 2.5, None, [])]
    assert backlogged_since(late, "client1", 3.0) == 2.5


def test_vtc_json_and_table(capsys):
    assert pdtb_main(["sim", "reproduce", "vtc", "--json", *TINY_VTC]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"] == 1024 and out["vtc_within_bound"] and out["fcfs_end_exceeds_bound"]
    for key in ("max_abs_diff", "end_diff", "half_diff", "end_over_half", "artifact_max_diff", "series"):
        assert key in out["runs"]["vtc"] and key in out["runs"]["fcfs"]
    assert out["paper"]["bound"] == 40000 and len(out["runs"]["vtc"]["series"]) == 20
    assert pdtb_main(["sim", "reproduce", "vtc", *TINY_VTC]) == 0
    text = capsys.readouterr().out
    assert "this run" in text and "paper" in text and "40,000" in text and "1,024" in text


# ---- the essay -----------------------------------------------------------------------------------
SMALL_ESSAY = ["--duration", "2", "--whales", "1", "--whale-start", "0.5", "--whale-output", "2",
               "--minnow-rate", "3", "--minnow-output", "4"]


def test_essay_small(capsys):
    assert pdtb_main(["sim", "reproduce", "essay", "--json", *SMALL_ESSAY]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pages"]["page_ratio"] == 64  # 131072 / 16 = 8192 pages vs 2048 / 16 = 128
    assert out["pages"]["whale_pages"] == 8192 and out["pages"]["minnow_pages"] == 128
    t5 = out["top5"]
    assert 0 <= t5["pool_mean"] <= t5["pool_max"] <= 1 and 0 <= t5["used_mean"] <= 1
    assert t5["by_hand_used"] == pytest.approx(3.2 / 4.15, abs=1e-3)
    for p in ("fcfs", "memfair"):
        assert {"with_whales", "alone", "ratio"} <= set(out["evictions"][p])
    assert {"minnow_ttft_p99", "minnow_itl_p99"} <= set(out["memfair_over_fcfs"])
    assert set(out["runs"]) == {"fcfs", "fcfs_alone", "memfair", "memfair_alone"}
    assert all(r["failed"] == 0 for r in out["runs"].values())
    assert out["essay"] == {"page_ratio": 64.0, "top5_share": 0.8, "eviction_ratio": "2-4x"}


@pytest.mark.parametrize("which,args", [
    ("vtc", ["--bogus"]), ("vtc", ["--rates", "1"]), ("vtc", ["--rates", "a,b"]), ("vtc", ["--duration", "0"]),
    ("vtc", ["--kv-tokens", "100"]), ("vtc", ["--kv-tokens", "16"]), ("vtc", ["--step-ms", "-1"]),
    ("essay", ["--bogus"]), ("essay", ["--whales", "0"]), ("essay", ["--context", "1000"]),
    ("essay", ["--whale-start", "40"]), ("essay", ["--kv-pages", "0"]), ("essay", ["--minnow-rate", "x"]),
])
def test_bad_flags_are_one_line(which, args, capsys):
    assert pdtb_main(["sim", "reproduce", which, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdtb: error:") and "\n" not in err
