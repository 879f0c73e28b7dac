"""`pdtb report` on two small results files: both runs in the markdown, every PNG written."""
from __future__ import annotations

from bench_client.records import RequestRecord
from bench_client.report import PLOTS, main
from bench_client.results import build_results, load_results, write_results
from bench_client.samples import cluster_sample
from bench_client.summary import summarize


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
    (tmp_path / "bad.json").write_text("{}")
    assert main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "r2")]) == 2
    assert "not a results file" in capsys.readouterr().err
