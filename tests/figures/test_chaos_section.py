"""docs/results.md's fault-campaign section from chaos reports written by hand."""
from __future__ import annotations

import json

from pdtb.figures.chaos_section import CHAOS_HEADING, render
from pdtb.figures.results_doc import main


def report(**kw) -> dict:
    return {"command": "pdtb chaos --duration 60 --seed 3", "seed": 3, "duration_s": 60.0, "requests": 120,
            "faults": {"kill-decode": 2, "pause": 1}, "outcomes": {"completed": 110, "cut-router": 10},
            "violations": [], "quiet": {"quiet": True, "seconds": 1.5},
            "rss": {"decode-0 pid 1": {"growth": 1.012}, "prefill-0 pid 2": {"growth": 1.004}}, **kw}


def test_the_section_has_one_row_per_transport_zmq_first(tmp_path):
    (tmp_path / "shm.json").write_text(json.dumps(report(violations=[{"kind": "wrong", "what": "token 3 differs"}],
                                                         quiet={"quiet": False}, rss={})))
    (tmp_path / "zmq.json").write_text(json.dumps(report()))
    lines = render(str(tmp_path), "on today, commit abc")
    rows = [ln for ln in lines if ln.startswith("| zmq") or ln.startswith("| shm")]
    assert rows == ["| zmq | 60 s, seed 3 | 3: kill-decode 2, pause 1 | 120: completed 110, cut-router 10 | 0 | "
                    "1.012x | 1.5 s |",
                    "| shm | 60 s, seed 3 | 3: kill-decode 2, pause 1 | 120: completed 110, cut-router 10 | 1 | - | no |"]
    assert "- violation, wrong: token 3 differs" in lines and "commit abc" in lines[2]
    (tmp_path / "drill.json").write_text(json.dumps({"command": "pdtb chaos --router-drill 32", "streams": 32,
                                                     "cut_at_client": 32, "seconds_to_zero_pages": 0.8,
                                                     "seconds_to_router_back": 3.1,
                                                     "probes_identical_to_generate": True, "violations": []}))
    drill = [ln for ln in render(str(tmp_path)) if ln.startswith("**The router killed")]
    assert drill and "held no page 0.8 s after the kill" in drill[0] and "equal `generate`" in drill[0]
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\n## Clusters placed by Ray\n\nray\n")
    assert main(["--section", "chaos", "--chaos", str(tmp_path), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.index(CHAOS_HEADING) < text.index("## Clusters placed by Ray")
