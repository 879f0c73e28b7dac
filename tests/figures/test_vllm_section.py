"""The vLLM comparison: its prompts, its vLLM-side script's imports, and its results section."""
from __future__ import annotations

import ast
import json
from pathlib import Path

from pdtb.vllm_compare.offline import make_prompts


def test_prompts_are_seeded_and_never_hold_a_special_token():
    a = make_prompts(100, {0, 1, 2}, 8, seed=3)
    assert a == make_prompts(100, {0, 1, 2}, 8, seed=3) and a != make_prompts(100, {0, 1, 2}, 8, seed=4)
    assert all(48 <= len(p) <= 80 for p in a)
    assert not {0, 1, 2} & {t for p in a for t in p} and all(0 <= t < 100 for p in a for t in p)


def test_the_vllm_side_imports_nothing_of_the_project():
    src = Path(__file__).parents[2] / "pdtb/vllm_compare/vllm_offline.py"
    tree = ast.parse(src.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= {"__future__", "json", "sys", "time", "vllm"}, names


def test_the_section_gives_each_offline_ratio(tmp_path):
    from pdtb.figures.vllm_section import VLLM_HEADING, render

    (tmp_path / "offline-model.json").write_text(json.dumps({
        "model": "/m/tiny", "vllm": "0.32.0", "prompts": 32, "max_tokens": 128, "identical": 32,
        "project_tok_s": 300.0, "vllm_tok_s": 200.0, "ratio": 1.5, "project_s": [1, 2], "vllm_s": [1, 2]}))
    (tmp_path / "offline-head64.json").write_text(json.dumps({
        "model": "/m/head64", "vllm": "0.32.0", "prompts": 16, "prompt_len": [1024, 2048], "max_tokens": 128,
        "identical": 15, "project_tok_s": 90.0, "vllm_tok_s": 100.0, "ratio": 0.9, "project_s": [1], "vllm_s": [1]}))
    text = "\n".join(render(str(tmp_path), "_now_"))
    assert text.startswith(VLLM_HEADING)
    assert "| tiny | 32 of 48-80 tokens | 128 | **32/32** | 300.0 | 200.0 (vLLM 0.32.0) | **1.50x** |" in text
    assert "| head64 | 16 of 1024-2048 tokens | 128 | **15/16** | 90.0 | 100.0 (vLLM 0.32.0) | **0.90x** |" in text


def _result(policy: str, ttft: float, tok_s: float) -> dict:
    lat = {"ttft_ms": {"p50": ttft / 10, "p99": ttft}, "itl_ms": {"p99": 20.0}, "tpot_ms": {"p50": 9.0}}
    return {"meta": {"mode": "colocated", "policy": policy}, "requests": [],
            "summary": {"per_class": {"minnow": lat, "whale": lat}, "overall": {"output_tok_s": tok_s, "failed": 0}}}


def test_the_section_gives_each_workloads_rounds_side_by_side_as_ratios_to_vllm(tmp_path):
    from pdtb.figures.vllm_section import WORKLOADS, render

    for w, ttft in (("overload", 4000.0), ("quick", 1000.0)):
        for rnd, tok in ((1, 400.0), (2, 500.0)):
            d = tmp_path / "serve" / w / f"round-{rnd}"
            d.mkdir(parents=True)
            (d / "colocated-vllm.json").write_text(json.dumps(_result("vllm", ttft * rnd, tok)))
            (d / "colocated-memfair.json").write_text(json.dumps(_result("memfair", ttft / 20, tok * 0.95)))
    text = "\n".join(render(str(tmp_path), "_now_"))
    assert text.index("**quick**") < text.index("**overload**")  # the workloads in the script's order
    assert WORKLOADS["overload"] in text
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in text.splitlines() if line.startswith("| ")}
    # vLLM's own figures; memfair's as ratios to vLLM's of the same round: 1/20, then 1/40
    assert "| 1000 / 2000 ms |" in rows[("quick", "vllm")] and "| 400.0 / 500.0 tok/s |" in rows[("quick", "vllm")]
    assert "| 0.05 / 0.03 |" in rows[("quick", "memfair")] and "| 0.95 / 0.95 |" in rows[("quick", "memfair")]
    assert "| 0.05 / 0.03 |" in rows[("overload", "memfair")]


def test_a_swept_workload_shows_each_rounds_frontier_against_vllm(tmp_path):
    from pdtb.figures.vllm_section import render

    def pt(label, goodput, tok, ttft, top):
        return {"label": label, "mode": "colocated", "policy": label, "max_goodput_rps": goodput,
                "saturation_tok_s": tok, "saturation_total_tok_s": 2 * tok, "knee_rps": goodput, "at_load": 3,
                "ttft_p99_ms": ttft, "itl_p99_ms": 30.0, "attainment": 0.9, "goodput_at_top": top}
    for rnd, tok in ((1, 330.0), (2, 360.0)):
        d = tmp_path / "serve" / "frontier" / f"round-{rnd}" / "frontier"
        d.mkdir(parents=True)
        (d / "frontier.json").write_text(json.dumps({
            "points": [pt("vllm", 4.0, 300.0, 900.0, False), pt("memfair", 6.0, tok, 90.0, True)],
            "pareto": [False, True], "knee": None, "x": "saturation_tok_s"}))
    text = "\n".join(render(str(tmp_path), "_now_"))
    assert "**frontier**" in text
    row = next(line for line in text.splitlines() if line.startswith("| memfair |"))
    # goodput 6/4 (a bound: the top level still attained), saturation 330/300 and 360/300
    assert "| >= 6.00 / >= 6.00 | 1.50 / 1.50 | 330.0 / 360.0 | 1.10 / 1.20 |" in row, row
