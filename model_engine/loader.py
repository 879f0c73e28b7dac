"""Load a local HuggingFace causal-LM checkpoint (Llama / Qwen2 / Mistral families)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model_engine.kv_spec import DTYPES, KVSpec, dtype_name

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class ModelLoadError(ValueError):
    """The model directory is missing, unreadable or of an unsupported family."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about a loaded checkpoint."""

    model_dir: str
    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the embedding: valid token ids are [0, vocab_size)
    max_model_len: int  # prompt + output tokens at most
    eos_token_ids: tuple[int, ...]

    def kv_spec(self, page_size: int, dtype: str) -> KVSpec:
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, page_size, dtype)


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Validate a checkpoint directory from its config.json alone (cheap, no weights)."""
    path = Path(model_dir)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path}")
    if not cfg_path.is_file():
        raise ModelLoadError(f"not a HuggingFace checkpoint (no config.json): {path}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from None
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {mtype!r} in {cfg_path}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    max_len = cfg.get("max_position_embeddings", 2048)
    if mtype in ("mistral", "qwen2") and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        max_len = min(max_len, cfg["sliding_window"])  # paged attention here is full attention
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelInfo(str(path), mtype, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                     head_dim, cfg["vocab_size"], max_len, eos_ids)


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


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
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {model_dir}: {str(e).splitlines()[0]}") from None
    model.to(device).eval()
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in info.eos_token_ids:
        info = ModelInfo(**{**info.__dict__, "eos_token_ids": info.eos_token_ids + (tokenizer.eos_token_id,)})
    return model, tokenizer, info


__all__ = ["ModelInfo", "ModelLoadError", "load_model", "read_model_info", "dtype_name"]
