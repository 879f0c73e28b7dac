"""docs/gpu-results.md, the GPU check's page beside docs/results.md (pdtb/figures/gpu_section.py),
rendered from the files of a gpu_check run made by hand here, figures checked by hand."""
from __future__ import annotations

import json

from pdtb.figures.results_doc import main as results_doc


def gpu_run(d, tests_line="45 passed, 1 skipped in 112.52s"):
    d.mkdir()
    (d / "env.txt").write_text("torch 2.11.0+cu130 cuda 13.0\ndevice 0 NVIDIA H200\n")
    (d / "commit").write_text("abc1234\n")
    (d / "tests.log").write_text(f"....\n==== {tests_line} ====\n")
    (d / "engine-bf16.json").write_text(json.dumps({"paged_tok_s": 5000.0, "hf_padded_tok_s": 1000.0, "ratio": 5.0,
                                                     "ratio_paired_median": 4.5, "step_ms_median": 0.5}))
    (d / "roofline-llama-3-8b.json").write_text(json.dumps({
        "dtype": "bfloat16", "context": 1024, "reps": 5, "bandwidth_gbps": 4800.0, "bandwidth_source": "datasheet (h200)",
        "paths": ["graphs", "triton"], "kernel_config": "KernelConfig()",
        "rows": [{"batch": 64, "bytes_mb": 24000.0, "roofline_ms": 5.0, "step_ms": 10.0, "fraction": 0.5,
                  "triton_ms": 30.0}]}))
    (d / "kernel.json").write_text(json.dumps({
        "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16", "context": 1024, "page_size": 16, "reps": 20,
        "rows": [{"batch": 64, "bytes_mb": 268.4, "copy_gbps": 4000.0,
                  "settings": [{"block_n": 64, "num_warps": 4, "num_stages": 3, "head_major": 0, "splits": "auto (1)",
                                "gbps": 1800.0}],
                  "best": {"block_n": 64, "num_warps": 4, "num_stages": 3, "head_major": 0, "splits": 1, "gbps": 1900.0}}]}))
    return d


def test_gpu_page_is_written_beside_the_document_and_leaves_it_alone(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("# Results\n\n## Other\nkept\n")
    assert results_doc(["--section", "gpu", "--gpu", str(gpu_run(tmp_path / "g")), "--out", str(doc)]) == 0
    assert doc.read_text() == "# Results\n\n## Other\nkept\n"
    text = (tmp_path / "gpu-results.md").read_text()
    assert text.startswith("# On a GPU\n") and "(results.md)" in text
    assert "commit abc1234" in text and "45 passed, 1 skipped" in text and "NVIDIA H200" in text
    assert "| bfloat16, CUDA graphs | 5000 | 1000 | **5.00x** | 4.50x | 0.50 |" in text
    # 24,000 MB over the measured 4,000 GB/s is 6 ms: 0.60 of the 10 ms step
    assert "| 64 | 10.00 | 5.00 | **0.50** | 0.60 | 30.00 |" in text
    assert "| 64 | 268.4 | 4000 | 1800 | 64 keys, 4 warps, 3 stages, 1 span(s) | 1900 |" in text
    # a second run replaces the page
    assert results_doc(["--section", "gpu", "--gpu", str(gpu_run(tmp_path / "h", "3 failed")), "--out", str(doc)]) == 0
    text = (tmp_path / "gpu-results.md").read_text()
    assert text.count("# On a GPU") == 1 and "3 failed" in text and "45 passed" not in text
