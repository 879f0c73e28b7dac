"""The router's tokenizer, loaded without torch when that is known to be exact.

The router never runs the model, but transformers' AutoTokenizer imports torch: 7-9 s and
about 240 MB of memory on a 2-core machine, paid on the critical path of every cluster start
(the router starts after the nodes, since it needs their addresses).

Which tokenizer class AutoTokenizer builds is transformers' decision, and it is not read off
the files alone: for a `qwen2` config it builds Qwen2Tokenizer (its own pre-tokenizer) even when
tokenizer_config.json names TokenizersBackend. So the router does not predict it. A checkpoint
may carry the class AutoTokenizer built for it, recorded by `record_tokenizer_class` (the
embedded model does this when it is created) in its `pdtb.json` together with the transformers
version. When that class only wraps tokenizer.json (`TokenizersBackend`,
`PreTrainedTokenizerFast`), the version is the installed one, and tokenizer_config.json asks for
nothing transformers would apply on top (BOS/EOS switches, space clean-up, extra special
tokens), the router runs tokenizer.json with the `tokenizers` library itself
(`PipelineTokenizer`). Everything else goes through AutoTokenizer.

`tests/router/test_router_tokenizer.py` checks ids, text and eos against AutoTokenizer. The router uses
three things: `tok(text, add_special_tokens=True)["input_ids"]`, `tok.decode(ids,
skip_special_tokens=...)` and `tok.eos_token_id`.
"""
from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
MARKER = "pdtb.json"  # the project's own notes in a checkpoint directory
MARKER_KEY = "router_tokenizer"
# tokenizer_config.json keys that change nothing transformers does between the pipeline and us
INERT_KEYS = frozenset({
    "backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
    "cls_token", "mask_token", "model_max_length", "model_input_names", "padding_side", "truncation_side",
    "name_or_path", "chat_template",  # the router renders a chat template itself (pdtb/router/chat_template.py)
})  # not here, so AutoTokenizer's: added_tokens_decoder and extra special tokens (which ids are special)


class PipelineTokenizer:
    """tokenizer.json run by the `tokenizers` library: the subset of a HF tokenizer the router uses."""

    def __init__(self, tokenizer, eos_token: str | None) -> None:
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        self.eos_token_id = None if eos_token is None else self._tok.token_to_id(eos_token)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _read_json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def recorded_class(model_dir: str | Path) -> str | None:
    """The tokenizer class AutoTokenizer built for `model_dir`, if recorded under the installed
    transformers version."""
    rec = (_read_json(Path(model_dir) / MARKER) or {}).get(MARKER_KEY)
    if not isinstance(rec, dict) or rec.get("transformers") != _transformers_version():
        return None
    return rec.get("class") if isinstance(rec.get("class"), str) else None


def record_tokenizer_class(model_dir: str | Path, tokenizer=None) -> str:
    """Load `model_dir`'s tokenizer with AutoTokenizer (unless given) and record its class and the
    transformers version in `pdtb.json` (written atomically). Returns the class name."""
    if tokenizer is None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    path = Path(model_dir) / MARKER
    notes = _read_json(path) or {}
    notes[MARKER_KEY] = {"class": type(tokenizer).__name__, "transformers": _transformers_version()}
    tmp = path.with_name(f"{MARKER}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(notes))
    os.replace(tmp, path)
    return notes[MARKER_KEY]["class"]


def plain_pipeline_config(model_dir: str | Path) -> dict | None:
    """The tokenizer_config.json of `model_dir` if the router may run its tokenizer.json itself
    (see the module docstring), else None."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() or recorded_class(path) not in PLAIN_CLASSES:
        return None
    cfg = _read_json(path / "tokenizer_config.json")
    if cfg is None or cfg.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    extra = set(cfg) - INERT_KEYS - {"clean_up_tokenization_spaces"}
    if extra or cfg.get("clean_up_tokenization_spaces"):
        return None
    if any(_token_text(cfg.get(k)) is None and cfg.get(k) is not None for k in ("bos_token", "eos_token")):
        return None
    return cfg


def load_tokenizer(model_dir: str | Path):
    """A tokenizer for the router: `PipelineTokenizer` when the checkpoint allows it (no torch),
    transformers' AutoTokenizer otherwise."""
    cfg = plain_pipeline_config(model_dir)
    if cfg is not None:
        from tokenizers import Tokenizer

        try:
            tok = PipelineTokenizer(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")),
                                    _token_text(cfg.get("eos_token")))
        except Exception:  # a tokenizer.json this tokenizers version cannot read: let transformers try
            tok = None
        if tok is not None:
            return tok
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))
