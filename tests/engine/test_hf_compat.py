"""The engine reaches transformers only through its attention interface: nothing of ours poses
as a cache, an unservable model class stops with one line, and the supported range in the code
is the one pyproject.toml declares."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import make_engine, make_prompts
from pdtb.engine import hf_compat
from pdtb.engine.sequence import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
OURS = ("pdtb", "prefill_node", "decode_node", "kv_transport", "fairness")


def _ours(obj) -> bool:
    return type(obj).__module__.split(".")[0] in OURS


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_forward_gets_no_cache_object_of_ours(model_dirs, arch):
    """Every forward of a run with prefill, chunking and decode: no argument is a cache
    (transformers' or a duck-typed one of ours), caching is off, and the only object of ours
    is the step metadata, which offers no cache protocol."""
    from transformers import Cache

    # (transformers' forward, as with lean_forward off or a model the lean forward does not take)
    engine = make_engine(model_dirs[arch], page_size=7, max_num_batched_tokens=48, lean_forward=False)
    seen = []

    def inspect(module, args, kwargs):
        seen.append(1)
        assert not args, "the runner passes keywords only"
        assert kwargs.get("use_cache") is False
        assert "past_key_values" not in kwargs and "cache" not in kwargs
        for name, value in kwargs.items():
            assert not isinstance(value, Cache), name
            if _ours(value):
                assert name == "pdtb_meta", name
                assert not any(hasattr(value, a) for a in ("update", "get_seq_length", "get_mask_sizes")), name

    handle = engine.model.register_forward_pre_hook(inspect, with_kwargs=True)
    try:
        engine.generate(make_prompts((60, 3, 20), engine.info.vocab_size, seed=5), SamplingParams(max_tokens=6))
    finally:
        handle.remove()
    assert len(seen) >= 6  # chunked prefill steps and decode steps


def test_every_layer_attends_through_the_registered_function(llama_dir):
    engine = make_engine(llama_dir, page_size=16)
    layers = engine.model.config.num_hidden_layers
    metas = []
    build = engine.runner.build_metadata
    engine.runner.build_metadata = lambda chunks: (lambda out: metas.append(out[2]) or out)(build(chunks))
    engine.generate(make_prompts((9, 30), engine.info.vocab_size, seed=2), SamplingParams(max_tokens=4))
    assert metas and all(m.layers_run == list(range(layers)) for m in metas)


def test_model_that_skips_the_attention_interface_is_refused(llama_dir):
    """A model class whose layers do not call the registered attention (as a transformers
    release that stopped passing through it would) stops the engine at start-up with one line
    naming the installed version and the supported range."""
    import transformers

    from pdtb.engine.loader import load_model

    model = load_model(llama_dir, attn_implementation="sdpa")[0]
    with pytest.raises(hf_compat.UnsupportedModel) as err:
        hf_compat.check_model(_SdpaOnly(model), _kv_for(model), 16)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"transformers {transformers.__version__}" in msg and hf_compat.TRANSFORMERS_REQUIREMENT in msg
    assert "once per layer" in msg


def test_model_whose_forward_raises_is_refused_with_the_supported_range(llama_dir):
    from pdtb.engine.loader import load_model

    model = load_model(llama_dir, attn_implementation="sdpa")[0]

    def broken(*args, **kwargs):
        raise TypeError("update() got an unexpected keyword argument 'kwargs'")

    model.model.layers[1].self_attn.forward = broken
    with pytest.raises(hf_compat.UnsupportedModel, match=r"TypeError: update\(\) got an unexpected.*supports "
                       r"transformers>="):
        hf_compat.check_model(model, _kv_for(model), 16)


def test_generate_cli_reports_an_unsupported_model_in_one_line(llama_dir, monkeypatch, capsys):
    from pdtb.engine import hf_compat as hc
    from pdtb.cli import main

    def refuse(*a, **kw):
        raise hc.UnsupportedModel(f"llama model does not run on the paged engine (x); {hc.support_line()}")

    monkeypatch.setattr(hc, "check_model", refuse)
    assert main(["generate", "--model", llama_dir, "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "supports transformers>=" in err[0], err


def test_supported_range_is_pyproject_s():
    text = (ROOT / "pyproject.toml").read_text()
    declared = re.search(r'"transformers([^"]+)"', text).group(1)
    assert declared == hf_compat.TRANSFORMERS_REQUIREMENT


class _SdpaOnly(torch.nn.Module):
    """The model with the engine's attention name replaced by sdpa on every call: the paged
    function is never reached, as with a model class that ignores `attn_implementation`."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config

    def forward(self, **kwargs):
        kwargs.pop("pdtb_meta")
        self.inner.set_attn_implementation("sdpa")
        return self.inner(**kwargs)


def _kv_for(model) -> torch.Tensor:
    cfg = model.config
    kvh = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return torch.zeros(cfg.num_hidden_layers, 2, 1, 16, kvh, hd)
