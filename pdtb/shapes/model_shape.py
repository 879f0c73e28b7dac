"""A decoder-only model's shape, read from a HuggingFace config.json: what its weights, its KV
cache and its FLOPs per token come to. No torch, no weights.

Shapes of a few public models ship beside this file (`model_configs/<name>.json`); anywhere a
config is asked for, one of those names does as well as a path.

Parameters counted from the shape (Llama / Qwen2 / Mistral: SwiGLU MLP, RMSNorm, RoPE):

    embeddings   vocab * hidden
    per layer    q: hidden * heads * head_dim        k, v: hidden * kv_heads * head_dim each
                 o: heads * head_dim * hidden        (+ q/k/v biases where attention_bias)
                 gate, up, down: 3 * hidden * intermediate
                 two RMSNorm weights: 2 * hidden
    final norm   hidden
    lm_head      vocab * hidden, unless tie_word_embeddings
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("model_configs")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def shipped_configs() -> list[str]:
    """Names of the model shapes that ship with the package."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name_or_path: str | Path) -> Path:
    """A config.json path from a shipped name, a config file, or a checkpoint directory."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        return p
    shipped = CONFIG_DIR / f"{name_or_path}.json"
    if shipped.is_file():
        return shipped
    raise ValueError(f"model config {str(name_or_path)!r}: no such file, and not one of "
                     f"{', '.join(shipped_configs())}")


def load_config(name_or_path: str | Path) -> dict:
    """The config dict of a shipped name, a config file or a checkpoint directory."""
    p = config_path(name_or_path)
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {p}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: a config.json holds one JSON object")
    return cfg


@dataclass(frozen=True)
class ModelShape:
    """The figures of a model that cost time and memory."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # lm_head shares the embedding matrix
    attn_bias: bool  # q, k and v projections carry biases (Qwen2)
    dtype_bytes: int = 2  # the checkpoint's dtype (torch_dtype)

    def __post_init__(self) -> None:
        sizes = (self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                 self.vocab, self.dtype_bytes)
        if min(sizes) < 1:
            raise ValueError(f"model {self.name!r}: every size must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: {self.heads} heads do not group over {self.kv_heads} KV heads")

    @classmethod
    def from_config(cls, cfg: dict | str | Path) -> "ModelShape":
        """From a config dict, a config.json path, a checkpoint directory or a shipped name."""
        name = "config"
        if not isinstance(cfg, dict):
            name = Path(str(cfg)).stem if Path(str(cfg)).suffix == ".json" else str(cfg)
            cfg = load_config(cfg)
        try:
            heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
            dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"  # transformers 5 writes "dtype"
            bias = cfg.get("attention_bias", cfg.get("model_type") == "qwen2")  # Qwen2 has q/k/v biases, no flag
            return cls(name, int(cfg["num_hidden_layers"]), hidden, heads,
                       int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or hidden // heads),
                       int(cfg["intermediate_size"]), int(cfg["vocab_size"]),
                       bool(cfg.get("tie_word_embeddings", False)), bool(bias), DTYPE_BYTES.get(str(dtype), 2))
        except KeyError as e:
            raise ValueError(f"model config {name!r}: missing {e.args[0]}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"model config {name!r}: {e}") from None

    @property
    def params(self) -> int:
        """Parameters, counted from the shape (see the module docstring)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + (q + 2 * kv if self.attn_bias else 0)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embed = self.vocab * self.hidden
        return embed + self.layers * layer + self.hidden + (0 if self.tied else embed)

    def weight_bytes(self, dtype_bytes: int | None = None) -> int:
        """Bytes of every weight at `dtype_bytes` (the checkpoint's dtype by default)."""
        return self.params * (dtype_bytes or self.dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """KV cache bytes one token holds: K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * (dtype_bytes or self.dtype_bytes)

    def attn_flops_per_pair(self) -> int:
        """FLOPs of one query-key pair over every layer and head: QK^T and PV, 2 each per dim."""
        return 4 * self.layers * self.heads * self.head_dim

    def flops_per_token(self, ctx: int = 0) -> int:
        """FLOPs to run one token through the model attending to `ctx` tokens: a multiply-add per
        weight (the embedding gather counted as one too: 6.5% of an untied 8B's weights, kept
        for a figure that can be checked by hand) plus its attention pairs."""
        return 2 * self.params + self.attn_flops_per_pair() * ctx
