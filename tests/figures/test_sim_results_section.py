"""The simulator's section of the results document and its validation page, from files of the shapes
its commands write."""
from __future__ import annotations

import json

from pdtb.figures.sim_section import render, validation_page


def test_section_from_files(tmp_path):
    (tmp_path / "repro-mcsf.json").write_text(json.dumps({
        "paper_mean_ratio": 1.005, "mean_ratio": 1.0384, "median_ratio": 1.0367, "max_ratio": 1.1485, "instances": 40,
        "solved": 40, "config": {"requests": 10, "memory": 24, "arrivals": "batch"}}))
    (tmp_path / "roofline-h200.json").write_text(json.dumps({
        "model": "random:llama-3-8b", "by_kind": {"decode": {"steps": 9, "geomean_ratio": 6.35, "min_ratio": 5.37,
                                                             "max_ratio": 7.17}}}))
    page = "\n".join(validation_page(tmp_path))
    assert "| mean MC-SF / optimum | 1.0384 | 1.005 |" in page
    assert "| decode | 9 | 6.35 | 5.37 .. 7.17 |" in page and page.count("\n## ") == 2  # headings one level up
    assert "Azure" not in page and "Against the testbed" not in page  # absent files: parts left out
    text = "\n".join(render(tmp_path))  # results.md: a line on them and the link
    assert "(sim-validation.md)" in text and "| mean MC-SF" not in text
    assert "MC-SF at 1.0384 of the hindsight optimum on average (paper 1.005)" in text
    assert "H200 steps at 6.35x (decode) the roofline's time" in text


def test_the_sets_summary_renders_per_policy_and_set(tmp_path):
    (tmp_path / "validate").mkdir()
    order = {"set": "load3", "mode": "disagg", "figure": "minnow ttft p99", "real": ["memfair", "fcfs"],
             "sim": ["fcfs", "memfair"], "same": False, "consistent": False, "discordant": [["memfair", "fcfs"]]}
    (tmp_path / "validate" / "validate-sets.json").write_text(json.dumps({
        "sets": ["quick", "load3"], "fitted": "fcfs", "bar": 0.85, "kinds": {"spread": {
            "by_set": {"quick": {"fcfs": [8, 8], "memfair": [7, 8]}, "load3": {"fcfs": [6, 8]}},
            "held_out": [13, 16], "held_out_share": 13 / 16, "orders_same": 1, "orders_consistent": 1,
            "orders": [order, {**order, "set": "quick", "same": True, "consistent": True}]}}}))
    text = "\n".join(validation_page(tmp_path))
    assert "| spread | fcfs | 8/8 | 6/8 |" in text and "| spread | memfair | 7/8 | - |" in text
    assert "**held out: 13/16 = 81.2%**" in text and "orders same 1, beyond ties 1 of 2" in text
    assert "- spread, load3 disagg minnow ttft p99: real memfair < fcfs; sim fcfs < memfair" in text
    summary = render(tmp_path)  # results.md: the held-out share and orders per calibration, at most ten lines
    assert "| held out on target | 13/16 = 81.2% |" in summary and "| orders the same beyond ties | 1 of 2 |" in summary
    assert not any(x.startswith("| where the testbed repeats itself") for x in summary)  # no repeat: no row
    assert len(summary) <= 2 + 10 and "| spread | fcfs |" not in "\n".join(summary)


def test_the_sets_summary_shows_the_repeat_and_the_repeatable_share(tmp_path):
    (tmp_path / "validate").mkdir()
    kind = {"by_set": {"quick": {"memfair": [3, 4]}}, "held_out": [3, 4], "held_out_share": 0.75, "orders_same": 0,
            "orders_consistent": 0, "orders": [], "pairs": [5, 7]}
    (tmp_path / "validate" / "validate-sets.json").write_text(json.dumps({
        "sets": ["quick"], "fitted": "fcfs", "bar": 0.85, "repeat_sets": ["quick"],
        "kinds": {"spread": {**kind, "held_out_repeatable": [2, 3]}, "repeat": kind}}))
    text = "\n".join(validation_page(tmp_path))
    assert "**held out: 3/4 = 75.0%**; where the testbed repeats itself 2/3 = 66.7%" in text
    assert "*repeat*: each set's real runs made a second time" in text and "in the sets run twice (quick)" in text
    assert '--repeat-sets "quick"`' in text
    summary = "\n".join(render(tmp_path))
    assert "| calibration | spread | repeat |" in summary
    assert "| pairs of policies apart, ordered the same | 5 of 7 | 5 of 7 |" in summary
    assert "where the testbed repeats itself" not in summary  # (the page has it: the summary keeps ten lines)
