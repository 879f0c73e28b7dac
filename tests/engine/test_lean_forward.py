"""The lean forward computes what transformers' forward computes: every step's logits through
both paths on the same pool (chunked prefill, mixed steps, decode), for each decoder class it
takes, and greedy outputs equal to transformers' generate. Models it does not take run through
transformers."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, make_engine, make_prompts
from pdtb.engine import lean_forward
from pdtb.engine.sequence import SamplingParams


def _qwen3_dir(llama_dir: str, out: Path) -> str:
    """A Qwen3 checkpoint (per-head q/k RMSNorm) of the embedded model's sizes and tokenizer."""
    import transformers

    src = transformers.AutoConfig.from_pretrained(llama_dir)
    cfg = transformers.Qwen3Config(
        vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.intermediate_size,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        num_key_value_heads=src.num_key_value_heads, head_dim=src.hidden_size // src.num_attention_heads,
        max_position_embeddings=src.max_position_embeddings, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=src.bos_token_id, eos_token_id=src.eos_token_id, pad_token_id=src.pad_token_id)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(llama_dir) / name).exists():
            shutil.copy(Path(llama_dir) / name, out / name)
    return str(out)


@pytest.fixture(scope="module")
def arch_dirs(model_dirs, tmp_path_factory):
    return {**model_dirs, "qwen3": _qwen3_dir(model_dirs["llama"], tmp_path_factory.mktemp("qwen3"))}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_every_step_matches_transformers_forward(arch_dirs, arch, attention):
    engine = make_engine(arch_dirs[arch], page_size=7, max_num_batched_tokens=40, decode_attention=attention)
    runner = engine.runner
    assert runner.lean is not None, lean_forward.unsupported(engine.model)
    steps = []
    build = runner.build_metadata

    def both(chunks):  # one step's metadata, the step run through each path on the same pool
        ids, pos, meta, rows = out = build(chunks)
        lean = runner.lean(ids, pos, meta, 0 if rows is None else rows)
        layers = list(meta.layers_run)
        meta.layers_run.clear()
        keep = 0 if rows is None else rows
        ref = engine.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                           pdtb_meta=meta).logits[0]
        steps.append((lean, ref, layers, list(meta.layers_run), sum(len(c.token_ids) for c in chunks)))
        return out

    runner.build_metadata = both
    engine.generate(make_prompts((57, 3, 21, 90), engine.info.vocab_size, seed=7), SamplingParams(max_tokens=5))
    assert {n > 4 for *_, n in steps} == {True, False}  # prefill chunks and decode-only steps
    for lean, ref, layers, ref_layers, _ in steps:
        assert layers == ref_layers == list(range(engine.model.config.num_hidden_layers))
        torch.testing.assert_close(lean, ref, rtol=1e-4, atol=1e-4)  # (the C RMSNorm sums in double)


@pytest.mark.parametrize("arch", ["qwen3"])
def test_greedy_matches_generate(arch_dirs, arch):
    """(llama, qwen2 and mistral: test_engine_equivalence, where the lean forward is the default)"""
    from pdtb.engine.loader import load_model

    engine = make_engine(arch_dirs[arch], page_size=16)
    assert engine.runner.lean is not None
    ref = load_model(arch_dirs[arch], attn_implementation="sdpa")[0]
    prompts = make_prompts((5, 40, 17), engine.info.vocab_size, seed=11)
    seqs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [list(s.output_token_ids) for s in seqs] == [hf_greedy(ref, p, 12, ignore_eos=True) for p in prompts]


def test_models_it_does_not_take_run_through_transformers(llama_dir):
    engine = make_engine(llama_dir, page_size=16)
    model = engine.model
    assert lean_forward.unsupported(model) is None
    model.config.hidden_act = "gelu"
    assert "silu only" in lean_forward.unsupported(model)
    model.config.hidden_act = "silu"
    norm = model.model.norm
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    assert "norm modules" in lean_forward.unsupported(model)
    model.model.norm = norm
    layer = model.model.layers[0]
    model.model.layers[0] = type("OtherLayer", (torch.nn.Module,), {})()
    assert "OtherLayer" in lean_forward.unsupported(model)
    with pytest.raises(ValueError, match="lean forward"):
        lean_forward.LeanForward(model)
    model.model.layers[0] = layer
    assert make_engine(llama_dir, page_size=16, lean_forward=False).runner.lean is None
