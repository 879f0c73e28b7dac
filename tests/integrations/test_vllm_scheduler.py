"""FairScheduler inside vLLM's CPU build (.venv-vllm), offline on the embedded tiny model with
a KV budget that forces preemptions: greedy outputs identical to vLLM's own scheduler under
every built-in policy, memfair with reclaim_drop=any and the tutorial's policy (docs/policies.md,
from its file, unchanged); a tenant
over its quota waits and every request ends; a policy that raises falls back, is counted and
logged once; bad settings stop the start-up. One vLLM process runs every engine in turn."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import textwrap

import pytest

from fairness import POLICIES

ROOT = pathlib.Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TIMEOUT_S = 500  # the whole vLLM process: its imports, fourteen engines, about 2 minutes on two cores
BUILT_IN = sorted(POLICIES)

# vLLM's side, run by .venv-vllm's python (no pytest there): JOB.json -> OUT.json
DRIVER = textwrap.dedent('''
    import json, os, sys, urllib.request

    def run(job, case):
        from vllm import LLM, SamplingParams
        os.environ.pop("PDTB_POLICY", None)
        os.environ.pop("PDTB_POLICY_ARGS", None)
        os.environ.pop("PDTB_METRICS_PORT", None)
        os.environ.update(case.get("env", {}))
        try:
            llm = LLM(model=job["model"], dtype="float32", block_size=32, num_gpu_blocks_override=job["blocks"],
                      max_num_batched_tokens=256, max_model_len=512, seed=0, enable_prefix_caching=False,
                      enforce_eager=True, scheduler_cls=case.get("scheduler_cls"), disable_log_stats=False)
        except Exception as e:
            return {"start_error": f"{type(e).__name__}: {e}"}
        params = [SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                                 extra_args={"tenant": t}) for t in job["tenants"]]
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        probe = getattr(getattr(sched, "fair", None) and sched.fair.inner, "probe", None)
        port = getattr(getattr(sched, "metrics", None), "port", None)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode() \
            if port else None
        out = {"scheduler": type(sched).__name__, "tokens": [list(o.outputs[0].token_ids) for o in outs],
               "finished": [o.finished for o in outs], "preemptions": preempted,
               "errors": getattr(sched, "policy_errors", None), "violations": getattr(sched, "policy_violations", None),
               "probe": probe, "metrics": metrics}
        llm.llm_engine.engine_core.shutdown()
        return out

    if __name__ == "__main__":
        job = json.load(open(sys.argv[1]))
        results = {name: run(job, case) for name, case in job["cases"].items()}
        json.dump(results, open(sys.argv[2], "w"))
''')

CAP = textwrap.dedent('''
    """cap: tenant `tenant` may hold at most `max_pages` device pages when it is admitted."""
    from dataclasses import dataclass

    from fairness import BasePolicy, PolicySettings, setting


    @dataclass(frozen=True)
    class CapSettings(PolicySettings):
        tenant: str = setting("b", "the tenant capped")
        max_pages: int = setting(8, "pages the tenant may hold at admission", lo=1)


    class Cap(BasePolicy):
        name = "cap"
        strict_order = False
        Settings = CapSettings

        def __init__(self, config=None, settings=None):
            super().__init__(config, settings)
            self.granted = 0  # pages the capped tenant was let in with, this step
            self.approved = set()  # its requests admitted this step
            self.probe = {"refused": 0, "unapproved": 0, "tenants": []}

        def reclaim(self, running, candidates, state):
            self.granted, self.approved = 0, set()
            seen = {s.tenant for s in running + candidates} - set(self.probe["tenants"])
            self.probe["tenants"] = sorted(set(self.probe["tenants"]) | seen)
            return super().reclaim(running, candidates, state)

        def may_admit(self, seq, need_pages, state):
            if seq.tenant != self.settings.tenant:
                return super().may_admit(seq, need_pages, state)
            held = sum(state.pages.get(s.request_id, 0) for s in self.running if s.tenant == seq.tenant)
            if held + self.granted + need_pages > self.settings.max_pages:
                self.probe["refused"] += 1
                return False
            self.granted += need_pages
            self.approved.add(seq.request_id)
            return super().may_admit(seq, need_pages, state) or True

        def on_step(self, chunks, state):
            for c in chunks:  # a first chunk of the capped tenant's must have been let in by may_admit
                first = c.seq.num_computed_tokens == 0
                if first and c.seq.tenant == self.settings.tenant and c.seq.request_id not in self.approved \\
                        and self.running:
                    self.probe["unapproved"] += 1
''')

BOOM = textwrap.dedent('''
    from fairness import BasePolicy


    class Boom(BasePolicy):
        """Raises on every other admission order and every third victim choice."""

        name = "boom"

        def __init__(self, config=None, settings=None):
            super().__init__(config, settings)
            self.calls = 0

        def admission_order(self, candidates, state):
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("boom in admission_order")
            return super().admission_order(candidates, state)

        def choose_victim(self, candidates, requester, state):
            self.calls += 1
            if self.calls % 3 == 0:
                raise ZeroDivisionError("boom in pick_victim")
            return super().choose_victim(candidates, requester, state)
''')


def tutorial_policy() -> str:
    """docs/policies.md's policy file, as its own test reads it."""
    spec = importlib.util.spec_from_file_location("policy_tutorial", ROOT / "tests/policies/test_policy_tutorial.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.blocks()[0]["lps.py"]


def vllm_missing() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} is absent (bash scripts/vs_vllm.sh builds it)"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm, pdtb.integrations"], capture_output=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return None if probe.returncode == 0 else f"vllm does not import in .venv-vllm: {probe.stderr[-300:]!r}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    why = vllm_missing()
    if why:
        pytest.skip(why)
    from pdtb.engine.model_info import resolve_model_arg

    d = tmp_path_factory.mktemp("vllm-fair")
    (d / "lps.py").write_text(tutorial_policy())
    (d / "cap.py").write_text(CAP)
    (d / "boom.py").write_text(BOOM)
    (d / "driver.py").write_text(DRIVER)
    fair = "pdtb.integrations.vllm.FairScheduler"
    cases = {
        "vllm": {},
        "fcfs": {"scheduler_cls": fair, "env": {"PDTB_POLICY": "fcfs"}},
        "memfair": {"scheduler_cls": fair, "env": {"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "starve_after_s=4"}},
        "lps": {"scheduler_cls": fair, "env": {"PDTB_POLICY": f"{d}/lps.py:LeastPageSeconds",
                                               "PDTB_POLICY_ARGS": "half_life_s=5"}},
        "cap": {"scheduler_cls": fair, "env": {"PDTB_POLICY": f"{d}/cap.py:Cap", "PDTB_POLICY_ARGS": "max_pages=6"}},
        "boom": {"scheduler_cls": fair, "env": {"PDTB_POLICY": f"{d}/boom.py:Boom", "PDTB_METRICS_PORT": "0"}},
        "bad-args": {"scheduler_cls": fair, "env": {"PDTB_POLICY": "memfair", "PDTB_POLICY_ARGS": "starve=1"}},
        "memfair-drop": {"scheduler_cls": fair, "env": {"PDTB_POLICY": "memfair",
                                                        "PDTB_POLICY_ARGS": "reclaim_drop=any"}},
    }
    for name in BUILT_IN:  # every other built-in policy, with its own defaults
        cases.setdefault(name, {"scheduler_cls": fair, "env": {"PDTB_POLICY": name}})
    # eight prompts of 40-208 tokens, two tenants, 48 tokens each: 1,376 tokens in 24 blocks of 32 (767 usable)
    prompts = [[2 + (7 * i + 3 * j) % 500 for j in range(40 + 24 * i)] for i in range(8)]
    job = {"model": resolve_model_arg(None), "blocks": 24, "max_tokens": 48, "prompts": prompts,
           "tenants": ["a" if i % 2 == 0 else "b" for i in range(8)], "cases": cases}
    (d / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([str(VLLM_PYTHON), str(d / "driver.py"), str(d / "job.json"), str(d / "out.json")], cwd=d,
                       env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((d / "out.json").read_text()), p.stdout + p.stderr


def test_vllms_own_scheduler_preempts_here(results):
    out, _ = results
    assert out["vllm"]["scheduler"] == "Scheduler" and out["vllm"]["preemptions"] > 0
    assert all(out["vllm"]["finished"]) and all(len(t) == 48 for t in out["vllm"]["tokens"])


@pytest.mark.parametrize("case", [*BUILT_IN, "memfair-drop", "lps"])
def test_greedy_outputs_are_vllms_own(results, case):
    out, _ = results
    got = out[case]
    assert got["scheduler"] == "FairScheduler" and got["errors"] == 0 and got["violations"] == []
    assert all(got["finished"]) and got["tokens"] == out["vllm"]["tokens"]


def test_a_tenant_over_its_quota_waits_and_every_request_ends(results):
    out, _ = results
    got = out["cap"]
    assert got["probe"]["tenants"] == ["a", "b"]  # the tenant of vllm_xargs reached the policy
    assert got["probe"]["refused"] > 0 and got["probe"]["unapproved"] == 0
    assert all(got["finished"]) and got["tokens"] == out["vllm"]["tokens"]


def test_a_policy_that_raises_falls_back_and_is_counted(results):
    out, log = results
    got = out["boom"]
    assert got["errors"] > 1 and all(got["finished"]) and got["tokens"] == out["vllm"]["tokens"]
    assert log.count("falls back to the engine's own order") == 1
    # the count is a Prometheus counter, served by the scheduler's process on PDTB_METRICS_PORT
    counted = re.search(r'^pdtb_policy_errors_total\{policy="[^"]+"\} (\d+)\.0$', got["metrics"], re.M)
    assert counted and int(counted.group(1)) == got["errors"]


def test_bad_settings_stop_the_start_up(results):
    out, _ = results
    err = out["bad-args"]["start_error"]
    assert "PolicyEnvError" in err and "PDTB_POLICY_ARGS" in err and "starve" in err
