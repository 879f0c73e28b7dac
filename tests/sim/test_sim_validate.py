"""`pdtb sim validate`: ratios, targets and the policies' order, on results files written by hand."""
from __future__ import annotations

import json

import pytest

from pdtb.common import CliError
from pdtb.sim.repro.validate import format_report, validate


def _results(mode: str, policy: str, ttft: tuple[float, float], itl: tuple[float, float], tok_s: float) -> dict:
    cls = {"ttft_ms": {"p50": ttft[0], "p99": ttft[1]}, "itl_ms": {"p50": itl[0], "p99": itl[1]}, "output_tok_s": tok_s}
    return {"meta": {"mode": mode, "policy": policy}, "requests": [], "summary": {"per_class": {"minnow": cls}}}


def _write(d, runs: dict) -> str:
    d.mkdir()
    for (mode, pol), args in runs.items():
        (d / f"{mode}-{pol}.json").write_text(json.dumps(_results(mode, pol, *args)))
    (d / "calibration.json").write_text(json.dumps({"kind": "step-calibration"}))  # not a results file: skipped
    return str(d)


def test_ratios_targets_and_order(tmp_path):
    real = _write(tmp_path / "real", {("disagg", "fcfs"): ((100, 1000), (20, 200), 50.0),
                                       ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)})
    sim = _write(tmp_path / "sim", {("disagg", "fcfs"): ((114, 1310), (17, 250), 45.0),  # p99 TTFT 1.31: off
                                    ("disagg", "memfair"): ((100, 500), (20, 120), 50.0)})
    doc = validate(real, sim)
    fcfs = doc["runs"][0]["classes"][0]
    assert fcfs["ttft_p50"]["ratio"] == pytest.approx(1.14) and fcfs["ttft_p50"]["ok"]
    assert fcfs["ttft_p99"]["ratio"] == pytest.approx(1.31) and not fcfs["ttft_p99"]["ok"]
    assert fcfs["itl_p50"]["ratio"] == pytest.approx(0.85) and fcfs["itl_p50"]["ok"]  # exactly 15% off: on target
    assert fcfs["output_tok_s"]["ratio"] == pytest.approx(0.9)
    assert doc["checks"] == 8 and doc["on_target"] == 7
    ttft_order = [o for o in doc["orderings"] if "ttft" in o["figure"]][0]
    assert ttft_order["real"] == ttft_order["sim"] == ["memfair", "fcfs"] and doc["orderings_same"]
    assert doc["by_policy"] == {"fcfs": {"on_target": 3, "checks": 4}, "memfair": {"on_target": 4, "checks": 4}}
    assert "on target: 7 of 8; by policy: fcfs 3/4, memfair 4/4" in format_report(doc)


def test_a_different_order_is_reported_beyond_ties(tmp_path):
    # real minnow TTFT p99: vtc 90 < fcfs 100 < mcsf 200; simulated: fcfs 80 < vtc 95 < mcsf 210
    real = _write(tmp_path / "real", {("colocated", "fcfs"): ((10, 100), (5, 50), 1.0),
                                      ("colocated", "vtc"): ((10, 90), (5, 40), 1.0),
                                      ("colocated", "mcsf"): ((10, 200), (5, 45), 1.0)})
    sim = _write(tmp_path / "sim", {("colocated", "fcfs"): ((10, 80), (5, 50), 1.0),
                                    ("colocated", "vtc"): ((10, 95), (5, 40), 1.0),
                                    ("colocated", "mcsf"): ((10, 210), (5, 45), 1.0)})
    doc = validate(real, sim)
    ttft = [o for o in doc["orderings"] if "ttft" in o["figure"]][0]
    # 90 and 100 are within 30% of each other: tied, either order passes; both are far below 200
    assert not ttft["same"] and ttft["consistent"] and ttft["discordant"] == []
    assert ttft["apart"] == 2  # vtc and fcfs each apart from mcsf, not from each other
    assert "same beyond ties" in format_report(doc)
    # ITL p99 real: vtc 40 < mcsf 45 < fcfs 50 (all tied), simulated the same: same both ways
    itl = [o for o in doc["orderings"] if "itl" in o["figure"]][0]
    assert itl["same"] and itl["consistent"] and doc["orderings_consistent"] and not doc["orderings_same"]
    assert itl["apart"] == 0
    # mcsf simulated below vtc, 2.2x apart in the real runs: discordant
    sim2 = _write(tmp_path / "sim2", {("colocated", "fcfs"): ((10, 80), (5, 50), 1.0),
                                      ("colocated", "vtc"): ((10, 95), (5, 40), 1.0),
                                      ("colocated", "mcsf"): ((10, 85), (5, 45), 1.0)})
    doc = validate(real, sim2)
    ttft = [o for o in doc["orderings"] if "ttft" in o["figure"]][0]
    assert ttft["discordant"] == [["vtc", "mcsf"]] and not doc["orderings_consistent"]
    assert "DIFFERENT: vtc < mcsf in the real runs, not simulated" in format_report(doc)


def test_folders_without_matching_runs_are_refused(tmp_path):
    real = _write(tmp_path / "real", {("colocated", "fcfs"): ((10, 100), (5, 50), 1.0)})
    sim = _write(tmp_path / "sim", {("disagg", "fcfs"): ((10, 100), (5, 50), 1.0)})
    with pytest.raises(CliError, match="no \\(mode, policy\\) run is in both"):
        validate(real, sim)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CliError, match="no results files"):
        validate(str(tmp_path / "empty"), sim)


def _prefix_results(hit: float | None, ttft_p50: float) -> dict:
    return {"meta": {"workload": "trace:conv.jsonl", "cost": "calibrated:x"}, "requests": [],
            "summary": {"prefix_hit_rate": hit, "prefix_hit_rate_ideal": 0.171,
                        "overall": {"ttft_ms": {"p50": ttft_p50}}}}


def test_prefix_sharing_against_its_targets(tmp_path, capsys):
    from pdtb.sim.repro.validate_prefix import compare, main

    row = compare(_prefix_results(0.157, 200.0), _prefix_results(0.170, 172.0))
    assert row["hit_rate"]["points"] == pytest.approx(0.013) and row["hit_rate"]["ok"]
    assert row["ttft_p50_ms"]["ratio"] == pytest.approx(0.86) and row["ttft_p50_ms"]["ok"]
    off = compare(_prefix_results(0.157, 200.0), _prefix_results(0.180, 100.0))
    assert not off["hit_rate"]["ok"] and not off["ttft_p50_ms"]["ok"]  # 2.3 points; half the TTFT
    assert not compare(_prefix_results(None, 200.0), _prefix_results(0.17, 200.0))["hit_rate"]["ok"]
    files = []
    for name, doc in (("r", _prefix_results(0.157, 200.0)), ("s", _prefix_results(0.170, 172.0))):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        files.append(str(tmp_path / f"{name}.json"))
    assert main([*files, "--out", str(tmp_path / "v.json")]) == 0
    assert "(ok)" in capsys.readouterr().out and json.loads((tmp_path / "v.json").read_text())["rows"][0]["hit_rate"]["ok"]
    with pytest.raises(CliError, match="in pairs"):
        main(files[:1])


def test_the_sets_summary_counts_every_run_but_the_fitted_one_as_held_out(tmp_path):
    from pdtb.sim.repro.validate_sets import format_report as sets_report
    from pdtb.sim.repro.validate_sets import summarize

    out = tmp_path / "out"
    out.mkdir()
    real = {("disagg", "fcfs"): ((100, 1000), (20, 200), 50.0), ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)}
    on = {("disagg", "fcfs"): ((100, 1000), (20, 200), 50.0), ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)}
    off = {("disagg", "fcfs"): ((200, 1000), (20, 200), 50.0),  # TTFT p50 2x: one figure off
           ("disagg", "memfair"): ((100, 2000), (20, 100), 50.0)}  # TTFT p99 5x: off, and the order flips
    for name, sim in (("validate-grid.json", on), ("validate-load3-grid.json", off)):
        r, s = _write(tmp_path / f"r-{name}", real), _write(tmp_path / f"s-{name}", sim)
        (out / name).write_text(json.dumps(validate(r, s)))
    doc = summarize(out, ["quick", "load3"], ["grid", "logs"])
    g = doc["kinds"]["grid"]
    assert list(doc["kinds"]) == ["grid"]  # no logs files: left out
    assert g["by_set"] == {"quick": {"fcfs": [4, 4], "memfair": [4, 4]}, "load3": {"fcfs": [3, 4], "memfair": [3, 4]}}
    # held out: quick memfair 4/4, load3 fcfs 3/4 and memfair 3/4 (quick fcfs is the fit's own)
    assert g["held_out"] == [10, 12] and g["held_out_share"] == pytest.approx(10 / 12)
    assert g["orders_same"] == 3 and g["orders_consistent"] == 3 and len(g["orders"]) == 4
    assert g["pairs"] == [3, 4]  # fcfs and memfair apart in each of the four orders; one flipped
    text = sets_report(doc)
    assert "held out 10 of 12 on target (83.3%; bar 85%: NOT met)" in text
    assert "pairs apart ordered the same 3 of 4" in text
    assert "order off: load3 disagg minnow ttft p99: real memfair < fcfs, sim fcfs < memfair" in text
    with pytest.raises(CliError, match="no validate"):
        summarize(out, ["quick", "tenants"], ["cores"])


def test_a_second_real_run_counts_the_figures_the_testbed_repeats(tmp_path):
    from pdtb.sim.repro.validate_sets import format_report as sets_report
    from pdtb.sim.repro.validate_sets import summarize

    out = tmp_path / "out"
    out.mkdir()
    real = {("disagg", "fcfs"): ((100, 1000), (20, 200), 50.0), ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)}
    # the repeat: memfair's TTFT p99 2x (not repeatable), everything else within its target
    rep = {("disagg", "fcfs"): ((110, 1100), (21, 210), 50.0), ("disagg", "memfair"): ((100, 800), (20, 100), 50.0)}
    # the sim: memfair's TTFT p99 and ITL p50 off, fcfs's TTFT p50 off; one is where the testbed does not repeat
    sim = {("disagg", "fcfs"): ((200, 1000), (20, 200), 50.0), ("disagg", "memfair"): ((100, 900), (30, 100), 50.0)}
    r, p, s = (_write(tmp_path / n, runs) for n, runs in (("r", real), ("p", rep), ("s", sim)))
    for tag in ("", "load3-"):  # quick (the fit's set) and load3 both; only quick repeated
        (out / f"validate-{tag}grid.json").write_text(json.dumps(validate(r, s)))
        (out / f"validate-{tag}grid-mean.json").write_text(json.dumps(validate(r, s, also_real=[p])))
    (out / "validate-repeat.json").write_text(json.dumps(validate(r, p)))
    doc = summarize(out, ["quick", "load3"], ["grid", "grid-mean", "repeat"])
    g, rp = doc["kinds"]["grid"], doc["kinds"]["repeat"]
    # held out: quick memfair 2/4, load3 fcfs 3/4 and memfair 2/4
    assert g["held_out"] == [7, 12] and rp["held_out"] == [3, 4] and doc["repeat_sets"] == ["quick"]
    # in quick alone (load3 has no repeat), memfair's figures the repeat has on target: TTFT p50, ITL p50 and
    # p99; the sim has 2 of those 3 (quick's fcfs is the fit's own: left out)
    assert g["held_out_repeatable"] == [2, 3] and "held_out_repeatable" not in rp
    gm = doc["kinds"]["grid-mean"]
    assert set(gm["by_set"]) == {"quick", "load3"} and gm["by_set"]["quick"]["memfair"] == [2, 4]
    text = sets_report(doc)
    assert "the testbed repeat: held out 3 of 4 on target (75.0%)" in text and "the ceiling" in text
    assert "held out where the testbed repeats itself (quick): 2 of 3 (66.7%)" in text
    # without the repeat asked for, a file left behind is not read
    assert "held_out_repeatable" not in summarize(out, ["quick", "load3"], ["grid"])["kinds"]["grid"]


def test_more_real_runs_make_the_reference_their_geometric_mean(tmp_path):
    real = _write(tmp_path / "real", {("disagg", "fcfs"): ((100, 1000), (20, 200), 50.0),
                                      ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)})
    rep = _write(tmp_path / "rep", {("disagg", "fcfs"): ((400, 1000), (20, 200), 50.0)})  # memfair not repeated
    sim = _write(tmp_path / "sim", {("disagg", "fcfs"): ((200, 1000), (20, 200), 50.0),
                                    ("disagg", "memfair"): ((100, 400), (20, 100), 50.0)})
    alone = validate(real, sim)
    both = validate(real, sim, also_real=[rep])
    f_alone, f_both = alone["runs"][0]["classes"][0], both["runs"][0]["classes"][0]
    assert f_alone["ttft_p50"]["ratio"] == pytest.approx(2.0) and not f_alone["ttft_p50"]["ok"]
    # sqrt(100 * 400) = 200: the simulated 200 is on the two runs' mean
    assert f_both["ttft_p50"]["real"] == pytest.approx(200.0) and f_both["ttft_p50"]["ok"]
    assert both["runs"][1]["classes"][0]["ttft_p99"]["real"] == pytest.approx(400.0)  # one run: its own figure
    assert [r["real_runs"] for r in both["runs"]] == [2, 1] and [r["real_runs"] for r in alone["runs"]] == [1, 1]
