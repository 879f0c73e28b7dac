"""The fault plan (the seed alone decides it; every kind comes up once a round) and the
checker's verdicts on hand-made requests, against a reference written out by hand."""
from __future__ import annotations

import pytest

from pdtb.chaos.checker import outcome, rss_growth, verdicts
from pdtb.chaos.load import Request
from pdtb.chaos.plan import KINDS, parse_kinds, plan

P, D = ["prefill-0", "prefill-1"], ["decode-0", "decode-1"]


def test_the_plan_is_the_seed_s_and_every_kind_comes_up_each_round():
    a = plan(7, 600, (10, 20), KINDS, P, D)
    assert a == plan(7, 600, (10, 20), KINDS, P, D) and a != plan(8, 600, (10, 20), KINDS, P, D)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:])]
    assert all(10 <= g <= 20 + 1e-6 for g in gaps) and a[-1].at_s < 600
    for i in range(0, len(a) - len(KINDS) + 1, len(KINDS)):
        assert sorted(f.kind for f in a[i:i + len(KINDS)]) == sorted(KINDS)
    for f in a:
        want = {"kill-prefill": P, "kill-decode": D, "router-kill": ["router"], "client-cut": ["client"]}.get(f.kind, P + D)
        assert f.target in want
    # no decode node to migrate to: migrations are left out
    assert "migrate" not in {f.kind for f in plan(7, 600, (10, 20), KINDS, P, D[:1])}
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_kinds("kill-decode,explode")
    assert parse_kinds("all") == KINDS


def req(**kw) -> Request:
    base = dict(rid=0, tenant="t", prompt=0, max_tokens=3, t_sent=10.0, status=200, token_ids=[5, 6, 7],
                finish="length", done=True, t_end=12.0)
    r = Request(**{k: v for k, v in base.items() if k in Request.__dataclass_fields__ and k not in kw}, **kw)
    return r


REF = [[5, 6, 7, 8]]


@pytest.mark.parametrize("kw,kills,want", [
    ({}, [], ("completed", False)),
    ({"token_ids": [5, 7, 8]}, [], ("wrong", True)),  # a token lost
    ({"token_ids": [5, 6, 6]}, [], ("wrong", True)),  # one duplicated
    ({"token_ids": [5, 6]}, [], ("wrong", True)),  # short of max_tokens
    ({"done": False, "exc": "ServerDisconnectedError"}, [11.0], ("cut-router", False)),
    ({"done": False, "exc": "ServerDisconnectedError"}, [30.0], ("broken", True)),  # no router kill in its life
    ({"status": 0, "exc": "refused"}, [11.5], ("refused", False)),
    ({"status": 0, "exc": "refused"}, [], ("refused", True)),
    ({"error": "node is draining"}, [], ("error", True)),
    ({"cut": "client", "done": False}, [], ("cut-client", False)),
    ({"exc": "did not end within 120 s", "done": False}, [11.0], ("unended", True)),
])
def test_outcomes(kw, kills, want):
    kind, wrong = outcome(req(**kw), REF, kills)
    assert (kind, bool(wrong)) == want


def test_violations_carry_the_timeline_and_the_faults_of_the_request_s_life():
    bad = req(token_ids=[5, 6, 9])
    bad.timeline = [(10.0, "sent"), (10.2, "first token")]
    counts, violations = verdicts([req(), bad], REF, [], [{"done_at_s": 11.0, "kind": "pause"},
                                                          {"done_at_s": 99.0, "kind": "drain"}])
    assert counts == {"completed": 1, "wrong": 1}
    (v,) = violations
    assert "first difference at token 2" in v["what"] and v["request"]["timeline"][1] == (10.2, "first token")
    assert [f["kind"] for f in v["faults_meanwhile"]] == ["pause"]


def test_rss_growth_from_the_settled_sample():
    samples = {"decode-0 pid 1": [(0, 100), (30, 200), (45, 210), (60, 220)], "short pid 2": [(0, 1), (10, 2)]}
    assert rss_growth(samples, 30) == {"decode-0 pid 1": {"rss_mib_settled": 0.0, "rss_mib_last": 0.0,
                                                          "growth": 1.1, "seconds": 60}}


def test_only_the_cluster_s_own_processes_are_signalled(tmp_path):
    """A pid file read between a death and its restart may name a pid given since to another
    process: a fault is carried out only on a process started for this run dir."""
    import os
    import subprocess
    import sys

    from pdtb.chaos.inject import ours

    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PDTB_RUN_DIR": str(tmp_path.resolve())})
    try:
        assert child.stdout.readline() == "up\n"  # (exec'd: its environment is its own, not the parent's copy)
        assert ours(child.pid, tmp_path) and not ours(child.pid, tmp_path / "other")
        assert not ours(os.getpid(), tmp_path)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert not ours(child.pid, tmp_path)  # gone


def test_a_node_ended_on_purpose_that_does_not_come_back_leaves_the_cluster_quiet_but_no_other():
    from pdtb.chaos.cli import healthy_but_ended

    cluster = [{"id": "decode-0", "address": "tcp://127.0.0.1:1", "healthy": True},
               {"id": "decode-1", "address": "tcp://127.0.0.1:2", "healthy": False},
               {"id": "prefill-0~1", "address": "tcp://127.0.0.1:3", "healthy": False}]
    missing = lambda *a: {"status": "unhealthy", "missing": [{"role": "decode", "address": x} for x in a]}
    assert healthy_but_ended({"status": "ok", "nodes": 3}, cluster, set())
    assert healthy_but_ended(missing("tcp://127.0.0.1:2"), cluster, {"decode-1"})
    assert healthy_but_ended(missing("tcp://127.0.0.1:3"), cluster, {"prefill-0"})  # a restarted id, NAME~N
    assert not healthy_but_ended(missing("tcp://127.0.0.1:2"), cluster, set())  # not ended on purpose
    assert not healthy_but_ended(missing("tcp://127.0.0.1:2", "tcp://127.0.0.1:1"), cluster, {"decode-1"})
    assert not healthy_but_ended({"status": "unhealthy", "missing": []}, cluster, {"decode-1"})
    assert not healthy_but_ended({"error": "connection refused"}, cluster, {"decode-1"})
    assert not healthy_but_ended({"status": "shutting down"}, cluster, {"decode-1"})
