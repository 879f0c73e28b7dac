"""The parts of pdtb.integrations that need no vLLM: PDTB_POLICY and PDTB_POLICY_ARGS checked
as --policy and --policy-arg are, tenants from vllm_xargs, the version refusal, one step's
admission scan and victims driven with plain requests, and `import pdtb` importing no vllm."""
from __future__ import annotations

import ast
import logging
import pathlib
import subprocess
import sys
from dataclasses import dataclass

import pytest

from fairness import BasePolicy
from pdtb.engine.sched_policy import SchedState
from pdtb.engine.sequence import SamplingParams, Sequence, SeqStatus
from pdtb.integrations.fair_step import Admission, FairStep, shortfall
from pdtb.integrations.policy_env import (EngineVersionError, PolicyEnvError, check_version, policy_spec,
                                          request_labels, split_args)

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---- PDTB_POLICY and PDTB_POLICY_ARGS ---------------------------------------------------------------
def test_the_default_policy_is_fcfs():
    spec = policy_spec({})
    assert (spec.ref, spec.args, spec.name, spec.source) == ("fcfs", (), "fcfs", "built in")


def test_settings_are_checked_as_policy_args():
    spec = policy_spec({"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "starve_after_s=4, quota_shares=static"})
    assert spec.args == (("starve_after_s", "4"), ("quota_shares", "static"))
    assert split_args(" a=1,,b=2 ,") == ["a=1", "b=2"]


@pytest.mark.parametrize("env, words", [
    ({"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "no_such=1"}, ["PDTB_POLICY_ARGS", "no_such"]),
    ({"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "starve_after_s=-1"}, ["starve_after_s"]),
    ({"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "starve_after_s"}, ["KEY=VALUE"]),
    ({"PDTB_POLICY": "fcfs", "PDTB_POLICY_ARGS": "x=1"}, ["fcfs", "x"]),
    ({"PDTB_POLICY": "no-such-policy"}, ["PDTB_POLICY", "unknown policy"]),
    ({"PDTB_POLICY": "nowhere/file.py:Cls"}, ["no policy file"]),
])
def test_a_bad_policy_or_setting_is_refused_naming_it(env, words):
    with pytest.raises(PolicyEnvError) as e:
        policy_spec(env)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_policy_file_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("from fairness import BasePolicy\n\nclass Mine(BasePolicy):\n    name = 'mine'\n")
    monkeypatch.chdir(tmp_path)
    spec = policy_spec({"PDTB_POLICY": "mine.py:Mine"})
    assert spec.ref == f"{tmp_path}/mine.py:Mine" and spec.name == "mine"


# ---- tenants and the version check ------------------------------------------------------------------
@pytest.mark.parametrize("extra, labels", [
    (None, ("default", "")),
    ({"tenant": "alice"}, ("alice", "")),
    ({"tenant": 7, "slo_tier": "gold"}, ("7", "gold")),
    ({"tenant": ["x"], "slo_tier": True}, ("default", "")),
    ({"tenant": "  "}, ("default", "")),
    ({"tenant": "t" * 300}, ("t" * 256, "")),
])
def test_the_tenant_comes_from_vllm_xargs(extra, labels):
    assert request_labels(extra) == labels


def test_an_unchecked_vllm_version_is_refused():
    check_version("0.32.0", ("0.32.0",))
    with pytest.raises(EngineVersionError) as e:
        check_version("0.33.1", ("0.32.0",))
    assert "0.33.1" in str(e.value) and "0.32.0" in str(e.value) and "vllm_internals.py" in str(e.value)


# ---- pdtb does not depend on vLLM --------------------------------------------------------------------
def test_importing_pdtb_imports_no_vllm():
    code = ("import sys, pdtb, pdtb.cli, pdtb.integrations, pdtb.integrations.policy_env, "
            "pdtb.integrations.fair_step; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_only_the_vllm_integration_imports_vllm():
    importers = set()
    for pkg in ("pdtb", "fairness", "prefill_node", "decode_node", "kv_transport"):
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                if any(n == "vllm" or n.startswith("vllm.") for n in names):
                    importers.add(str(f.relative_to(ROOT)))
    assert importers <= {"pdtb/integrations/vllm_internals.py", "pdtb/vllm_compare/vllm_offline.py"}, importers


# ---- one step, driven with plain requests ------------------------------------------------------------
@dataclass(eq=False)
class Req:
    """An engine's request as the admission scan sees it: only its id."""

    request_id: str


def seq(rid: str, tenant: str = "a", prompt: int = 40, computed: int = 0, t: float = 0.0) -> Sequence:
    s = Sequence(rid, [1] * prompt, prompt, SamplingParams(max_tokens=8), tenant=tenant, arrival_time=t)
    s.num_computed_tokens = computed
    s.status = SeqStatus.RUNNING if computed else SeqStatus.WAITING
    return s


def state(free: int, pages: dict | None = None, total: int = 64) -> SchedState:
    return SchedState(1.0, 1, 16, 1024, total, free, 0, 0, pages or {}, {}, token_budget=256)


class Newest(BasePolicy):
    """Admits the newest first; tenant b only while it holds nothing; b's rows give up pages first."""

    name = "newest"
    strict_order = False

    def admission_order(self, candidates, st):
        return sorted(candidates, key=lambda s: -s.arrival_time)

    def may_admit(self, s, need_pages, st):
        return s.tenant != "b" and super().may_admit(s, need_pages, st)

    def choose_victim(self, candidates, requester, st):
        return max(candidates, key=lambda s: (s.tenant == "b", s.arrival_time))


def scan(step: FairStep, queue: list[Req], views: dict, st: SchedState, idle: bool = False) -> list[str]:
    """The engine's admission scan over `queue`: take the head while there is one."""
    adm = Admission(step, lambda r: views[r.request_id], lambda: st, lambda: idle, set())
    taken = []
    while (head := adm.head(queue)) is not None:
        queue.remove(head)
        adm.popped(head)
        taken.append(head.request_id)
    return taken


def test_the_scan_takes_the_policys_order_and_hides_refused_requests():
    views = {s.request_id: s for s in (seq("r1", t=1), seq("r2", "b", t=2), seq("r3", t=3))}
    step = FairStep(Newest())
    step.policy.reclaim([], list(views.values()), state(32))
    queue = [Req("r1"), Req("r2"), Req("r3")]
    assert scan(step, queue, views, state(32)) == ["r3", "r1"]
    assert [r.request_id for r in queue] == ["r2"]  # it waits, still queued


def test_nothing_running_admits_whatever_the_quota():
    views = {"r2": seq("r2", "b")}
    step = FairStep(Newest())
    assert scan(step, [Req("r2")], views, state(32), idle=True) == ["r2"]


def test_a_strict_order_stops_at_the_first_that_does_not_fit():
    views = {"big": seq("big", prompt=200, t=1), "small": seq("small", t=2)}
    step = FairStep(BasePolicy())
    step.policy.reclaim([], list(views.values()), state(8))
    assert scan(step, [Req("big"), Req("small")], views, state(8)) == []
    relaxed = Newest()
    relaxed.admission_order = lambda c, st: sorted(c, key=lambda s: s.arrival_time)
    assert scan(FairStep(relaxed), [Req("big"), Req("small")], views, state(8)) == ["small"]


class Boom(BasePolicy):
    def admission_order(self, candidates, st):
        raise RuntimeError("boom")


def test_a_policy_that_raises_costs_its_step_the_order_only(caplog):
    views = {s.request_id: s for s in (seq("r1"), seq("r2"))}
    step = FairStep(Boom())
    with caplog.at_level(logging.ERROR):
        assert scan(step, [Req("r1"), Req("r2")], views, state(32)) == ["r1", "r2"]  # the engine's order
        assert scan(step, [Req("r1")], views, state(32)) == ["r1"]
    assert step.errors == 2 and "admission_order raised RuntimeError: boom" in step.last_error
    assert len([r for r in caplog.records if "falls back" in r.getMessage()]) == 1


class Dropper(BasePolicy):
    """Answers an admission order that leaves a candidate out: illegal, replaced by the default."""

    def admission_order(self, candidates, st):
        return candidates[1:]


def test_raised_calls_and_illegal_answers_are_prometheus_counters_on_loopback():
    import urllib.request

    from pdtb.integrations.policy_metrics import PORT_ENV, PolicyMetrics

    views = {s.request_id: s for s in (seq("r1"), seq("r2"))}
    m = PolicyMetrics("boom", {PORT_ENV: "0"})
    try:
        assert m.server.server_address[0] == "127.0.0.1" and m.port
        step = FairStep(Boom(), metrics=m)
        scan(step, [Req("r1"), Req("r2")], views, state(32))
        scan(step, [Req("r1")], views, state(32))
        bad = FairStep(Dropper(), metrics=m)
        for _ in range(3):  # one illegal answer a step, each counted when the step ends
            assert scan(bad, [Req("r1"), Req("r2")], views, state(32)) == ["r1", "r2"]
            bad.end([], state(32))
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
    finally:
        m.close()
    assert 'pdtb_policy_errors_total{policy="boom"} 2.0' in text
    assert 'pdtb_policy_violations_total{policy="boom"} 3.0' in text


def test_no_port_serves_nothing_and_a_bad_port_is_refused():
    from pdtb.integrations.policy_metrics import PORT_ENV, PolicyMetrics

    assert PolicyMetrics("p", {}).server is None
    with pytest.raises(ValueError, match="PDTB_METRICS_PORT='x'"):
        PolicyMetrics("p", {PORT_ENV: "x"})


def test_the_step_log_counts_prompt_chunks_and_decode_rows(tmp_path):
    import json

    from pdtb.engine.scheduler import ScheduledChunk
    from pdtb.integrations.step_log import STEP_LOG_ENV, StepLog

    assert StepLog.open({}) is None
    log = StepLog.open({STEP_LOG_ENV: str(tmp_path / "steps.jsonl")})
    prompt, deep, decoding = seq("p", prompt=40), seq("q", prompt=300, computed=256), seq("d", prompt=40, computed=45)
    log.write(7, [ScheduledChunk(prompt, 40), ScheduledChunk(deep, 44), ScheduledChunk(decoding, 1)], waiting=3,
              sitting=1, chunk_cap=44, sched_s=0.0025, preempted=[seq("x", prompt=300, computed=200)], now=12.5, reclaimed=1, free=9,
              vllm_s=0.0015)
    log.close()
    line = json.loads((tmp_path / "steps.jsonl").read_text())
    assert line == {"t": 12.5, "step": 7, "prefill_tokens": 84, "prefill_rows": 2, "decode_rows": 1, "waiting": 3,
                    "sitting": 1, "chunk_cap": 44, "sched_ms": 2.5, "preempted": 1, "lost_tokens": 200,
                    "reclaimed": 1, "free": 9, "vllm_ms": 1.5}


def test_the_victims_of_a_foreseen_shortfall_go_to_the_tail():
    rows = [seq("a1", "a", prompt=40, computed=32, t=1), seq("b1", "b", prompt=40, computed=32, t=2),
            seq("a2", "a", prompt=40, computed=32, t=3)]
    # 40 tokens in pages of 16: three pages each
    assert shortfall(rows, state(2, {"a1": 3, "b1": 3, "a2": 3}))[0] == -2
    pages = {"a1": 2, "b1": 2, "a2": 2}  # each lacks a page for its chunk; two are free
    lack, first = shortfall(rows, state(2, pages))
    assert (lack, first.request_id) == (1, "a2")
    plan = FairStep(Newest()).begin(rows, [], state(2, pages))
    assert [s.request_id for s in plan.order] == ["a1", "a2", "b1"]  # b1 is vLLM's first victim
    assert FairStep(BasePolicy()).begin(rows, [], state(32, pages)).order == rows  # no shortfall: as given


class LeavesOutB(BasePolicy):
    """Steps tenant b's rows only when nobody else has any."""

    def step_order(self, running, st):
        rows = super().step_order(running, st)
        return [s for s in rows if s.tenant != "b"] or rows


def test_rows_the_order_leaves_out_sit_the_step_out():
    rows = [seq("a1", "a", prompt=40, computed=32, t=1), seq("b1", "b", prompt=40, computed=32, t=2)]
    plan = FairStep(LeavesOutB()).begin(rows, [], state(32, {"a1": 3, "b1": 3}))
    assert [s.request_id for s in plan.order] == ["a1"] and [s.request_id for s in plan.sitting] == ["b1"]
    plan = FairStep(LeavesOutB()).begin(rows[1:], [], state(32, {"b1": 3}))
    assert [s.request_id for s in plan.order] == ["b1"] and plan.sitting == []


class Split(BasePolicy):
    """A running prompt of tenant w takes 40 tokens of the step; any other, what it asks."""

    def chunk_limit(self, seq, budget, st):
        return 40 if seq.tenant == "w" else budget


def test_the_step_bounds_a_prompt_chunk_by_the_largest_part_the_policy_gives():
    whale, minnow = seq("w1", "w", prompt=400, computed=32, t=1), seq("m1", "m", prompt=24, computed=0, t=2)
    decoding = seq("d1", "d", prompt=8, computed=8, t=0)
    decoding.token_ids.append(5)
    st = state(64, {"w1": 2, "m1": 0, "d1": 1})
    assert FairStep(Split()).begin([decoding, whale], [], st).chunk_cap == 40  # the whale's part
    assert FairStep(Split()).begin([decoding, whale, minnow], [], st).chunk_cap == 40  # the minnow's 24 is under it
    assert FairStep(Split()).begin([decoding], [], st).chunk_cap is None  # no prompt runs: the engine's own
    # each running prompt's own part, for an engine that bounds each chunk (vllm_internals.ChunkCaps)
    assert FairStep(Split()).begin([decoding, whale, minnow], [], st).caps == {"w1": 40, "m1": 24}


class PromptsWait(BasePolicy):
    """A prompt's chunk waits for pages rather than take anyone's; a decode row takes the newest."""

    def pick_victim(self, candidates, requester, st):
        if requester.in_prefill:
            return None
        return max(candidates, key=lambda s: s.arrival_time)


def test_a_prompt_whose_chunk_waits_sits_the_step_out_keeping_its_pages():
    """Out of pages, the policy has the prompt's chunk wait (None): the prompt sits the step out,
    so that vLLM, which has no waiting chunk, takes no victim for it; the decode row that lacks a
    page after it still asks, and its victim goes to the tail."""
    old = seq("d1", "d", prompt=32, computed=32, t=0)
    old.token_ids.append(5)  # decoding, its pages full: it needs one more for its next token
    prompt = seq("p1", "w", prompt=96, computed=32, t=1)  # its next chunk needs four pages more
    late = seq("d2", "e", prompt=32, computed=32, t=2)
    late.token_ids.append(5)
    st = state(1, {"d1": 2, "p1": 2, "d2": 2})
    plan = FairStep(PromptsWait()).begin([old, prompt, late], [], st)
    assert [s.request_id for s in plan.sitting] == ["p1"]
    assert [s.request_id for s in plan.order] == ["d1", "d2"]  # one page, two wanted: d2 (newest) at the tail
    st = state(0, {"d1": 2, "p1": 2, "d2": 2})
    plan = FairStep(PromptsWait()).begin([old, prompt, late], [], st)
    assert [s.request_id for s in plan.sitting] == ["p1"] and [s.request_id for s in plan.order] == ["d1", "d2"]
