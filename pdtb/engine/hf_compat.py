"""What the engine asks of transformers, and the start-up check that a model gives it.

The engine drives a stock transformers model through documented extension points only:

- an attention function registered with `transformers.AttentionInterface` and selected by
  `attn_implementation` (or `set_attn_implementation`);
- extra keyword arguments of the model's forward reaching that function (`pdtb_meta`);
- `position_ids`, `use_cache=False` and `logits_to_keep` on the forward.

No object of the engine's stands in for a transformers cache. `check_model` runs a two-step
probe (a prefill, then a decode row) on a scratch pool when an engine starts, and turns any
way a model class falls short of the above (a modeling call the engine cannot serve, layers
that skip the registered attention) into one `UnsupportedModel` line naming the installed
transformers and the range the project supports, instead of an error from inside modeling code.

On the CPU the Llama-family classes then run through lean_forward.py instead: the same
arithmetic over the modules' own weights, checked against their transformers forward (the
path the probe takes, and every other model's).
"""
from __future__ import annotations

import torch

from pdtb.engine.model_info import ModelLoadError

# Kept equal to the transformers requirement in pyproject.toml (tests/engine/test_hf_compat.py).
TRANSFORMERS_REQUIREMENT = ">=5.0"
# Versions the engine-equivalence and cluster tests passed on (scripts/check_latest.sh).
CHECKED_ON = ("5.0.0", "5.23.0", "5.24.0")
PROBE_TOKENS = 3  # prompt tokens of the probe; one more is decoded


class UnsupportedModel(ModelLoadError):
    """The installed transformers runs this model class in a way the paged engine cannot serve."""


def support_line() -> str:
    import transformers

    return (f"installed transformers {transformers.__version__}; pd-testbed supports "
            f"transformers{TRANSFORMERS_REQUIREMENT} (checked on {', '.join(CHECKED_ON)})")


def check_model(model, kv_like: torch.Tensor, page_size: int, kernel=None) -> None:
    """Run a prefill of PROBE_TOKENS tokens and one decode row through `model` on a scratch
    pool shaped like `kv_like` ([layers, 2, pages, page_size, kv_heads, head_dim]); raise
    `UnsupportedModel` unless every step calls the registered attention once per layer, in
    layer order, and returns one row of finite logits."""
    from pdtb.engine.runner import BatchChunk, ModelRunner

    layers, _, _, _, kvh, hd = kv_like.shape
    pages = -(-(PROBE_TOKENS + 1) // page_size)
    scratch = torch.zeros(layers, 2, pages, page_size, kvh, hd, dtype=kv_like.dtype, device=kv_like.device)
    runner = ModelRunner(model, scratch, page_size, kv_like.device, kernel=kernel)
    metas = []
    build = runner.build_metadata
    runner.build_metadata = lambda chunks: _keep(build(chunks), metas)
    table = list(range(pages))
    prompt = [1 + i % 7 for i in range(PROBE_TOKENS)]
    steps = [BatchChunk("probe", prompt, 0, table, True), BatchChunk("probe", [2], PROBE_TOKENS, table, True)]
    mtype = getattr(model.config, "model_type", "?")
    for chunk in steps:
        try:
            logits = runner.run([chunk])
        except Exception as e:  # the model class called something outside the served interface
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise UnsupportedModel(f"{mtype} model does not run on the paged engine ({type(e).__name__}: "
                                   f"{first}); {support_line()}") from e
        _check_step(metas[-1].layers_run, logits, layers, mtype)


def _keep(built, metas: list):
    metas.append(built[2])
    return built


def _check_step(layers_run: list[int], logits: torch.Tensor, layers: int, mtype: str) -> None:
    if layers_run != list(range(layers)):
        raise UnsupportedModel(f"{mtype} model did not call the registered attention once per layer "
                               f"(layers called: {layers_run[:8]}{'...' if len(layers_run) > 8 else ''}, "
                               f"expected 0..{layers - 1}); {support_line()}")
    if logits.ndim != 2 or logits.shape[0] != 1 or not bool(torch.isfinite(logits).all()):
        raise UnsupportedModel(f"{mtype} model returned unusable logits of shape {tuple(logits.shape)} "
                               f"from the paged engine; {support_line()}")
