"""The router's torch-free tokenizer against transformers' AutoTokenizer on the same checkpoint."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import transformers

from pdtb.engine.tokenizer import (PLAIN_CLASSES, MARKER, PipelineTokenizer, load_tokenizer, plain_pipeline_config,
                                    recorded_class)

TEXTS = ["", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
         "naïve café — 東京 🚀", "<|eos|> inside <|bos|>text<|pad|>", "x" * 300, "1234567890 " * 20]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_same_ids_text_and_eos_as_autotokenizer(model_dirs, arch):
    d = model_dirs[arch]
    ours, ref = load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)
    # the class transformers picks was recorded when the model was made; qwen2 gets its own class
    assert recorded_class(d) == type(ref).__name__
    assert isinstance(ours, PipelineTokenizer) == (type(ref).__name__ in PLAIN_CLASSES)
    if arch == "llama":
        assert isinstance(ours, PipelineTokenizer), "the default model's router needs no torch"
    assert ours.eos_token_id == ref.eos_token_id is not None
    rng = random.Random(arch)
    texts = TEXTS + ["".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
                             for _ in range(rng.randrange(1, 60))) for _ in range(40)]
    for text in texts:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == ref(text, add_special_tokens=special)["input_ids"], (text, special)
            assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    n = len(ref)
    for _ in range(200):  # arbitrary id sequences: special ids, broken UTF-8 sequences
        ids = [rng.randrange(n) for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids


def _variant(src: str, dst, **changes) -> str:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("changes", [{"tokenizer_class": "LlamaTokenizer"}, {"add_bos_token": True},
                                     {"clean_up_tokenization_spaces": True}, {"legacy": False}])
def test_anything_transformers_would_change_goes_through_autotokenizer(model_dirs, tmp_path, changes):
    d = _variant(model_dirs["llama"], tmp_path / "m", **changes)
    assert plain_pipeline_config(d) is None
    assert not isinstance(load_tokenizer(d), PipelineTokenizer)


def test_missing_or_broken_files_or_another_transformers_version_are_not_plain(model_dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(model_dirs["llama"], d)
    assert plain_pipeline_config(d) is not None
    notes = json.loads((d / MARKER).read_text())
    notes["router_tokenizer"]["transformers"] = "0.0.1"  # recorded under another version
    (d / MARKER).write_text(json.dumps(notes))
    assert plain_pipeline_config(d) is None
    (d / MARKER).unlink()  # not recorded at all (any checkpoint not made here)
    assert plain_pipeline_config(d) is None
    shutil.rmtree(d)
    shutil.copytree(model_dirs["llama"], d)
    (d / "tokenizer_config.json").write_text("{not json")
    assert plain_pipeline_config(d) is None
    (d / "tokenizer_config.json").unlink()
    assert plain_pipeline_config(d) is None


def test_serving_the_embedded_model_does_not_import_torch(model_dirs):
    """Neither the router process (its modules, the model argument's check, the tokenizer) nor
    the load client's tokenizer imports torch or transformers: seconds of CPU at every start."""
    code = ("import sys; import pdtb.router.main, pdtb.client.serve, pdtb.client.sweep; "
            "from pdtb.router.config import load_served_model; from pdtb.engine.model_info import resolve_model_arg; "
            f"m = load_served_model(resolve_model_arg({model_dirs['llama']!r})); "
            "assert m.tokenizer('hi')['input_ids']; print(sorted(k for k in ('torch', 'transformers') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
