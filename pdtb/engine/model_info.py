"""What a checkpoint directory is, from its config.json alone: no torch, no weights.

The router and the CLI's argument checks read this; importing torch (seconds on a small
machine) is left to the processes that run the model (`loader.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdtb.common import CliError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


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

    def kv_spec(self, page_size: int, dtype: str):
        from pdtb.engine.kv_spec import KVSpec  # torch: only the engine needs it

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
    return model_info_from_config(cfg, str(path), str(cfg_path))


def model_info_from_config(cfg: dict, model_dir: str, where: str) -> ModelInfo:
    """A `ModelInfo` from a config dict (`where` names it in errors): a checkpoint's, or a
    config alone for a model built with random weights."""
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model_type {mtype!r} in {where}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    max_len = cfg.get("max_position_embeddings", 2048)
    if mtype in ("mistral", "qwen2", "qwen3") and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        max_len = min(max_len, cfg["sliding_window"])  # paged attention here is full attention
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelInfo(model_dir, mtype, cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                     head_dim, cfg["vocab_size"], max_len, eos_ids)


def resolve_model(model_dir: str | None) -> str:
    """`model_dir` checked to be a supported checkpoint (ModelLoadError if not), or the embedded
    default model's directory (created on first use)."""
    from pdtb.engine.tiny_model import ensure_default_model

    if model_dir is None:
        return str(ensure_default_model())
    read_model_info(model_dir)
    return str(Path(model_dir))


def resolve_model_arg(model_dir: str | None) -> str:
    """`--model DIR` validated, or the embedded default; a bad directory is a CliError."""
    try:
        return resolve_model(model_dir)
    except ModelLoadError as e:
        raise CliError(str(e)) from None
