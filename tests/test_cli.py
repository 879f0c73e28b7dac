"""The offline CLI: JSON output shape, batching, and clear one-line errors on bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import hf_greedy


def run_pdtb(*args, timeout=120, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pdtb.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_json_matches_generate(llama_dir, hf_models, tmp_path):
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog and keeps running", "a"]
    pf = tmp_path / "prompts.txt"
    pf.write_text("\n".join(prompts) + "\n")
    r = run_pdtb("generate", "--model", llama_dir, "--prompts-file", str(pf), "--max-tokens", "12",
                 "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == prompts
    for row in rows:
        assert len(row["token_ids"]) == 12
        assert row["token_ids"] == hf_greedy(hf_models["llama"], row["prompt_token_ids"], 12, ignore_eos=True)
        assert isinstance(row["text"], str)
    assert "tok/s" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--model", "/definitely/not/here", "--prompt", "x"], "model directory not found"),
    (["--prompt", "x", "--max-tokens", "0"], "max-tokens"),
    (["--prompt", "x", "--max-tokens", "-3"], "max-tokens"),
    (["--prompt", "abc " * 3000], "context"),
])
def test_bad_input_is_one_clear_line(llama_dir, args, needle):
    if "--model" not in args:
        args = ["--model", llama_dir, *args]
    r = run_pdtb("generate", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_unsupported_checkpoint_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run_pdtb("generate", "--model", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2 and "unsupported model_type" in r.stderr and "Traceback" not in r.stderr


def test_default_model_created_once_and_reused(tmp_path):
    env = {"PDTB_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        r = run_pdtb("generate", "--prompt", "hi", "--max-tokens", "3", "--json", env_extra=env)
        assert r.returncode == 0, r.stderr
    made = list(tmp_path.iterdir())
    assert len(made) == 1 and (made[0] / "config.json").exists()


def test_model_init_writes_standard_checkpoint(tmp_path):
    r = run_pdtb("model", "init", "--out", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "qwen2"
