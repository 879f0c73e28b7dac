"""`pdtb bench sweep`: its figures against a hand computation, the knee search, and the knee of
a server whose capacity is known (an in-process FIFO server with a fixed service rate)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from app_thread import app_in_thread
from pdtb.figures import sweep_figures as sf
from pdtb.figures.records import OK, RequestRecord, RequestSpec
from pdtb.client.sweep import level_specs, main as sweep_main, build_parser

VOCAB, MAX_LEN = 1000, 4096


def rec(klass: str, scheduled: float, ttft: float | None, tokens: int = 3, gap: float = 0.05,
        status: str = OK, tenant: str | None = None, prompt: int = 10) -> RequestRecord:
    """A request sent at `scheduled`, first token after `ttft`, then `tokens - 1` more `gap` apart."""
    r = RequestRecord(tenant or klass, klass, prompt, tokens, scheduled_time=scheduled, send_time=scheduled)
    if ttft is not None:
        r.token_times = [scheduled + ttft + i * gap for i in range(tokens)]
        r.first_token_time = r.token_times[0]
        r.end_time = r.token_times[-1]
        r.output_tokens = tokens
    else:
        r.end_time = scheduled + 1.0
    r.status = status
    if status != OK:
        r.error = "HTTP 500"
    return r


def test_level_figures_equal_a_hand_computation():
    slos = sf.SloTable.parse(["ttft_ms=200", "tpot_ms=100", "whale:ttft_ms=1000"])
    records = [
        rec("minnow", 0.5, 0.1),                   # warm-up: not counted
        rec("minnow", 1.0, 0.1),                   # meets both
        rec("minnow", 1.5, 0.3),                   # TTFT 300 > 200: misses
        rec("minnow", 2.0, 0.1, gap=0.2),          # TPOT 200 > 100: misses
        rec("minnow", 2.5, None, status="failed"),  # failed: misses all
        rec("whale", 3.0, 0.8, tokens=5),          # whale target 1000: meets
        rec("whale", 4.0, 1.2, tokens=5),          # 1200 > 1000: misses
        rec("whale", 4.5, 0.5, tokens=1),          # one token: no TPOT, meets
        rec("minnow", 5.0, 0.1),                   # after the span: not counted
    ]
    lv = sf.level_figures(records, 1.0, 5.0, slos)
    m, w, o = lv["per_class"]["minnow"], lv["per_class"]["whale"], lv["overall"]
    assert (m["count"], w["count"], o["count"]) == (4, 3, 7)
    assert m["attainment"] == 1 / 4 and w["attainment"] == 2 / 3 and o["attainment"] == 3 / 7
    assert m["attainment_ttft"] == 2 / 4 and m["attainment_tpot"] == 2 / 4  # the failed one misses both
    assert w["attainment_ttft"] == 2 / 3 and w["attainment_tpot"] == 1.0
    assert m["goodput_rps"] == 1 / 4 and w["goodput_rps"] == 2 / 4 and o["goodput_rps"] == 3 / 4
    assert o["offered_rps"] == 7 / 4 and m["failed"] == 1
    # tokens of ok requests over (last measured end - window start): the whale at 4.0 ends at 4.0+1.2+0.2
    served = 4.0 + 1.2 + 4 * 0.05 - 1.0
    assert o["output_tok_s"] == pytest.approx((3 * 3 + 5 + 5 + 1) / served)
    assert o["total_tok_s"] == pytest.approx((3 * 3 + 5 + 5 + 1 + 6 * 10) / served)
    ttfts = sorted([100.0, 300.0, 100.0, 800.0, 1200.0, 500.0])
    assert o["ttft_ms"]["p50"] == pytest.approx((ttfts[2] + ttfts[3]) / 2)


def test_a_request_cut_off_counts_where_it_was_on_track():
    from pdtb.client.load import CUT_OFF, cut_off

    slos = sf.SloTable.parse(["ttft_ms=200", "tpot_ms=100"])

    def cut(ttft, tokens, at, gap=0.05):
        r = rec("whale", 1.0, ttft, tokens=tokens, gap=gap) if ttft is not None else rec("whale", 1.0, None)
        r.status, r.error = "failed", None
        return cut_off(r, at)
    on_track = cut(0.1, 5, 1.5)            # 5 tokens by 1.5 s: (1.5 - 1.1) / 5 = 80 ms a token
    slow = cut(0.1, 3, 1.8)                # (1.8 - 1.1) / 3 = 233 ms a token: already late
    late_first = cut(0.3, 2, 1.5)          # TTFT 300 ms
    never = cut(None, 0, 1.1)              # no token yet, 100 ms old: within TTFT
    waited = cut(None, 0, 1.5)             # no token after 500 ms: missed
    assert on_track.error == CUT_OFF and on_track.status == "failed"
    assert [sf.meets(r, slos) for r in (on_track, slow, late_first, never, waited)] == [True, False, False, True, False]
    assert sf.meets(slow, slos, "ttft_ms") and not sf.meets(slow, slos, "tpot_ms")
    assert not sf.meets(on_track, sf.SloTable())  # no target at all: only a finished request counts
    g = sf.group_figures([on_track, slow], 0.0, 2.0, slos)
    assert g["cut_off"] == 2 and g["failed"] == 2 and g["attainment"] == 0.5
    # never sent (it waited for a --max-concurrency slot): its wait runs from when it was scheduled
    from pdtb.client.load import new_record
    queued = cut_off(new_record(RequestSpec(1.8, "t", "whale", 10, 3), 1.8), 2.1)
    assert queued.send_time == 1.8 and sf.meets(queued, sf.SloTable.parse(["ttft_ms=500"]))  # 300 ms old, no token
    assert not sf.meets(queued, slos)  # past a 200 ms TTFT


def test_slo_table_parsing_and_errors():
    t = sf.SloTable.parse(["ttft_ms=500", "whale:ttft_ms=20000", "minnow:tpot_ms=80"])
    assert t.of("whale") == {"ttft_ms": 20000.0} and t.of("minnow") == {"ttft_ms": 500.0, "tpot_ms": 80.0}
    for bad in ("ttft=5", "whale:ttft_ms=-1", ":ttft_ms=5", "ttft_ms=abc", "ttft_ms=nan"):
        with pytest.raises(ValueError):
            sf.SloTable.parse([bad])


def _level(load: float, rps: float, per_class: dict[str, float], goodput: float = 1.0, tok: float = 10.0) -> dict:
    g = lambda att: {"attainment": att, "goodput_rps": goodput * att, "offered_rps": rps,  # noqa: E731
                     "output_tok_s": tok, "total_tok_s": 2 * tok}
    overall = sum(per_class.values()) / len(per_class)
    return {"load": load, "overall": g(overall), "per_class": {c: g(a) for c, a in per_class.items()}}


def test_derived_figures_by_hand():
    levels = [_level(1, 2.0, {"a": 1.0, "b": 1.0}, goodput=2.0, tok=20),
              _level(2, 4.0, {"a": 1.0, "b": 0.9}, goodput=4.0, tok=40),
              _level(3, 6.0, {"a": 1.0, "b": 0.5}, goodput=6.0, tok=50),
              _level(4, 8.0, {"a": 0.5, "b": 0.1}, goodput=8.0, tok=45)]
    d = sf.derive(levels, 0.9)
    assert d["max_goodput_every_class_rps"] == pytest.approx(4.0 * 0.95)  # level 2: both classes >= 0.9
    assert d["max_goodput_rps"] == pytest.approx(4.0 * 0.95)  # level 3's overall attainment is 0.75
    assert d["per_class"]["a"]["max_goodput_rps"] == 6.0 and d["per_class"]["b"]["max_goodput_rps"] == pytest.approx(3.6)
    assert d["knee_rps"] == 4.0 and d["knee_bracket_rps"] == [4.0, 6.0] and d["knee_load"] == 2
    assert d["saturation_tok_s"] == 50 and d["saturation_total_tok_s"] == 100
    assert sf.derive(levels, 0.9, "a")["knee_bracket_rps"] == [6.0, 8.0]
    nothing = sf.derive([_level(1, 2.0, {"a": 0.2})], 0.9)
    assert nothing["max_goodput_rps"] == 0.0 and nothing["knee_rps"] is None


def test_next_load_grows_then_bisects_to_the_resolution():
    def lv(load, ok):
        return _level(load, load, {"a": 1.0 if ok else 0.0})
    assert sf.next_load([lv(1, True), lv(2, True)], 0.9, "every-class", 2.0, 0.25) == 4
    assert sf.next_load([lv(1, False)], 0.9, "every-class", 2.0, 0.25) == 0.5
    assert sf.next_load([lv(1, True), lv(2, False)], 0.9, "every-class", 2.0, 0.25) == 1.5
    assert sf.next_load([lv(1, True), lv(1.5, True), lv(2, False)], 0.9, "every-class", 2.0, 0.25) == 1.75
    assert sf.next_load([lv(1.5, True), lv(1.75, False), lv(2, False)], 0.9, "every-class", 2.0, 0.25) is None


def test_rate_levels_tile_the_workload_and_scale_its_arrivals():
    a = build_parser().parse_args(["--url", "x", "--workload", "multi-tenant", "--rate", "10", "--duration", "2",
                                   "--num-tenants", "2"])
    one = level_specs(a, 1.0, 6.0, closed=False)
    three = level_specs(a, 3.0, 6.0, closed=False)
    assert max(s.send_time for s in three) < 6.0 and all(isinstance(s, RequestSpec) for s in three)
    assert 2.5 < len(three) / len(one) < 3.5  # three times the arrivals over the same span
    assert len({(s.send_time, s.prompt_len) for s in one}) == len(one)  # each period drawn afresh (seed + k)


# ---- the knee of a server with a known capacity ----------------------------------------------------

CAPACITY = 40.0  # requests/s: one FIFO server, 25 ms per request


def fifo_app() -> web.Application:
    """A router stand-in serving one request at a time in arrival order at CAPACITY requests/s.
    Each request's slot is reserved on arrival (start = max(now, previous end)) and its tokens
    are sent at the slot's end, so the rate holds whatever the timer's lateness."""
    state = {"free_at": 0.0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        now = time.monotonic()
        state["free_at"] = end = max(now, state["free_at"]) + 1.0 / CAPACITY
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_):
        return web.json_response({"data": [{"id": "fifo", "max_model_len": MAX_LEN, "vocab_size": VOCAB}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


@pytest.fixture
def fifo_url():
    with app_in_thread(fifo_app()) as url:
        yield url


@pytest.mark.slow  # a load sweep held in real time, level after level, against a server
def test_the_knee_of_a_fixed_rate_server_brackets_its_capacity(fifo_url, tmp_path):
    out = tmp_path / "sweep.json"
    # 12 requests/s at load 1, nearly evenly spaced; TTFT target 150 ms (6 service times): below
    # capacity a request waits at most a few service times, above it the backlog grows each second
    rc = sweep_main(["--url", fifo_url, "--workload", "multi-tenant", "--num-tenants", "1", "--rate", "12",
                     "--duration", "4", "--burstiness", "50", "--prompt", "8", "--output", "2",
                     "--rates", "1,2", "--until-knee", "--knee-resolution", "0.2", "--warmup-s", "0.5",
                     "--span-s", "3", "--drain-s", "5", "--slo", "ttft_ms=150", "--sample-interval", "0",
                     "--out", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    lo, hi = doc["derived"]["knee_bracket_rps"]
    loads = [lv["load"] for lv in doc["levels"]]
    assert lo is not None and hi is not None, loads
    # the bracket is within one step (the resolution) and holds the capacity: a level at or just
    # above capacity may still pass in a short span (its backlog is small), never one a step above
    assert lo <= CAPACITY * 1.2 and hi >= CAPACITY, (lo, hi, loads)
    assert hi / lo <= 1.2 * 1.2
    assert doc["derived"]["max_goodput_rps"] == pytest.approx(max(
        lv["overall"]["goodput_rps"] for lv in doc["levels"] if lv["overall"]["attainment"] >= 0.9))
    assert doc["meta"]["kind"] == "sweep" and doc["meta"]["load_kind"] == "rate"


def test_concurrency_levels_keep_that_many_in_flight(fifo_url, tmp_path):
    out = tmp_path / "c.json"
    rc = sweep_main(["--url", fifo_url, "--workload", "multi-tenant", "--num-tenants", "2", "--rate", "5",
                     "--duration", "2", "--prompt", "8", "--output", "2", "--concurrency-levels", "1,4",
                     "--warmup-s", "0.2", "--span-s", "1", "--slo", "ttft_ms=60", "--sample-interval", "0",
                     "--out", str(out), "--quiet"])
    assert rc == 0
    one, four = json.loads(out.read_text())["levels"]
    # one in flight: no queueing, every TTFT about one service time; four: each waits behind three.
    # Compared with each other, not with the clock: a busy machine adds to both alike
    assert four["overall"]["ttft_ms"]["p50"] > 2 * one["overall"]["ttft_ms"]["p50"]
    assert one["overall"]["attainment"] > four["overall"]["attainment"]
    assert one["overall"]["offered_rps"] <= CAPACITY * 1.2
    assert set(one["per_tenant"]) == {"t0", "t1"}


@pytest.mark.parametrize("argv", [["--rates", "1,0"], ["--rates", "1", "--concurrency-levels", "2"],
                                  ["--concurrency", "2"], ["--span-s", "0"], ["--target", "1.5"],
                                  ["--slo", "bogus=1"], ["--concurrency-levels", "1.5"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) if argv[0] == "--rates" and argv[1] == "1,0" else _nothing():
        rc = sweep_main(["--url", "http://127.0.0.1:9", "--workload", "whale-minnow", *argv])
        assert rc == 2
    assert "pdtb bench sweep" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the frontier and the sweep report ----------------------------------------------------------

def sweep_doc(label: str, mode: str, goodput: float, ttft_p99: float, tok: float) -> dict:
    """A sweep file with one level at load 1 whose minnow p99 TTFT is `ttft_p99` ms."""
    lv = _level(1.0, goodput, {"minnow": 1.0, "whale": 1.0}, goodput=goodput, tok=tok)
    for g in lv["per_class"].values():
        g.update(ttft_ms={"p50": ttft_p99 / 2, "p99": ttft_p99}, itl_ms={"p50": 1.0, "p99": 2.0})
    lv["overall"].update(ttft_ms={"p50": 1.0, "p99": ttft_p99}, itl_ms={"p50": 1.0, "p99": 2.0}, failed=0)
    lv["fairness"] = {"share_jain_mean": 0.9}
    return {"meta": {"kind": "sweep", "mode": mode, "policy": label.split("-")[0], "config": label,
                     "workload": "whale-minnow", "warmup_s": 1, "span_s": 2, "load_kind": "rate"},
            "derived": sf.derive([lv]), "levels": [lv]}


def test_frontier_marks_the_pareto_points_and_ratios_against_fcfs(tmp_path):
    from pdtb.figures import frontier

    docs = {"fcfs": sweep_doc("fcfs", "colocated", 2.0, 9000, 100),
            "memfair": sweep_doc("memfair", "colocated", 4.0, 300, 95),
            "memfair-request": sweep_doc("memfair-request", "colocated", 3.0, 200, 90),
            "vtc": sweep_doc("vtc", "colocated", 3.0, 400, 99)}  # dominated by memfair
    paths = []
    for name, doc in docs.items():
        paths.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    assert frontier.main(paths + ["--x", "goodput", "--out", str(tmp_path / "g")]) == 0
    got = json.loads((tmp_path / "g" / "frontier.json").read_text())
    front = {p["label"]: ok for p, ok in zip(got["points"], got["pareto"])}
    assert front == {"fcfs": False, "memfair": True, "memfair-request": True, "vtc": False}
    # on saturation tok/s (100, 95, 90, 99 with TTFT 9000, 300, 200, 400) every point is optimal
    # but one: add a point slower and later than memfair
    (tmp_path / "slow.json").write_text(json.dumps(sweep_doc("slow", "colocated", 1.0, 350, 94)))
    paths.append(str(tmp_path / "slow.json"))
    assert frontier.main(paths + ["--out", str(tmp_path / "f")]) == 0
    got = json.loads((tmp_path / "f" / "frontier.json").read_text())
    front = {p["label"]: ok for p, ok in zip(got["points"], got["pareto"])}
    assert front == {"fcfs": True, "memfair": True, "memfair-request": True, "vtc": True, "slow": False}
    assert got["x"] == "saturation_tok_s" and got["knee"] is not None
    md = (tmp_path / "f" / "frontier.md").read_text()
    row = next(line for line in md.splitlines() if "| memfair |" in line)
    # goodput and saturation against fcfs; the one level attained the target, so 4 req/s is a bound
    assert "| >= 4.00 | 2.00 |" in row and "| 0.95 |" in row
    assert (tmp_path / "f" / "frontier.png").stat().st_size > 0
    # the report draws sweeps on their own, and refuses a mix with serve results
    from pdtb.figures.report import main as report_main
    assert report_main(paths + ["--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "colocated/memfair-request" in text and (tmp_path / "r" / "attainment.png").exists()
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"meta": {}, "requests": [], "summary": {}}))
    assert report_main([paths[0], str(serve), "--out", str(tmp_path / "x")]) == 2


def test_frontier_ratios_against_a_named_baseline_and_a_goodput_below_the_top_is_no_bound(tmp_path):
    from pdtb.figures import frontier

    vllm = sweep_doc("vllm", "colocated", 2.0, 900, 100)
    mine = sweep_doc("memfair", "colocated", 3.0, 300, 120)
    # a second, higher level that misses the target: the max goodput (3) is measured, not a bound
    lv = _level(2.0, 1.0, {"minnow": 0.5, "whale": 0.5}, goodput=1.0, tok=110)
    for g in lv["per_class"].values():
        g.update(ttft_ms={"p50": 1.0, "p99": 5000.0}, itl_ms={"p50": 1.0, "p99": 2.0})
    lv["overall"].update(ttft_ms={"p50": 1.0, "p99": 5000.0}, itl_ms={"p50": 1.0, "p99": 2.0}, failed=0)
    mine["levels"].append(lv)
    mine["derived"] = sf.derive(mine["levels"])
    for name, doc in (("vllm", vllm), ("memfair", mine)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    args = [str(tmp_path / "vllm.json"), str(tmp_path / "memfair.json"), "--baseline", "vllm", "--out", str(tmp_path / "f")]
    assert frontier.main(args) == 0
    md = (tmp_path / "f" / "frontier.md").read_text()
    assert "x vllm" in md and "x fcfs" not in md
    row = next(line for line in md.splitlines() if "| memfair |" in line)
    assert "| 3.00 | 1.50 |" in row and "| 1.20 |" in row  # 3/2 goodput, 120/100 saturation tok/s
    assert "| >= 2.00 | 1.00 |" in next(line for line in md.splitlines() if "| vllm |" in line)


def test_frontier_knee_is_the_point_farthest_from_the_chord():
    from pdtb.figures.frontier import frontier_knee

    pts = [{"max_goodput_rps": x, "ttft_p99_ms": y} for x, y in ((1, 100), (2, 110), (3, 1000), (1.5, 104))]
    # normalized: (0,0), (0.5,0.011), (1,1), (0.25,0.004): the chord is the diagonal; (2, 110) is farthest
    assert frontier_knee(pts, [True] * 4) == 1
    assert frontier_knee(pts[:2], [True] * 2) is None


def test_results_doc_frontier_section_is_what_pdtb_frontier_printed(tmp_path, capsys):
    from pdtb.figures import frontier
    from pdtb.figures.results_doc import BEGIN, END, main as results_doc

    run = tmp_path / "front"
    run.mkdir()
    for mode in ("colocated", "disagg"):
        for name, goodput, ttft in (("fcfs", 2.0, 9000), ("memfair", 5.0, 300)):
            (run / f"{name}-{mode}.json").write_text(json.dumps(sweep_doc(name, mode, goodput, ttft, 100)))
    assert frontier.main([*map(str, sorted(run.glob("*.json"))), "--out", str(run / "frontier")]) == 0
    table = capsys.readouterr().out.strip()
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold\n{END}\n")
    doc = tmp_path / "docs" / "results.md"
    assert results_doc(["--frontier", str(run), "--out", str(doc), "--readme", str(readme)]) == 0
    text = doc.read_text()
    assert table in text and "![frontier](img/frontier.png)" in text
    assert (tmp_path / "docs" / "img" / "frontier.png").exists()
    assert "| colocated/memfair | 5.0 → 5.0 (1.00 / 1.00) |" in text  # offered → goodput (attainment per class)
    head = readme.read_text()
    assert "disagg: memfair's max goodput with every class at 90% attainment 5.00 req/s against fcfs's 2.00 " \
           "(**2.50** x fcfs)" in head


def test_a_dead_url_is_one_line(capsys):
    assert sweep_main(["--url", "http://127.0.0.1:9", "--workload", "whale-minnow", "--sample-interval", "0"]) == 1
    assert "cannot read http://127.0.0.1:9/v1/models: cannot connect" in capsys.readouterr().err


def test_rescore_recomputes_a_sweep_from_its_records(tmp_path):
    """A sweep file rescored under a tighter SLO: every figure from the stored records."""
    records = [rec("minnow", 1.0 + i * 0.1, 0.1 + 0.05 * (i % 4)) for i in range(20)]
    lv = {"load": 1.0, **sf.level_figures(records, 1.0, 3.0, sf.SloTable.parse(["ttft_ms=500"])),
          "requests": [r.to_json() for r in records], "samples": []}
    src = tmp_path / "s.json"
    src.write_text(json.dumps({"meta": {"kind": "sweep", "slos": {"default": {"ttft_ms": 500}, "per_class": {}}},
                               "derived": sf.derive([lv]), "levels": [lv]}))
    out = tmp_path / "r.json"
    assert sweep_main(["--rescore", str(src), "--slo", "ttft_ms=180", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    # TTFTs cycle 100, 150, 200, 250 ms: half meet 180 ms
    assert got["levels"][0]["overall"]["attainment"] == 0.5 and got["derived"]["max_goodput_rps"] == 0.0
    assert sweep_main(["--rescore", str(src), "--out", str(out)]) == 0  # the file's own SLOs
    assert json.loads(out.read_text())["levels"][0]["overall"]["attainment"] == 1.0
    assert sweep_main(["--rescore", str(tmp_path / "none.json"), "--out", str(out)]) == 2
