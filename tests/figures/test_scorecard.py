"""`pdtb scorecard`: figures of hand-made results files computed by hand, Pareto marks, the
tenants made from Mooncake hash_id prefixes, and the command on a folder."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdtb.figures import scorecard as sc
from pdtb.client.scorecard_data import prefix_tenants


def req(cls, send, first, times, prompt=8, out=4, tenant=None, status="ok"):
    return {"class": cls, "tenant": tenant or cls, "send_time": send, "first_token_time": first,
            "token_times": times, "end_time": times[-1] if times else first, "status": status,
            "prompt_tokens": prompt, "requested_output_tokens": out}


def doc(requests, samples=(), tok_s=10.0, sim=None):
    d = {"meta": {"policy": "x"}, "requests": list(requests), "samples": list(samples),
         "summary": {"overall": {"output_tok_s": tok_s, "goodput_rps": 1.0, "failed": 0}}}
    if sim:
        d["meta"]["sim"] = sim
    return d


def test_percentile_by_hand():
    assert sc.percentile([4, 1, 3, 2], 50) == 2.5  # between the 2nd and 3rd of 1, 2, 3, 4
    assert sc.percentile([1, 2, 3, 4, 5], 99) == pytest.approx(4.96)  # 4 + 0.96 of the way to 5
    assert sc.percentile([], 50) is None


def test_classes_named_or_the_largest_five_percent():
    named = [{"class": "whale", "prompt_tokens": 1}, {"class": "minnow", "prompt_tokens": 9}]
    assert sc.classes(named) == ["whale", "minnow"]
    rows = [{"class": "trace", "prompt_tokens": n, "requested_output_tokens": 0} for n in range(1, 41)]
    got = sc.classes(rows)  # 40 requests: the 2 largest (5%) are whales
    assert [i for i, k in enumerate(got) if k == "whale"] == [38, 39]


def test_run_figures_by_hand():
    """Minnows: TTFT 0.1 and 0.3 s, gaps 0.1, 0.1, 0.2, 0.2 s. The whale: sent at 0, tokens at
    1, 2, 4 (TPOT 1.5 s, E2E 4 s). Page-seconds: tenant a holds 10 pages for 2 s, b 10 for 1 s
    and 30 for 1 s: 20 and 40, Jain 60^2 / (2 * 2000) = 0.9."""
    reqs = [req("minnow", 0.0, 0.1, [0.1, 0.2, 0.3]), req("minnow", 1.0, 1.3, [1.3, 1.5, 1.7]),
            req("whale", 0.0, 1.0, [1.0, 2.0, 4.0])]
    samples = [{"t": 0.0, "nodes": [{"tenant_pages": {"a": 10, "b": 10}, "running": 2}]},
               {"t": 1.0, "nodes": [{"tenant_pages": {"a": 10, "b": 30}, "running": 2}]},
               {"t": 2.0, "nodes": [{"tenant_pages": {}, "running": 0}]}]
    sim = {"evictions": {"minnow": {"demote": 1, "promote": 1, "preempt": 0}}, "simulated_s": 2.0,
           "steps": {"n0": 40}, "wall_s": 0.2}
    f = sc.run_figures(doc(reqs, samples, sim=sim))
    assert f["minnow_ttft_p99"] == pytest.approx(298.0)  # 100 + 0.99 * 200
    assert f["minnow_itl_p99"] == pytest.approx(200.0)
    assert f["whale_tpot_p50"] == pytest.approx(1500.0) and f["whale_e2e_p50"] == pytest.approx(4000.0)
    assert f["jain_page_s"] == pytest.approx(0.9)
    # 2 moves in 2 s with 4/3 running on average: 1 a second per 1.33 running, 75 per 100
    assert f["moves_per_s_per_100"] == pytest.approx(75.0)
    assert f["sim_ms_per_step"] == pytest.approx(5.0)


def test_pareto_and_ratios(tmp_path):
    """fcfs, a policy better on everything but throughput, and one worse on everything."""
    folder = tmp_path / "s"
    folder.mkdir()
    fast = [req("minnow", 0.0, 0.1, [0.1, 0.2]), req("whale", 0.0, 1.0, [1.0, 2.0])]
    slow = [req("minnow", 0.0, 0.5, [0.5, 1.0]), req("whale", 0.0, 2.0, [2.0, 4.0])]
    (folder / "fcfs.json").write_text(json.dumps(doc(slow, tok_s=10.0)))
    (folder / "good.json").write_text(json.dumps(doc(fast, tok_s=9.0)))
    (folder / "bad.json").write_text(json.dumps(doc(slow, tok_s=5.0)))
    card = sc.scenario(folder)
    rows = {r["label"]: r for r in card["rows"]}
    assert rows["good"]["pareto"] and rows["fcfs"]["pareto"] and not rows["bad"]["pareto"]
    assert rows["good"]["ratio"]["minnow_ttft_p99"] == pytest.approx(0.2)
    assert rows["bad"]["ratio"]["out_tok_s"] == pytest.approx(0.5)
    out = subprocess.run([sys.executable, "-m", "pdtb", "scorecard", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| good | **yes** | 100.0 (0.20x)" in out.stdout
    assert (tmp_path / "scorecard.md").read_text().startswith("### s")
    empty = subprocess.run([sys.executable, "-m", "pdtb", "scorecard", str(tmp_path / "none")], capture_output=True,
                           text=True, timeout=120)
    assert empty.returncode != 0 and "no scenario folders" in empty.stderr


def test_prefix_tenants_keep_a_conversation_with_one_tenant():
    rows = [{"hash_ids": [0, 7, 8]}, {"hash_ids": [0, 7, 8, 9]}, {"hash_ids": [0, 4]}, {"hash_ids": [5]}]
    got = [r["tenant"] for r in prefix_tenants(rows, 4)]
    assert got == ["t3", "t3", "t0", "t1"]  # 7 % 4, the same conversation, 4 % 4, a lone block 5 % 4
    with pytest.raises(ValueError, match="hash_ids"):
        prefix_tenants([{"input_length": 3}], 4)
    with pytest.raises(ValueError, match="at least 1"):
        prefix_tenants(rows, 0)


def test_scorecard_script_refuses_a_bad_policy_before_any_run(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(["bash", str(root / "scripts/scorecard.sh"), "--out", str(tmp_path / "o"), "--policies",
                        "fcfs nosuch"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown policy 'nosuch'" in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.slow
def test_scorecard_script_runs_the_simulated_scenarios(tmp_path):
    """The simulator's scenarios end to end for one policy: every scenario folder, its table,
    and the essay's claims with 5% whales in memory."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "card"
    r = subprocess.run(["bash", str(root / "scripts/scorecard.sh"), "--skip-real", "--policies", "fcfs", "--out",
                        str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cards = {c["name"]: c for c in json.loads((out / "scorecard.json").read_text())}
    assert set(cards) == {"sim-essay-colocated", "sim-essay-disagg", "sim-70b-tenants", "sim-mooncake", "sim-4-decode"}
    for c in cards.values():
        (row,) = c["rows"]
        assert row["label"] == "fcfs" and row["failed"] == 0 and row["minnow_ttft_p99"] > 0 and row["whale_e2e_p50"] > 0
    top5 = json.loads((out / "sim-essay-top5.json").read_text())
    assert top5["top5"]["used_mean"] > 0.5  # the whales hold most of the KV in use


def test_repeats_give_each_ratio_and_fcfs_own_spread(tmp_path):
    """Two repeats, colocated only. Output tok/s: fcfs 10 then 20 (spread 2.00x), memfair 5 then
    30 (0.50x, 1.50x; its own spread 6.00x). Whale E2E (sent 0, ended 2 s or 3 s for fcfs, 4 s or 3 s
    for memfair): 4000/2000 = 2.00x, then 1.00x; spreads 1.50x and 1.33x."""
    whale = lambda end: req("whale", 0.0, 1.0, [1.0, end])  # noqa: E731
    for k, (f_tok, m_tok, f_end, m_end) in enumerate([(10.0, 5.0, 2.0, 4.0), (20.0, 30.0, 3.0, 3.0)], 1):
        d = tmp_path / "repeats" / f"r{k}"
        d.mkdir(parents=True)
        (d / "colocated-fcfs.json").write_text(json.dumps(doc([whale(f_end)], tok_s=f_tok)))
        (d / "colocated-memfair.json").write_text(json.dumps(doc([whale(m_end)], tok_s=m_tok)))
    rows = {r.split(" | ")[1]: r for r in sc.repeats_table(tmp_path)[2:]}
    assert rows["out tok/s"] == "| colocated | out tok/s | 0.50x, 1.50x | 6.00x | within noise |"
    assert rows["whale E2E p50 ms"] == "| colocated | whale E2E p50 ms | 2.00x, 1.00x | 1.50x | within noise |"
    assert sc.repeats_table(tmp_path / "none") == []


def test_a_difference_is_beyond_noise_only_when_every_repeat_leaves_fcfs_own_spread():
    assert sc.noise_verdict([0.04, 0.06, 0.04], 1.64) == "beyond noise"  # all below 1/1.64 = 0.61
    assert sc.noise_verdict([2.5, 1.9], 1.8) == "beyond noise"
    assert sc.noise_verdict([0.85, 1.20], 1.26) == "within noise"
    assert sc.noise_verdict([0.5, 0.7], 1.5) == "within noise"  # 0.7 > 1/1.5 = 0.67
    assert sc.noise_verdict([], 1.5) == "-" and sc.noise_verdict([0.5], None) == "-"
