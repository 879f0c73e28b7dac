"""docs/findings.md (pdtb/figures/findings.py): drawn from a results.sh run's folders, made by hand
here with figures computed by hand; and the page in the repository: every section with its answer,
a plot that exists, a reproducing command, at the commit of docs/results.md."""
from __future__ import annotations

import json
import re
from pathlib import Path

from pdtb.figures.findings import main as findings

ROOT = Path(__file__).resolve().parents[2]


def _request(tenant: str, klass: str, ttft: float, gaps: list[float], t0: float = 0.0) -> dict:
    times, t = [], t0 + ttft
    for g in [0.0, *gaps]:
        t += g
        times.append(t)
    return {"tenant": tenant, "class": klass, "prompt_tokens": 24, "output_tokens": len(times),
            "requested_output_tokens": len(times), "send_time": t0, "first_token_time": t0 + ttft,
            "token_times": times, "end_time": times[-1], "status": "ok"}


def _sample(t: float, role: str, pages: dict, total: int = 100, quota: dict | None = None) -> dict:
    return {"t": t, "nodes": [{"role": role, "id": f"{role}-0", "pages_total": total, "pages_free": total - sum(pages.values()),
                               "tenant_pages": pages, "quota": quota or {}}]}


def _run(path: Path, mode: str, minnow_ttft: float, whale_pages: list[int], tok_s: float) -> None:
    role = "colocated" if mode == "colocated" else "decode"
    reqs = [_request("minnow", "minnow", minnow_ttft, [0.01, 0.01]) for _ in range(3)]
    reqs.append(_request("whale", "whale", 2.0, [0.05, 0.05]))
    samples = [_sample(i, role, {"whale": w, "minnow": 10}, quota={"whale": 50, "minnow": 50})
               for i, w in enumerate(whale_pages)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {"mode": mode}, "requests": reqs, "samples": samples,
                                "summary": {"overall": {"output_tok_s": tok_s, "goodput_rps": 1.0, "failed": 0},
                                            "per_class": {}}}))


def _claims(path: Path, rate: float, fcfs: tuple[float, float], memfair: tuple[float, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ev = {p: {"with_whales": w, "alone": a, "ratio": round(w / a, 3) if a else None}
          for p, (w, a) in (("fcfs", fcfs), ("memfair", memfair))}
    path.write_text(json.dumps({"config": {"minnow_rate": rate, "whales": 3, "whale_interval": 10.0},
                                "pages": {"page_ratio": 64.0},
                                "top5": {"pool_mean": 0.2, "pool_max": 0.36, "used_mean": 0.25, "requests_in_pool_mean": 100,
                                         "by_hand_used": 0.771},
                                "evictions": ev}))


def test_findings_from_a_runs_folder(tmp_path):
    runs = tmp_path / "run"
    # whales hold 30, 70 and 90 of 100 pages beside the minnows' 10: a mean share of 63.3%
    _run(runs / "fair" / "colocated-fcfs.json", "colocated", 4.0, [30, 70, 90], 400.0)
    _run(runs / "fair" / "colocated-memfair.json", "colocated", 0.1, [20, 40, 60], 400.0)
    _run(runs / "fair" / "disagg-fcfs.json", "disagg", 3.0, [50, 90], 380.0)
    _run(runs / "fair" / "disagg-memfair.json", "disagg", 0.2, [50, 50], 360.0)
    _run(runs / "findings" / "nodecode" / "disagg-memfair-fcfs-decode.json", "disagg", 0.5, [90, 90], 370.0)
    _claims(runs / "findings" / "claims" / "rate-20.json", 20, (0.04, 0.01), (0.8, 0.016))
    _claims(runs / "findings" / "claims" / "rate-8.json", 8, (0.02, 0.0), (0.02, 0.0))
    out = tmp_path / "docs" / "findings.md"
    out.parent.mkdir()
    assert findings(["--runs", str(runs), "--out", str(out), "--stamp", "on a day, commit abc1234"]) == 0
    text = out.read_text()
    assert "commit abc1234" in text
    assert "| colocated | 63% | 40% | 1 of 4 |" in text  # 190/300 and 120/300 of the pages
    assert "| disagg | 70% | 50% | 1 of 4 |" in text
    # the eviction ratio exists only where minnows are evicted alone: 0.04 / 0.01 = 4x at 20/s
    assert "at 8 minnows/s they never are" in text and "4.00x at 20/s" in text
    assert "0.80 moves per minnow against fcfs's 0.04 at 20/s" in text
    # minnow TTFT p99 by hand: every minnow's TTFT is the run's figure
    assert "| CPU | disagg | memfair prefill, fcfs decode | 500 ms |" in text
    for name in ("findings-kv-share.png", "findings-claims.png", "findings-decode-quota.png", "findings-ttft-cdf.png"):
        assert f"(img/{name})" in text and (out.parent / "img" / name).stat().st_size > 1000


def test_the_findings_page_answers_every_question_with_a_plot_and_a_command_at_the_results_commit():
    page = (ROOT / "docs" / "findings.md").read_text()
    results = (ROOT / "docs" / "results.md").read_text()
    sections = re.split(r"\n## ", page)[1:]
    titles = [s.splitlines()[0] for s in sections]
    for want in ("64 times", "80% of HBM", "evictions 2-4x", "granularity", "Static against dynamic",
                 "frontier", "Disaggregation"):
        assert any(want in t for t in titles), f"no section on {want}"
    for s in sections:
        images = re.findall(r"\]\(img/([\w.-]+\.png)\)", s)
        assert images and all((ROOT / "docs" / "img" / i).is_file() for i in images), s.splitlines()[0]
        assert "Reproduce: `" in s and re.search(r"\d", s.split("\n\n")[1]), s.splitlines()[0]
    commit = re.search(r"commit ([0-9a-f]{7,40})", page).group(1)
    assert f"commit {commit}" in results.split("\n\n")[1]


def test_a_load_where_memfair_loses_the_tail_is_read_against_capacity():
    from pdtb.figures.findings import _past_capacity

    def claim(rate, over, fcfs_p99, alone_p99, fcfs_p50, memfair_p50):
        return {"config": {"minnow_rate": rate}, "memfair_over_fcfs": {"minnow_ttft_p99": over, "minnow_itl_p99": 0.35},
                "runs": {"fcfs": {"minnow_ttft_p99_ms": fcfs_p99, "minnow_ttft_p50_ms": fcfs_p50},
                         "fcfs_alone": {"minnow_ttft_p99_ms": alone_p99},
                         "memfair": {"minnow_ttft_p50_ms": memfair_p50}}}

    assert _past_capacity([claim(8, 0.17, 900.0, 150.0, 80.0, 60.0)]) == []  # memfair wins the tail: nothing to read
    lines = _past_capacity([claim(8, 0.17, 900.0, 150.0, 80.0, 60.0), claim(14, 1.16, 25_000.0, 175.0, 13_500.0, 5_400.0),
                            claim(20, 1.05, 40_000.0, 300.0, 20_000.0, 9_000.0)])
    assert len(lines) == 1  # the lowest losing load only
    # 5,400 / 13,500 = 0.40 by hand
    assert "At 14 minnows/s" in lines[0] and "25,000 ms against 175 ms" in lines[0]
    assert "TTFT p50 0.40x fcfs's, ITL p99 0.35x" in lines[0]
