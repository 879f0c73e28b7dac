"""`pdtb sim speed` on a small trace: every measurement a real `pdtb sim` process, the slice's
two results files identical, and the table the results document prints."""
from __future__ import annotations

import json

import pytest

from pdtb.figures.sim_section import SPEED_HEADING, speed_section
from pdtb.sim.repro.speed import main


@pytest.mark.slow  # three pdtb sim processes
def test_speed_measures_the_hour_and_the_slice_both_ways(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:15:{i // 4:02d}.{(i % 4) * 25:02d}0000,{200 + 37 * i % 400},{20 + 11 * i % 60}" for i in range(24)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    assert main(["--trace", str(trace), "--policies", "vtc", "--slice", "12", "--dir", str(tmp_path / "d"),
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in doc["rows"]] == ["vtc"]
    for r in doc["rows"]:
        h, s = r["hour"], r["slice"]
        assert h["steps"] > 0 and h["events"] > 0 and 0 < h["steps_in_runs"] < h["steps"]
        assert s["identical"] and s["every_step"]["steps_in_runs"] == 0 and s["runs"]["steps_in_runs"] > 0
        assert s["every_step"]["steps"] == s["runs"]["steps"]
        assert s["every_step"]["events"] > s["runs"]["events"]
        # CPU seconds of the process itself: the event loop's are part of the whole command's
        assert 0 < h["simulation_s"] <= h["command_s"] and 0 < s["runs"]["simulation_s"] <= s["runs"]["command_s"]
    lines = speed_section(doc)
    assert lines[0] == SPEED_HEADING and any(ln.startswith("| vtc |") and ln.endswith("| yes |") for ln in lines)
