"""docs/results.md's opening summary and the README's headline block (pdtb/figures/headline.py), and the
dense forms its long sections are written in (pdtb/figures/condense.py)."""
from __future__ import annotations

import re
from pathlib import Path

from pdtb.figures.condense import condense
from pdtb.figures.headline import SUMMARY_BEGIN, SUMMARY_END, strip_summary, with_summary
from pdtb.figures.results_doc import BEGIN, END, main as results_doc

ROOT = Path(__file__).resolve().parents[2]
# a figure: not part of a word (p99, bfloat16, 128K, a commit's hash), a ratio's "x" allowed after it
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(\d+(?:,\d{3})*(?:\.\d+)?)(?:x\b|(?!\w))")
COMMIT = re.compile(r"commit ([0-9a-f]{7,40})")


def _between(text: str, begin: str, end: str) -> str:
    assert begin in text and end in text, f"no {begin} ... {end} block"
    return text[text.index(begin) + len(begin):text.index(end)]


def test_every_figure_of_the_readme_headline_is_in_the_results_at_the_one_commit_of_the_run():
    readme = _between((ROOT / "README.md").read_text(), BEGIN, END)
    doc = (ROOT / "docs" / "results.md").read_text()
    body = strip_summary(doc)
    figures = NUMBER.findall(readme)
    assert len(figures) > 10
    missing = [n for n in figures if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", body)]
    assert missing == [], f"README headline figures not in docs/results.md: {missing}"
    summary = _between(doc, SUMMARY_BEGIN, SUMMARY_END)
    commits = set(COMMIT.findall(readme))
    assert commits and commits == set(COMMIT.findall(summary))
    assert set(COMMIT.findall(body)) == commits and len(commits) == 1, "one run, one commit: " + ", ".join(commits)
    assert all(c in body for c in commits)  # each the stamp of a section below
    bullets = [line for line in readme.splitlines() if line.startswith("- ")]
    assert bullets == [line for line in summary.splitlines() if line.startswith("- ")]


def test_the_results_document_is_as_its_generator_writes_it():
    """Written again from its own text, the document is unchanged: every section in its dense form, the
    summary drawn from the tables as they stand; at most 400 lines, 15 of them the summary, 10 the
    simulator's validation, whose page is beside it."""
    doc = (ROOT / "docs" / "results.md").read_text()
    assert with_summary(condense(doc)) == doc
    assert len(doc.splitlines()) <= 400
    assert len(_between(doc, SUMMARY_BEGIN, SUMMARY_END).strip("\n").splitlines()) + 2 <= 15
    sim = doc[doc.index("## The simulator"):].splitlines()
    sim = sim[:next(i for i, x in enumerate(sim[1:], 1) if x.startswith(("#", "**")))]  # up to the next part
    assert "(sim-validation.md)" in "\n".join(sim) and len(sim) <= 2 + 10
    page = (ROOT / "docs" / "sim-validation.md").read_text()
    assert "## Against the testbed, every workload" in page and "(results.md#the-simulator-pdtb-sim)" in page


def test_router_and_relay_side_by_side_and_rounds_in_one_row():
    text = "\n".join(["# R", "", "## The router: x", "", "| run | target | CPU per request | CPU per streamed token |",
                      "|---|---|---|---|", "| a | router | 1.000 ms | 100.0 us |", "| a | relay | 0.500 ms | 50.0 us |",
                      "| before: c | router | 2.000 ms | 300.0 us |", "| after: d | router | 1.500 ms | 120.0 us |",
                      "| before: c | router | 2.200 ms | 310.0 us |", ""])
    out = condense(text)
    assert "| a | router / relay | 1.000 / 0.500 ms | 100.0 / 50.0 us |" in out
    assert "| before: c | router | 2.000, 2.200 ms | 300.0, 310.0 us |" in out and out.count("before: c") == 1
    assert condense(out) == out


def test_verdict_listings_become_one_table():
    text = "\n".join([
        "## KV transports on one host", "", "`bash scripts/compare_transports.sh --quick`: verdicts.", "",
        "In lockstep: every count equal zmq's.", "", "```", "policy    verdict             zmq      shm",
        "fcfs      accept                2        2", "fcfs      park                  1        1",
        "fcfs      vs zmq: every count: shm: same", "```", "", "Live (real clusters): counts differ.", "", "```",
        "policy    verdict             zmq      shm", "fcfs      accept                3        1",
        "fcfs      park                  0        2", "fcfs      vs zmq: every count: shm: differs", "```", ""])
    out = condense(text)
    assert "| verdict | lockstep fcfs (zmq, shm) | live fcfs zmq | live fcfs shm |" in out
    assert "| accept | 2 | 3 | 1 |" in out and "| park | 1 | 0 | 2 |" in out and "```" not in out
    assert "verdicts. In lockstep: every count equal zmq's. Live (real clusters): counts differ." in out
    assert condense(out) == out


def test_scorecard_scenarios_become_one_table():
    head = "| policy | Pareto | minnow TTFT p99 ms | minnow ITL p99 ms | whale E2E p50 ms | out tok/s | goodput req/s |"
    text = "\n".join([
        "## Scorecard: every policy", "", "Prose.", "", "### Scenario s1", "", head, "|---|---|---|---|---|---|---|",
        "| fcfs |  | 100.0 | 10.0 | 900.0 | 50.0 | 1.0 |",
        "| memfair | **yes** | 20.0 (0.20x) | 11.0 (1.10x) | 990.0 (1.10x) | 50.0 (1.00x) | 2.0 (2.00x) |", "",
        "### Scenario s2", "", "| policy | Pareto | minnow TTFT p99 ms | minnow ITL p99 ms | saturation tok/s "
        "| max goodput req/s |", "|---|---|---|---|---|---|", "| fcfs | **yes** | 5.0 | 1.0 | 80.0 | 3.0 |", ""])
    out = condense(text)
    assert "| scenario | fcfs | memfair |" in out and "### Scenario" not in out
    assert "| s1 | 100.0 / 10.0 / 900.0 / 50.0 / 1.0 | 0.20 / 1.10 / 1.10 / 1.00 / 2.00 **yes** |" in out
    assert "| s2 | 5.0 / 1.0 / - / 80.0 / 3.0 **yes** | - |" in out
    assert condense(out) == out


def test_a_frontier_bound_is_said_and_the_readme_follows_a_section_replaced(tmp_path):
    """The summary is drawn from the document as it stands: replacing nothing but the summary (--section
    summary) rewrites it, and the README one folder above the document gets the same lines."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("\n".join([
        "# Results", "", "Written by x, commit abc1234.", "", "## Fairness at saturation: load sweeps", "",
        "`bash scripts/frontier.sh --quick`", "",
        "| mode | point | max goodput | x fcfs | saturation out tok/s | x fcfs |", "|---|---|---|---|---|---|",
        "| disagg | memfair | >= 6.00 | 3.00 | 90.0 | 0.90 |", "| disagg | fcfs | 2.00 | 1.00 | 100.0 | 1.00 |", ""]))
    (tmp_path / "README.md").write_text(f"# x\n\n{BEGIN}\nold\n{END}\n")
    assert results_doc(["--section", "summary", "--out", str(docs / "results.md")]) == 0
    doc, readme = (docs / "results.md").read_text(), (tmp_path / "README.md").read_text()
    line = ("- `bash scripts/frontier.sh --quick`, disagg: memfair's max goodput with every class at 90% attainment "
            "6.00 req/s against fcfs's 2.00 (**3.00** x fcfs); saturation 0.90 x fcfs (memfair's goodput a lower "
            "bound in disagg: reached at the sweep's top) (commit abc1234).")
    assert line in doc and line in readme and "old" not in readme
    assert doc.index(SUMMARY_END) < doc.index("## Fairness at saturation")
    assert results_doc(["--section", "summary", "--out", str(docs / "results.md")]) == 0
    assert (docs / "results.md").read_text() == doc


def test_the_simulator_line_names_the_calibration_kept_and_the_orders():
    from pdtb.figures.headline import simulator

    table = ["| calibration | grid | logs | logs-speed | repeat |", "|---|---|---|---|---|",
             "| held out on target | 41/240 = 17.1% | 100/240 = 41.7% | 167/240 = 69.6% | 132/240 = 55.0% |",
             "| pairs of policies apart, ordered the same | 52 of 123 | 68 of 123 | 110 of 123 | 94 of 123 |"]
    line = simulator(table, "abc1234")
    assert line == ("- Simulator: 41.7% of held-out figures on target against the testbed (logs calibration); pairs "
                    "of policies ordered as the real run orders them 68 of 123, 110 of 123 with each run at its "
                    "measured host speed, 94 of 123 for a second real run (commit abc1234).")
