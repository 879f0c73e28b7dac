"""`pdtb report` on two small results files: both runs in the markdown, every PNG written."""
from __future__ import annotations

import json

import pytest

from pdtb.figures.records import RequestRecord
from pdtb.figures.report import PLOTS, main
from pdtb.figures.results import build_results, load_results, write_results
from pdtb.figures.samples import cluster_sample
from pdtb.figures.summary import summarize


def make_results(path, mode, policy, ttft, tenant_pages):
    recs = [RequestRecord(t, k, 16, 3, output_tokens=3, send_time=i * 0.1, first_token_time=i * 0.1 + ttft,
                          token_times=[i * 0.1 + ttft + 0.02 * j for j in range(3)], end_time=i * 0.1 + ttft + 0.04,
                          status="ok")
            for i, (t, k) in enumerate([("A", "whale"), ("B", "minnow"), ("B", "minnow"), ("A", "minnow")])]
    nodes = [{"role": "decode", "id": "d0", "pages_total": 64, "pages_free": 40,
              "extra": {"tenant_pages": {"A": 20, "B": 4}} if tenant_pages else {}}]
    samples = [cluster_sample(t, nodes) for t in (0.0, 0.25, 0.5)]
    meta = {"workload": "whale-minnow", "seed": 0, "mode": mode, "policy": policy, "arrival": "poisson/open-loop"}
    write_results(path, build_results(meta, recs, summarize(recs, 1.0, window=0.25), samples))
    return path


def test_report_two_runs(tmp_path, capsys):
    a = make_results(tmp_path / "a.json", "disagg", "fcfs", 0.05, tenant_pages=True)
    b = make_results(tmp_path / "b.json", "disagg", "vtc", 0.08, tenant_pages=False)  # falls back to pages in use
    assert load_results(a)["meta"]["version"] == 1
    out = tmp_path / "report"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "report.md")
    md = (out / "report.md").read_text()
    assert "| metric | disagg/fcfs | disagg/vtc |" in md
    assert "**class whale** TTFT p50 (ms) | 50.0 | 80.0 |" in md
    assert "**class minnow** TTFT p99 (ms)" in md and "Jain index" in md and "max service gap" in md
    for name, _ in PLOTS:
        assert (out / name).stat().st_size > 1000 and f"]({name})" in md


def test_report_same_label_and_bad_file(tmp_path, capsys):
    a = make_results(tmp_path / "one.json", "colocated", "fcfs", 0.05, True)
    b = make_results(tmp_path / "two.json", "colocated", "fcfs", 0.05, True)
    assert main([str(a), str(b), "--out", str(tmp_path / "r")]) == 0
    assert "colocated/fcfs (one) | colocated/fcfs (two)" in (tmp_path / "r" / "report.md").read_text()
    for d in ("x", "y"):  # the same file name in two folders: both runs kept, told apart by folder
        (tmp_path / d).mkdir()
        make_results(tmp_path / d / "r.json", "colocated", "fcfs", 0.05, True)
    assert main([str(tmp_path / "x" / "r.json"), str(tmp_path / "y" / "r.json"), "--out", str(tmp_path / "r3")]) == 0
    assert "colocated/fcfs (x/r) | colocated/fcfs (y/r)" in (tmp_path / "r3" / "report.md").read_text()
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "r2")]) == 2
    assert "not a results file" in capsys.readouterr().err


def test_compare_ratios_and_what_the_whales_paid(tmp_path, capsys):
    from pdtb.figures.compare import main as compare

    a = make_results(tmp_path / "a.json", "disagg", "fcfs", 0.05, True)
    b = make_results(tmp_path / "b.json", "disagg", "memfair", 0.02, True)
    assert compare([str(a), str(b), "--json"]) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    # minnow TTFT is 50 ms vs 20 ms in every request (by construction above): the ratio by hand
    assert rows["memfair"]["ttft_p99_ms"] == pytest.approx(20.0)
    assert rows["memfair"]["ttft_p99_ms_ratio"] == pytest.approx(0.4)
    assert rows["fcfs"]["ttft_p99_ms_ratio"] == pytest.approx(1.0)
    assert rows["fcfs"]["cost_ttft_p50_ms"] == pytest.approx(50.0)
    assert rows["memfair"]["cost_ttft_p50_ms"] == pytest.approx(20.0)
    assert rows["memfair"]["cost_tpot_p50_ms"] == pytest.approx(20.0)  # tokens 20 ms apart
    # whale E2E: its TTFT plus two token gaps of 20 ms: 90 ms under fcfs, 60 under memfair
    assert rows["memfair"]["cost_e2e_p50_ms"] == pytest.approx(60.0)
    assert rows["memfair"]["cost_e2e_p50_ms_ratio"] == pytest.approx(60 / 90)
    assert rows["fcfs"]["share_jain_min"] is not None
    assert compare([str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "whale TTFT p50 ms" in lines[0] and "whale TPOT p50 ms" in lines[0] and "fair-share worst" in lines[0]
    assert lines[2].split()[:2] == ["disagg", "memfair"] and lines[2].split()[-4:] == ["20.0", "20.0", "60.0", "0.67"]
    assert "whale E2E p50 ms" in lines[0]
    assert compare([str(a), "--cost-class", "none"]) == 0
    assert "TPOT" not in capsys.readouterr().out


def test_compare_refuses_two_baselines_and_shows_a_missing_class_as_missing(tmp_path, capsys):
    from pdtb.figures.compare import main as compare

    a = make_results(tmp_path / "a.json", "disagg", "fcfs", 0.05, True)
    b = make_results(tmp_path / "b.json", "disagg", "fcfs", 0.02, True)
    with pytest.raises(SystemExit) as e:
        compare([str(a), str(b)])
    assert e.value.code == 2 and "several fcfs runs in mode disagg" in capsys.readouterr().err
    assert compare([str(a), "--class", "dolphin", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["ttft_p99_ms"] is None and row["itl_p99_ms"] is None and row["tok_s"] > 0


def test_results_doc_tables_are_what_compare_prints(tmp_path, capsys):
    """docs/results.md and the README headline are rendered from the run's files: the same
    figures `pdtb compare --markdown` prints (one row a policy, the modes side by side), the ratios
    by hand (TTFT 20 ms vs 50 ms: 0.40)."""
    import re

    from pdtb.figures.compare import main as compare
    from pdtb.figures.results_doc import BEGIN, END, main as results_doc

    fair = tmp_path / "fair"
    fair.mkdir()
    for mode in ("colocated", "disagg"):
        make_results(fair / f"{mode}-fcfs.json", mode, "fcfs", 0.05, True)
        make_results(fair / f"{mode}-memfair.json", mode, "memfair", 0.02, True)
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"batch": 32, "prompt_len": 64, "max_tokens": 128, "device": "cpu", "dtype": "float32",
                                  "torch_threads": 2, "decode_kernel": True, "paged_tok_s": 2600.0,
                                  "hf_padded_tok_s": 2000.0, "ratio": 1.3, "ratio_paired_median": 1.25,
                                  "step_ms_median": 5.5}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold figures\n{END}\ntail\n")
    doc = tmp_path / "docs" / "results.md"
    assert results_doc(["--fair", str(fair), "--engine", str(engine), "--out", str(doc), "--readme", str(readme)]) == 0
    capsys.readouterr()
    assert compare([*map(str, sorted(fair.glob("*.json"))), "--markdown"]) == 0
    table = capsys.readouterr().out.strip()
    text = doc.read_text()
    assert "Machine: " in text and "commit " in text
    assert "| disagg | memfair | 20.0 | **0.40** |" in table
    row = next(line for line in text.splitlines() if line.startswith("| memfair |"))
    for line in table.splitlines()[2:]:  # every figure of compare's memfair rows is in the document's row
        if "| memfair |" in line:
            assert all(c in row for c in re.findall(r"\d[\d.]*", line.split("| memfair |")[1]))
    assert row.startswith("| memfair | 20.0 (**0.40**) | 20.0 (1.00) | 33.3 (1.08) |") and row.count("(**0.40**)") == 2
    assert "**1.30x**" in text and "background simulations" not in text
    # the same bench beside the background: 2,340 / 2,600 tok/s = 0.90x by hand
    beside = tmp_path / "engine-beside.json"
    beside.write_text(json.dumps({**json.loads(engine.read_text()), "paged_tok_s": 2340.0}))
    assert results_doc(["--fair", str(fair), "--engine", str(engine), "--engine-beside", str(beside), "--out", str(doc),
                        "--readme", str(readme)]) == 0
    assert "paged engine 2340 tok/s, **0.90x** of its rate alone" in doc.read_text()
    head = readme.read_text()
    assert "old figures" not in head and head.endswith(f"{END}\ntail\n")
    assert "minnow TTFT p99 **0.40x** / **0.40x**" in head and "**1.30x**" in head
