"""Load a local HuggingFace causal-LM checkpoint (Llama / Qwen2 / Mistral families)."""
from __future__ import annotations

from pathlib import Path

import torch

from pdtb.engine.kv_spec import DTYPES, dtype_name, torch_dtype
from pdtb.engine.model_info import SUPPORTED_MODEL_TYPES, ModelInfo, ModelLoadError, read_model_info  # noqa: F401
from pdtb.engine.model_info import resolve_model, resolve_model_arg  # noqa: F401


# Any of these says the checkpoint brings a tokenizer (transformers decides which it can use);
# with none, AutoTokenizer's own error speaks of converters, not of a missing tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return torch_dtype(name)


def load_model(model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
               attn_implementation: str | None = None):
    """Return (model, tokenizer, info). The model is in eval mode on `device`."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    info = read_model_info(model_dir)
    kwargs = {"dtype": resolve_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"cannot load {model_dir}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]  # (one line: the first and the last)
        why = " ... ".join(lines[:1] + lines[1:][-1:]) or type(e).__name__
        raise ModelLoadError(f"cannot load {model_dir}: {why[:600]}") from None
    model.to(device).eval()
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in info.eos_token_ids:
        info = ModelInfo(**{**info.__dict__, "eos_token_ids": info.eos_token_ids + (tokenizer.eos_token_id,)})
    return model, tokenizer, info


__all__ = ["SUPPORTED_MODEL_TYPES", "ModelInfo", "ModelLoadError", "load_model", "read_model_info", "dtype_name"]
