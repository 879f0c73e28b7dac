"""The simulator's section of the results document, from files of the shapes its commands write."""
from __future__ import annotations

import json

from pdtb.figures.sim_section import render


def test_section_from_files(tmp_path):
    (tmp_path / "repro-mcsf.json").write_text(json.dumps({
        "paper_mean_ratio": 1.005, "mean_ratio": 1.0384, "median_ratio": 1.0367, "max_ratio": 1.1485, "instances": 40,
        "solved": 40, "config": {"requests": 10, "memory": 24, "arrivals": "batch"}}))
    (tmp_path / "roofline-h200.json").write_text(json.dumps({
        "model": "random:llama-3-8b", "by_kind": {"decode": {"steps": 9, "geomean_ratio": 6.35, "min_ratio": 5.37,
                                                             "max_ratio": 7.17}}}))
    text = "\n".join(render(tmp_path))
    assert "| mean MC-SF / optimum | 1.0384 | 1.005 |" in text
    assert "| decode | 9 | 6.35 | 5.37 .. 7.17 |" in text
    assert "Azure" not in text and "Against the testbed" not in text  # absent files: parts left out
