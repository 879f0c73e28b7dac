"""`pdtb bench lockstep`: one seeded workload's hand-offs into a real decode node, in a fixed
order of events, over ZeroMQ, one-sided shared memory and torch.distributed (gloo). Every
verdict kind comes up (the pools are small and one request can never fit), and every
request's verdicts, the counts and the generated tokens are the same over each transport:
with the order of events fixed, a transport cannot change a decision (parking lands in the
host tier on each). Every request ends and both tiers are empty afterwards."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from pdtb.microbench.lockstep import main as lockstep_main, prepare, run_lockstep

pytestmark = pytest.mark.slow  # a real decode node process per transport

# 3 whales of 256+48 tokens into 40 device pages and 24 host pages, minnows around them, and a
# 600+64-token request that needs 42 pages at its peak (refused: too_large)
WORKLOAD = ["--workload", "whale-minnow", "--whales", "3", "--whale-prompt", "256", "--whale-output", "48",
            "--whale-start", "0.1", "--whale-interval", "0.1", "--minnow-prompt", "24", "--minnow-output", "8",
            "--minnow-rate", "20", "--duration", "1", "--seed", "0", "--context-whales", "1",
            "--context-whale-prompt", "600", "--context-whale-output", "64", "--context-whale-start", "0.3"]


def node_flags(model_dir: str, transport: str, policy: str = "memfair") -> list[str]:
    return ["--model", model_dir, "--policy", policy, "--transport", transport, "--kv-pages", "40",
            "--host-kv-pages", "24", "--page-size", "16", "--max-num-batched-tokens", "512"]


def lockstep(model_dir: str, transport: str):
    job = prepare([*WORKLOAD, "--", *node_flags(model_dir, transport)])
    return asyncio.run(asyncio.wait_for(run_lockstep(job.config, job.specs, job.step_s, job.seed, job.vocab), 240))


def test_every_transport_makes_the_same_decisions(llama_dir):
    results = {t: lockstep(llama_dir, t) for t in ("zmq", "shm", "torch")}
    base = results["zmq"]
    assert {"accept", "park", "defer", "refuse"} <= set(base.admissions)
    assert base.failed == {"too_large": 1} and base.finished == base.requests - 1
    assert base.pages_free
    assert sum(v.count("defer") for v in base.verdicts.values()) == base.admissions["defer_answers"]
    for t, r in results.items():
        assert (r.transport, r.verdicts, r.admissions, r.tokens_sha256, r.failed, r.steps) == \
            (t, base.verdicts, base.admissions, base.tokens_sha256, base.failed, base.steps), t
        assert r.pages_free


def test_the_command_writes_its_result(llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    flags = node_flags(llama_dir, "zmq", "fcfs")
    threads = torch.get_num_threads()
    try:
        assert lockstep_main([*WORKLOAD, "--whales", "1", "--out", str(out), "--", *flags]) == 0
    finally:
        torch.set_num_threads(threads)  # (the command sets the node's --torch-threads)
    r = json.loads(out.read_text())
    assert r["lockstep"] and r["policy"] == "fcfs" and len(r["verdicts"]) == r["requests"]  # each one decided
    assert "pools empty" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare([*WORKLOAD, "--step-ms", "0", "--", *flags])


def test_prepare_takes_a_live_runs_flags(llama_dir):
    job = prepare([*WORKLOAD, "--step-ms", "10", "--", *node_flags(llama_dir, "shm")])
    assert job.step_s == 0.01 and job.config.engine.shared_kv and job.config.engine.host_kv_pages == 24
    assert job.config.policy == "memfair" and len(job.specs) > 10
    torch_job = prepare([*WORKLOAD, "--", *node_flags(llama_dir, "torch")])
    assert (torch_job.config.dist_rank, torch_job.config.dist_world_size) == (0, 2)
    with pytest.raises(SystemExit):  # gloo and pages on the CPU: a torch lockstep on a GPU is refused
        prepare([*WORKLOAD, "--", *node_flags(llama_dir, "torch"), "--device", "cuda"])
