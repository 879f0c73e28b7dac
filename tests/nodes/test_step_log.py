"""The per-step log: what each engine step ran, checked against the steps driven by hand."""
from __future__ import annotations

import json

from conftest import make_engine, make_prompts

from pdtb.nodes.step_log import StepLog
from pdtb.engine.sequence import SamplingParams


def test_each_step_logs_its_prefill_chunks_and_decode_rows_by_tenant(llama_dir, tmp_path):
    eng = make_engine(llama_dir, max_num_batched_tokens=64)
    long_p, short_p = make_prompts([100, 5])
    eng.add(eng.make_sequence(long_p, SamplingParams(max_tokens=2, ignore_eos=True), request_id="w", tenant="whale"))
    eng.add(eng.make_sequence(short_p, SamplingParams(max_tokens=4, ignore_eos=True), request_id="m", tenant="minnow"))
    log = StepLog(str(tmp_path / "steps.jsonl"))
    t = 1000.0
    while eng.has_work():
        eng.step()
        log.write(t, 0.002, eng.last_output)
        t += 1
    log.close()
    recs = [json.loads(ln) for ln in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["t"] for r in recs] == [1000.0 + i for i in range(len(recs))] and recs[0]["ms"] == 2.0
    # Step 1: the whale's first 64-token chunk fills the budget. Step 2: the rest of its prompt
    # (36) and the minnow's 5. Then decode rows only, each reading its context so far.
    assert recs[0]["prefill"] == [["whale", "w", 64, 0]] and recs[0]["decode"] == []
    assert sorted(recs[1]["prefill"]) == [["minnow", "m", 5, 0], ["whale", "w", 36, 64]]
    assert sorted(recs[2]["decode"]) == [["minnow", 1, 6], ["whale", 1, 101]]
    assert recs[3]["decode"] == [["minnow", 1, 7]] and recs[3]["prefill"] == []
    decoded = sum(rows for r in recs for _, rows, _ in r["decode"])
    assert decoded == (2 - 1) + (4 - 1)  # every token after the first comes from a decode row
    assert all(r["moves"] == [] and r["unserved"] == 0 for r in recs)
