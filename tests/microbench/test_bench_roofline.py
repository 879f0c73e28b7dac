"""`pdtb bench roofline`: the bytes a decode step must move, counted by hand from the config,
and the command's figures for each batch size asked for."""
from __future__ import annotations

import json
from pathlib import Path

from tests.project.test_cli import run_pdtb


def by_hand(cfg: dict, batch: int, context: int, elem: int) -> int:
    """Weights read by a decode step of `batch` rows, plus their KV read and written."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h  # q, k, v, o; gate, up, down; two norms
    weights = layers * per_layer + h + cfg["vocab_size"] * h + batch * h  # final norm, lm_head, the rows' embeddings
    kv_bytes = batch * (context + 2) * layers * 2 * kv  # context + the new token read, the new token written
    return (weights + kv_bytes) * elem


def test_weight_and_kv_bytes_match_a_count_by_hand(llama_dir):
    from pdtb.microbench.roofline import kv_bytes, weight_bytes
    from pdtb.engine.loader import load_model

    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    assert not cfg["tie_word_embeddings"]
    model, _, info = load_model(llama_dir)
    spec = info.kv_spec(16, "float32")
    for batch, context in ((1, 10), (7, 300)):
        assert weight_bytes(model, batch) + kv_bytes(spec, batch, context) == by_hand(cfg, batch, context, 4)


def test_bench_roofline_reports_each_batch(llama_dir):
    r = run_pdtb("bench", "roofline", "--model", llama_dir, "--batches", "1,3", "--context", "40", "--reps", "2",
                 "--bandwidth", "10", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    assert res["bandwidth_gbps"] == 10 and res["bandwidth_source"] == "--bandwidth"
    assert [row["batch"] for row in res["rows"]] == [1, 3]
    for row in res["rows"]:
        nbytes = by_hand(cfg, row["batch"], 40, 4)
        assert row["bytes_mb"] == round(nbytes / 1e6, 1)
        assert row["roofline_ms"] == round(1000 * nbytes / 10e9, 3)
        assert row["step_ms"] > 0 and abs(row["fraction"] - row["roofline_ms"] / row["step_ms"]) < 0.01


def test_bench_roofline_refuses_bad_sizes(llama_dir):
    r = run_pdtb("bench", "roofline", "--model", llama_dir, "--batches", "0")
    assert r.returncode == 2 and "positive" in r.stderr


def test_bench_roofline_compare_times_each_decode_path(llama_dir):
    """On the CPU: the C kernel (the engine's path) and the gather path, on the same rows."""
    r = run_pdtb("bench", "roofline", "--model", llama_dir, "--batches", "2", "--context", "40", "--reps", "1",
                 "--bandwidth", "10", "--compare", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["paths"][-1] == "gather" and len(res["paths"]) in (1, 2)  # C kernel where a compiler is found
    row = res["rows"][0]
    assert row["path"] == res["paths"][0]
    for name in res["paths"][1:]:
        assert row[f"{name}_ms"] > 0 and abs(row[f"{name}_fraction"] - row["roofline_ms"] / row[f"{name}_ms"]) < 0.01


def test_decode_kernel_pick_takes_the_fastest_setting_with_the_engines_spans():
    """`--pick ROWS` reads a decode-kernel sweep and names the fastest setting at that many
    rows among those run with the engine's own span count, with the span rule it ran under (a
    faster forced span count is passed over); an absent batch size gives nothing and exit
    status 1."""
    import io
    import json
    import sys

    from pdtb.microbench.decode_kernel import main as kernel_main
    from pdtb.engine.triton_decode import KernelConfig

    def setting(bn, warps, stages, major, splits, gbps, **rule):
        return {"block_n": bn, "num_warps": warps, "num_stages": stages, "head_major": major,
                "splits": splits, "gbps": gbps, **rule}
    res = {"rows": [{"batch": 8, "best_auto": setting(32, 4, 2, 0, "auto (2)", 900.0, programs_per_sm=2,
                                                      min_span=256)},
                    {"batch": 64, "best": setting(64, 4, 3, 1, 2, 3000.0),
                     "best_auto": setting(16, 8, 2, 0, "auto (4)", 2600.0, programs_per_sm=4, min_span=256)}]}
    out = []
    for rows in ("64", "128"):
        sys.stdin, stdout = io.StringIO(json.dumps(res)), sys.stdout
        sys.stdout = buf = io.StringIO()
        try:
            out.append((kernel_main(["--pick", rows]), buf.getvalue().strip()))
        finally:
            sys.stdin, sys.stdout = sys.__stdin__, stdout
    text = "block_n=16,num_warps=8,num_stages=2,head_major=0,programs_per_sm=4,min_span=256"
    assert out == [(0, text), (1, "")]
    assert KernelConfig.parse(text) == KernelConfig(block_n=16, num_warps=8, num_stages=2, programs_per_sm=4,
                                                    min_span=256)
