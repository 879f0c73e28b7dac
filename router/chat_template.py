"""Chat templates: where a model's template comes from, and rendering it.

A chat template is the Jinja program a checkpoint ships to turn a conversation into its prompt
text. The router renders it itself, the way transformers' `apply_chat_template` does (a
sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, a `tojson`
filter that does not escape HTML, `raise_exception`, `strftime_now`, loop controls, and the
`{% generation %}` block rendered as its body), so the router needs neither torch nor
transformers for it. `tests/test_router_chat.py` checks the text against transformers.

Where the template comes from, first found wins:
1. the router's `--chat-template` (a file, or the template text itself);
2. `chat_template.jinja` in the checkpoint directory (how transformers 5 saves it);
3. `chat_template` in its `tokenizer_config.json` (a string, or a list of named templates,
   of which "default" is used).
A checkpoint with none cannot serve /v1/chat/completions (400 naming the flag), as in vLLM.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template could not be loaded, or refused the conversation (raise_exception)."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """One compiled template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`. Raises ChatTemplateError when the template refuses
        the conversation (e.g. roles that do not alternate) or fails on it."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed on this conversation: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from None


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def special_tokens_of(model_dir: str | Path) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (what templates use)."""
    try:
        cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        text = _token_text(cfg.get(key))
        if text is not None:
            out[key] = text
    return out


def _from_config(model_dir: Path) -> str | None:
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):  # named templates: [{"name": ..., "template": ...}]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return t if isinstance(t, str) and t else None


def find_chat_template_source(model_dir: str | Path, override: str | None = None) -> str | None:
    """The template text, from the first of the places in the module docstring that has one."""
    if override:
        path = Path(override)
        if "{" not in override and not path.is_file():
            raise ChatTemplateError(f"--chat-template: no such file: {override}")
        return path.read_text() if "{" not in override else override
    d = Path(model_dir)
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    return _from_config(d)


def load_chat_template(model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
    """The model's chat template, compiled, or None when it has none."""
    source = find_chat_template_source(model_dir, override)
    return None if source is None else ChatTemplate(source, special_tokens_of(model_dir))
