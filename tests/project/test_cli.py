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


def test_a_checkpoint_without_a_tokenizer_says_so(llama_dir, tmp_path):
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{llama_dir}/{name}", tmp_path / name)
    r = run_pdtb("generate", "--model", str(tmp_path), "--prompt", "x")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "no tokenizer there" in lines[0], r.stderr


@pytest.mark.slow  # two pdtb processes, one writing the embedded model from nothing
def test_default_model_created_once_and_reused(tmp_path):
    env = {"PDTB_CACHE_DIR": str(tmp_path)}
    for _ in range(2):
        r = run_pdtb("generate", "--prompt", "hi", "--max-tokens", "3", "--json", env_extra=env)
        assert r.returncode == 0, r.stderr
    made = [p for p in tmp_path.iterdir() if p.name != "kernels"]  # (the CPU attention kernel's build)
    assert len(made) == 1 and (made[0] / "config.json").exists()


def test_model_init_writes_standard_checkpoint(tmp_path):
    r = run_pdtb("model", "init", "--out", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "3")
    assert r.returncode == 0, r.stderr
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "qwen2"


BAD_FLAGS = [  # across every subcommand: each must be a usage error, not a traceback, a hang or exit 0
    ["bench", "controller", "--sizes", "1"],
    ["bench", "controller", "--sizes", "abc"],
    ["bench", "controller", "--steps", "0"],
    ["bench", "controller", "--policies", "nosuch"],
    ["bench", "engine", "--batch", "0"],
    ["bench", "engine", "--repeat", "0"],
    ["bench", "engine", "--page-size", "0"],
    ["bench", "engine", "--dtype", "float7"],
    ["bench", "engine", "--device", "tpu"],
    ["bench", "engine", "--prompt-len", "100000"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--minnow-rate", "nan"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--minnow-rate", "1e9"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--whales", "100000000"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--burstiness", "1e-300"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--whale-tenants", ","],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--whale-prompt", "lognormal:100:1e308"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--minnow-rate", "-1"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--slo", "ttft_ms=nan"],
    ["bench", "serve", "--workload", "multi-tenant", "--dry-run", "--num-tenants", "0"],
    ["bench", "transport", "--reps", "0"],
    ["bench", "transport", "--chunk-mib", "nan"],
    ["bench", "steps", "--page-size", "0"],
    ["bench", "serve", "--workload", "multi-tenant", "--dry-run", "--on", "0", "--off", "0"],
    ["bench", "serve", "--workload", "multi-tenant", "--dry-run", "--weights", "0,0,0,0"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--fairness-window", "nan"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--fairness-window", "0"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--sample-interval", "-1"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--min-token-id", "-5"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--vocab-size", "0"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--temperature", "-1"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--service-weights", "1"],
    ["bench", "serve", "--workload", "whale-minnow", "--dry-run", "--slo", "ttft_ms=abc"],
    ["colocated", "--ctrl-port", "70000"],
    ["colocated", "--policy", "memfair", "--starve-after", "nan"],
    ["colocated", "--reserve", "1=-5"],
    ["colocated", "--log-level", "bogus"],
]


@pytest.mark.parametrize("args", BAD_FLAGS, ids=lambda a: " ".join(a[:2] + a[-2:]))
def test_bad_flags_are_an_error_not_a_traceback_a_hang_or_success(llama_dir, args, capsys):
    from pdtb.cli import main

    if args[0] in ("colocated",) or args[:2] == ["bench", "engine"]:
        args = [*args, "--model", llama_dir]
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    assert rc not in (0, None), args
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err, err


def test_report_on_a_file_that_is_not_results_names_it(tmp_path, capsys):
    from pdtb.cli import main

    for i, text in enumerate(['{"a": 1}\n{"b": 2}', "[1, 2]", '{"meta": {}, "summary": 5}']):
        path = tmp_path / f"r{i}.json"
        path.write_text(text)
        assert main(["report", str(path), "--out", str(tmp_path / "rep")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0], err


def test_output_cut_by_its_reader_ends_quietly(tmp_path):
    """`pdtb ... | head -1`: the pipe closed early is no error message."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m pdtb bench serve --workload whale-minnow --dry-run | head -c 1"
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "BrokenPipe" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_an_unforeseen_error_is_one_line(tmp_path, capsys):
    """Input no check foresaw (a results file of another shape) ends as one line with where it
    happened, not a traceback; PDTB_DEBUG=1 gives the traceback."""
    from pdtb.cli import main

    (tmp_path / "r.json").write_text('{"meta": {}, "requests": [], "summary": {"per_class": {"minnow": 5, "whale": 5}}}')
    assert main(["compare", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdtb: error: TypeError") and "PDTB_DEBUG" in err[0]
    (tmp_path / "r.json").write_text("5")  # not a results file at all: a check foresees that one (a usage error)
    with pytest.raises(SystemExit) as info:
        main(["compare", str(tmp_path / "r.json")])
    assert info.value.code == 2 and "not a results file" in capsys.readouterr().err


def test_every_command_of_the_table_resolves_to_a_function_and_is_listed():
    import importlib

    from pdtb.cli import COMMANDS, find, usage

    text = usage()
    for c in COMMANDS:
        assert f"  {' '.join(c.words)} " in text
        assert find([*c.words, "--x"]) == (c, ["--x"])
        if c.extra and importlib.util.find_spec(c.extra) is None:
            continue
        module, func = c.target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), c
    assert find(["bench"]) is None and find(["model"]) is None
