"""`pdtb top`'s frame from /cluster snapshots written by hand: pages against shares, inherited pages,
queues, rates between two polls, the router's latency, and "-" for whatever is not reported."""
from __future__ import annotations

import pytest

from pdtb.client.top import base_url, main
from pdtb.client.top_view import Snapshot, duration, frame, rate, split_moves, table
from pdtb.common import CliError


def decode_node(free: int, host_free: int, pages: dict, host: dict, evictions: dict, admissions: dict) -> dict:
    return {"role": "decode", "id": "de-0", "pages_total": 200, "pages_free": free, "host_pages_total": 100,
            "host_pages_free": host_free, "running": 3, "waiting": 1, "healthy": True, "stale": False,
            "extra": {"policy": "memfair", "tenant_pages": pages, "tenant_host_pages": host,
                      "quota": {"minnow": 100.0, "whale": 100.0}, "tenant_waiting": {"minnow": 1},
                      "evictions": evictions, "admissions": admissions, "reserved_pages": 4,
                      "requests": [["r1", "whale", 48], ["r2", "minnow", 7], ["r3", "minnow", 5]]}}


PREFILL = {"role": "prefill", "id": "pr-0", "pages_total": 400, "pages_free": 393, "host_pages_total": 0,
           "host_pages_free": 0, "running": 0, "waiting": 2, "healthy": True, "stale": False,
           "extra": {"policy": "prefill-memfair", "tenant_pages": {"whale": 7}, "tenant_host_pages": {},
                     "quota": {}, "evictions": {}, "handoffs": 2, "held_pages": 7}}
LATENCY = {"window_s": 60.0, "tenants": {
    "minnow": {"ttft": {"n": 4, "p50": 0.0123, "p99": 0.5}, "itl": {"n": 40, "p50": 0.004, "p99": 1.5}},
    "whale": {"ttft": {"n": 1, "p50": 2.0, "p99": 2.0}, "itl": {"n": 0, "p50": None, "p99": None}}}}


def two_polls() -> tuple[Snapshot, Snapshot]:
    prev = Snapshot([decode_node(150, 80, {"minnow": 10, "whale": 40}, {"whale": 20}, {"whale/demote": 2},
                                 {"accept": 5, "defer": 1, "defer_answers": 3}), PREFILL], LATENCY, at=10.0)
    cur = Snapshot([decode_node(140, 76, {"minnow": 12, "whale": 48}, {"whale": 24},
                                {"whale/demote": 6, "whale/promote": 1, "minnow/preempt": 2},
                                {"accept": 9, "park": 2, "defer": 2, "defer_answers": 7, "refuse": 1}), PREFILL],
                   LATENCY, at=12.0, clock="14:02:03", url="http://r:8000", interval=1.0)
    return prev, cur


def section(lines: list[str], node_id: str) -> list[str]:
    """The node's line and the indented lines under it."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(node_id + "  "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def cells(lines: list[str], first: str) -> list[str]:
    (row,) = [ln.split() for ln in lines if ln.split()[:1] == [first]]
    return row


COLUMNS = ["tenant", "device", "share", "of", "share", "host", "running", "waiting", "demote/s", "promote/s",
           "preempt/s"]


def test_a_decode_node_with_its_tenants_pages_shares_queues_and_rates():
    prev, cur = two_polls()
    lines = frame(cur, prev)
    assert lines[0] == "pdtb top http://r:8000   every 1 s   14:02:03   rates over 2.00 s"
    de = section(lines, "de-0")
    assert de[0] == "de-0  decode  ok  memfair  device 60/200  host 24/100  running 3  waiting 1"
    # over 2 s: placed 9-5 = 4 (2.0/s), parked 2-0 (1.0/s), deferred 2-1 (0.5/s), 7 answers in all
    assert de[1] == ("  inherited: placed 9 (2.0/s)  parked 2 (1.0/s)  deferred 2 (0.5/s, 7 answers)  refused 1  "
                     "landing 4 pages")
    assert cells(de, "tenant") == COLUMNS
    # whale: 48 pages of a 100-page share; demotions 2 -> 6 in 2 s, promotions 0 -> 1
    assert cells(de, "whale") == ["whale", "48", "100", "48%", "24", "1", "0", "2.0", "0.5", "0.0"]
    # minnow: 12 of 100; two of the listed requests; one waiting; preemptions 0 -> 2 in 2 s
    assert cells(de, "minnow") == ["minnow", "12", "100", "12%", "0", "2", "1", "0.0", "0.0", "1.0"]


def test_a_prefill_node_shows_its_hand_offs_and_dashes_for_what_it_does_not_report():
    prev, cur = two_polls()
    pr = section(frame(cur, prev), "pr-0")
    assert pr[0] == "pr-0  prefill  ok  prefill-memfair  device 7/400  host 0/0  running 0  waiting 2"
    assert pr[1] == "  hand-offs: 2 in flight, holding 7 pages"
    # no quota there: no share, no fraction; no requests list, no waiting per tenant; no moves
    assert cells(pr, "whale") == ["whale", "7", "-", "-", "0", "-", "-", "0.0", "0.0", "0.0"]


def test_the_routers_recent_ttft_and_itl_per_tenant():
    prev, cur = two_polls()
    lines = frame(cur, prev)
    i = lines.index("TTFT and ITL at the router, last 60 s")
    tail = lines[i + 1:]
    assert cells(tail, "tenant") == ["tenant", "requests", "TTFT", "p50", "TTFT", "p99", "tokens", "ITL", "p50",
                                     "ITL", "p99"]
    assert cells(tail, "minnow") == ["minnow", "4", "12.3ms", "500.0ms", "40", "4.0ms", "1.50s"]
    assert cells(tail, "whale") == ["whale", "1", "2.00s", "2.00s", "0", "-", "-"]


def test_the_first_frame_has_no_rates():
    _, cur = two_polls()
    lines = frame(cur)
    assert lines[0].endswith("rates after the next poll")
    de = section(lines, "de-0")
    assert de[1].startswith("  inherited: placed 9 (-/s)  parked 2 (-/s)  deferred 2 (-/s, 7 answers)")
    assert cells(de, "whale")[-3:] == ["-", "-", "-"]


def test_a_counter_that_went_down_has_no_rate():
    prev, cur = two_polls()
    restarted = decode_node(200, 100, {}, {}, {"whale/demote": 1}, {"accept": 1})
    de = section(frame(Snapshot([restarted], None, at=12.0), prev), "de-0")
    assert cells(de, "whale")[-3:] == ["-", "0.0", "0.0"]  # 6 -> 1: restarted; the others 0 -> 0
    assert "placed 1 (-/s)" in de[1]


def test_missing_fields_render_as_dashes():
    lines = frame(Snapshot([{"id": "x"}, {"id": "y", "healthy": False, "stale": True, "seconds_since_seen": 4.5,
                                         "extra": {"tenant_pages": {"t": "?"}, "evictions": "?"}}], None))
    assert section(lines, "x") == ["x  -  -  -  device -  host -  running -  waiting -", "  (no tenant)"]
    y = section(lines, "y")
    assert y[0].startswith("y  -  stale 4.5s  -  device -")
    assert cells(y, "t") == ["t", "?", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert lines[-2:] == ["TTFT and ITL at the router, last - s", "  -"]
    assert frame(Snapshot([], {"tenants": {}}))[1:] == ["(no nodes)", "TTFT and ITL at the router, last - s",
                                                        "  (no recent tokens)"]


def test_the_small_figures():
    assert rate(10, 4, 4.0) == "1.5" and rate(3, 4, 1.0) == "-" and rate(3, None, 1.0) == "-" and rate(3, 1, 0) == "-"
    assert split_moves({"a/b/demote": 2, "c/promote": 1}) == {"a/b": {"demote": 2}, "c": {"promote": 1}}
    assert duration(0.0004) == "0.4ms" and duration(1.0) == "1.00s" and duration(None) == "-"
    assert table(["t", "n"], [["long", "1"], ["x", "100"]]) == ["t       n", "long    1", "x     100"]
    assert base_url("localhost:8000/") == "http://localhost:8000"


def test_an_unreachable_router_is_one_line_and_exit_2(capsys):
    from pdtb.cli import main as pdtb

    assert pdtb(["top", "http://127.0.0.1:9", "--once", "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdtb: error: cannot reach the router: http://127.0.0.1:9/cluster")
    with pytest.raises(CliError):
        main(["http://127.0.0.1:9", "--iterations", "0"])


def test_the_loop_keeps_the_last_frame_under_a_lost_router_and_takes_rates_over_the_gap(monkeypatch, capsys):
    import pdtb.client.top as top

    prev, cur = two_polls()
    answers = iter([prev, top.Unreachable("refused"), cur])

    def poll(base, interval, timeout):
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(top, "poll", poll)
    assert main(["http://r:8000", "--iterations", "3", "--interval", "0"]) == 0
    frames = capsys.readouterr().out.split("\n\n")
    assert len([f for f in frames if f.strip()]) == 3
    assert frames[1].splitlines()[1].startswith("router not answering at ")
    assert frames[1].splitlines()[1].endswith(": refused")
    assert "rates over 2.00 s" in frames[2].splitlines()[0]  # the first poll to the third: 10.0 s to 12.0 s
