"""The per-verdict table across transports (pdtb.figures.admissions) and the results section
that holds it with the one-sided figures (results_doc --section transports), from results files
made here: counts summed over decode nodes from each run's last sample, compared to the first
transport's; the section replaced in place, the rest of the document kept."""
from __future__ import annotations

import json

from pdtb.figures.admissions import admissions_of, main as admissions_main, table
from pdtb.figures.results_doc import RAY_HEADING, TRANSPORTS_HEADING, main as results_doc


def results(adm_by_node: list[dict], earlier: list[dict] | None = None) -> dict:
    def sample(t, adms):
        return {"t": t, "nodes": [{"role": "decode", "admissions": a} for a in adms] + [{"role": "prefill", "admissions": {}}]}
    samples = ([sample(0.5, earlier)] if earlier else []) + [sample(9.0, adm_by_node)]
    return {"meta": {}, "requests": [], "summary": {}, "samples": samples}


def write(tmp_path, transport: str, policy: str, adms: list[dict]) -> None:
    d = tmp_path / transport
    d.mkdir(parents=True, exist_ok=True)
    (d / f"disagg-{policy}.json").write_text(json.dumps(results(adms, earlier=[{"accept": 1}])))


def test_counts_are_the_last_samples_summed_over_decode_nodes(tmp_path):
    r = results([{"accept": 3, "park": 1}, {"accept": 2, "defer": 4, "defer_answers": 9}], earlier=[{"accept": 1}])
    assert admissions_of(r) == {"accept": 5, "park": 1, "defer": 4, "refuse": 0, "defer_answers": 9}
    assert admissions_of({"samples": []}) == {v: 0 for v in ("accept", "park", "defer", "refuse", "defer_answers")}


def test_the_table_says_which_transport_differs(tmp_path, capsys):
    write(tmp_path, "zmq", "fcfs", [{"accept": 10, "park": 2, "defer": 1, "defer_answers": 5}])
    write(tmp_path, "shm", "fcfs", [{"accept": 10, "park": 2, "defer": 1, "defer_answers": 5}])
    write(tmp_path, "torch", "fcfs", [{"accept": 11, "park": 1, "defer": 1, "defer_answers": 7}])
    lines, same = table([tmp_path / "zmq", tmp_path / "shm", tmp_path / "torch"])
    assert not same
    assert "fcfs      accept               10       10       11" in lines
    assert lines[-1] == "fcfs      vs zmq: every count: shm: same, torch: differs"
    assert admissions_main([str(tmp_path / "zmq"), str(tmp_path / "shm")]) == 0
    assert "shm: same" in capsys.readouterr().out
    assert admissions_main([str(tmp_path / "nope")]) == 2


def lockstep(tmp_path, transport: str, policy: str, verdicts: dict, tokens: str = "ab") -> None:
    d = tmp_path / transport
    d.mkdir(parents=True, exist_ok=True)
    counts = {}
    for vs in verdicts.values():
        for v in vs:
            counts[v] = counts.get(v, 0) + 1
    (d / f"disagg-{policy}.json").write_text(json.dumps({"lockstep": True, "step_s": 0.02, "admissions": counts,
                                                         "verdicts": verdicts, "tokens_sha256": tokens}))


def test_lockstep_results_are_compared_request_by_request(tmp_path, capsys):
    lockstep(tmp_path, "zmq", "fcfs", {"r0": ["accept"], "r1": ["defer", "park"]})
    lockstep(tmp_path, "shm", "fcfs", {"r0": ["accept"], "r1": ["defer", "park"]})
    lockstep(tmp_path, "torch", "fcfs", {"r0": ["defer", "park"], "r1": ["accept"]})  # the same counts
    lines, same = table([tmp_path / "zmq", tmp_path / "shm", tmp_path / "torch"])
    assert not same and "fcfs      defer                 1        1        1" in lines
    assert lines[-1] == ("fcfs      vs zmq: every count: shm: same, torch: same; every request's verdicts: "
                         "shm: same, torch: differs; tokens: shm: same, torch: same")
    assert admissions_main(["--check", str(tmp_path / "zmq"), str(tmp_path / "shm")]) == 0
    assert admissions_main(["--check", str(tmp_path / "zmq"), str(tmp_path / "torch")]) == 1
    lockstep(tmp_path, "shm", "fcfs", {"r0": ["accept"], "r1": ["defer", "park"]}, tokens="cd")
    assert admissions_main(["--check", str(tmp_path / "zmq"), str(tmp_path / "shm")]) == 1
    assert "tokens: shm: differs" in capsys.readouterr().out


def test_the_transports_section_is_replaced_in_place(tmp_path):
    for t in ("zmq", "zmq-again", "shm"):
        write(tmp_path / "verdicts" / "live", t, "memfair", [{"accept": 4 if t != "zmq-again" else 3}])
    for t in ("zmq", "shm"):
        lockstep(tmp_path / "verdicts" / "lockstep", t, "memfair", {"r0": ["accept"]})
    shm = {"size_mib": 64, "shm_gbps": 6.0, "ratio_vs_zmq_ipc": 3.0, "ratio_paired_median": 3.2, "ratio_vs_pool_copy": 0.5,
           "shm_write_gbps": 5.0, "write_ratio_vs_zmq_ipc": 2.5, "write_ratio_paired_median": 2.6,
           "write_ratio_vs_pool_copy": 0.42, "write_ratio_vs_checked_copy": 0.62, "shm_unchecked_gbps": 7.0,
           "unchecked_ratio_vs_zmq_ipc": 3.5, "zmq_ipc_gbps": 2.0, "pool_copy_gbps": 12.0, "checked_copy_gbps": 8.0}
    (tmp_path / "shm.json").write_text(json.dumps(shm))
    link = {"n": 100, "zmq": {"median_us": 400.0, "p10_us": 300.0}, "link": {"median_us": 100.0, "p10_us": 50.0},
            "ratio_median": 4.0}
    (tmp_path / "link.json").write_text(json.dumps(link))
    (tmp_path / "commit").write_text("abc1234\n")
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\n## KV transport against raw pyzmq\n\nold\n\n## Prefix caching\n\nkept\n")
    args = ["--section", "transports", "--shm", str(tmp_path / "shm.json"), "--admissions", str(tmp_path / "verdicts"),
            "--link", str(tmp_path / "link.json"), "--commit-file", str(tmp_path / "commit"), "--out", str(doc)]
    assert results_doc(args) == 0
    text = doc.read_text()
    assert text.index(TRANSPORTS_HEADING) < text.index("## Prefix caching") and "kept" in text and "old" in text
    assert "commit abc1234" in text and "| 64 | 6.00 | **3.00x** (3.20x) | **0.50x** | 5.00 | 2.50x (2.60x) | 0.42x | 0.62x | 7.00 | 3.50x | 2.00 |" in text \
        and "| 12.00 | 8.00 |" in text
    assert "every request's verdicts, every count and the generated tokens equal zmq's" in text
    assert "a virtual clock of 20 ms per engine step" in text
    assert text.index("In lockstep") < text.index("Live (real clusters") < text.index("## Prefix caching")
    # the two listings as one table: a column a policy where every transport agreed (lockstep), else a
    # column a transport (live: zmq-again accepted 3 where zmq and shm accepted 4)
    assert "| verdict | lockstep memfair (zmq, shm) | live memfair zmq | live memfair zmq-again | live memfair shm |" \
        in text and "| accept | 1 | 4 | 3 | 4 |" in text
    assert "over ipc 400 us (300)" in text and "local link" in text and "**4.00x**" in text
    assert results_doc(args) == 0 and doc.read_text().count(TRANSPORTS_HEADING) == 1
    import shutil  # a quick run's lockstep alone: the live runs said to be the full run's

    shutil.rmtree(tmp_path / "verdicts" / "live")
    assert results_doc(args) == 0
    text = doc.read_text()
    assert "In lockstep" in text and "Live (real clusters" not in text and "in the full run alone" in text


def test_the_ray_section_lists_each_test_and_where_it_ran(tmp_path):
    junit = tmp_path / "ray.xml"
    junit.write_text('<testsuites><testsuite name="pytest"><testcase classname="t" name="test_a" time="40.2"/>'
                     '<testcase classname="t" name="test_b" time="90"><failure message="x"/></testcase>'
                     '<testcase classname="t" name="test_c" time="0"><skipped message="no ray"/></testcase>'
                     '</testsuite></testsuites>')
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\n## The simulator (`pdtb sim`)\n\nkept\n")
    (tmp_path / "commit").write_text("abc1234\n")
    assert results_doc(["--section", "ray", "--ray-junit", str(junit), "--ray-seconds", "131",
                        "--link", str(tmp_path / "link.json"), "--commit-file", str(tmp_path / "commit"), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert text.index(RAY_HEADING) < text.index("## The simulator") and "kept" in text
    assert "| `test_a` | passed | 40 |" in text and "| `test_b` | failed | 90 |" in text
    assert "| `test_c` | skipped: no ray | 0 |" in text and "local Ray cluster only" in text and "131 s" in text
