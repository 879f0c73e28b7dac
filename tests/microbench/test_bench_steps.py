"""`pdtb bench steps`: every composition asked for is measured, bad sizes are refused."""
from __future__ import annotations

import json

from tests.project.test_cli import run_pdtb


def test_bench_steps_measures_each_composition(llama_dir):
    r = run_pdtb("bench", "steps", "--model", llama_dir, "--reps", "2", "--rows", "2", "--row-len", "5",
                 "--long-rows", "1,2", "--long-len", "40", "--chunks", "4,8", "--offsets", "0,30", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    want = {"base", "+1 long row (40)", "+2 long rows (40)"} | {f"+chunk {n} @ {o}" for n in (4, 8) for o in (0, 30)}
    assert set(res["step_ms"]) == want
    assert all(v > 0 for v in res["step_ms"].values())
    assert set(res["added_ms"]) == want - {"base"}
    assert res["threads"] == 1
    assert res["gathered_rows_timed"] == 0  # timed steps append to the read caches, as serving does


def test_bench_steps_refuses_bad_sizes(llama_dir):
    r = run_pdtb("bench", "steps", "--model", llama_dir, "--chunks", "0")
    assert r.returncode == 2 and "positive" in r.stderr
