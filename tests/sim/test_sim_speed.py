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


def test_the_simulator_runs_without_torch(tmp_path):
    """Its pools hold no storage, so a `pdtb sim` process never pays torch's import (about 2 s of
    a scorecard's 40 processes each); the engine's own modules import it where storage is made."""
    import subprocess
    import sys

    code = ("import sys\nfrom pdtb.sim.cli import main\n"
            "assert main(['--workload', 'whale-minnow', '--duration', '2', '--whales', '1', '--quiet', "
            "'--out', sys.argv[1]]) == 0\n"
            "sys.exit(3 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path / "r.json")], capture_output=True).returncode == 0
    assert (tmp_path / "r.json").is_file()


def test_cputime_writes_a_commands_own_cpu_seconds_and_passes_its_status(tmp_path):
    """`python -m pdtb.cputime FILE -- CMD` (the Azure hour's command cost): a child that spins for
    0.3 s of its own CPU is charged at least that, and its exit status is the command's."""
    import sys

    from pdtb import cputime

    spin = "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nsys.exit(3)"
    out = tmp_path / "cpu_s"
    assert cputime.main([str(out), "--", sys.executable, "-c", spin]) == 3
    assert float(out.read_text()) >= 0.3
    assert cputime.main([str(out)]) == 2  # (no command: the usage, and nothing run)
