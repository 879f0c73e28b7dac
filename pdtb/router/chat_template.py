"""Chat templates: where a model's template comes from, and rendering it.

A chat template is the Jinja program a checkpoint ships to turn a conversation into its prompt
text. The router renders it itself, the way transformers' `apply_chat_template` does (a
sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, a `tojson`
filter that does not escape HTML, `raise_exception`, `strftime_now`, loop controls, and the
`{% generation %}` block rendered as its body), so the router needs neither torch nor
transformers for it. `tests/router/test_router_chat.py` checks the text against transformers.

Where the template comes from, first found wins:
1. the router's `--chat-template` (a file, or the template text itself);
2. `chat_template.jinja` in the checkpoint directory (how transformers 5 saves it);
3. `chat_template` in its `tokenizer_config.json` (a string, or a list of named templates,
   of which "default" is used).
A checkpoint with none cannot serve /v1/chat/completions (400 naming the flag), as in vLLM.
"""
from __future__ import annotations

import json
import logging
import re
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


log = logging.getLogger(__name__)
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
# A template that loops over a message's content expects OpenAI's list of parts, not a string
# (vLLM detects the same; given a string, such a loop would walk its characters).
_ITERATES_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)\s*-?%\}")


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
        self.parts_content = bool(_ITERATES_CONTENT.search(source))  # content as [{"type": "text", ...}]

    def _shape(self, m: dict) -> dict:
        """A message as the template expects it: content a string, or a list of text parts."""
        out = {k: v for k, v in m.items() if k != "parts"}
        if self.parts_content:
            texts = m.get("parts") if m.get("parts") is not None else [m["content"]]
            out["content"] = [{"type": "text", "text": t} for t in texts]
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None,
               max_chars: int | None = None, deadline: float | None = None) -> str:
        """The prompt text of `messages` (`extra`: more template variables). Rendering stops
        with ChatTemplateError past `max_chars` characters of output or past the monotonic
        `deadline`, and when the template refuses the conversation (raise_exception, e.g.
        roles that do not alternate) or fails on it."""
        out, n = [], 0
        try:
            for piece in self._template.generate(messages=[self._shape(m) for m in messages],
                                                 add_generation_prompt=add_generation_prompt, tools=None,
                                                 documents=None, **self.special_tokens, **(extra or {})):
                out.append(piece)
                n += len(piece)
                if max_chars is not None and n > max_chars:
                    raise ChatTemplateError(f"the rendered conversation passes {max_chars} characters, "
                                            f"more than the context can hold")
                if deadline is not None and time.monotonic() > deadline:
                    raise ChatTemplateError("the chat template took too long on this conversation")
        except ChatTemplateError:
            raise
        except Exception as e:  # anything the template does wrong is the request's error, not a 500
            raise ChatTemplateError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from None
        return "".join(out)


def _token_text(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def special_tokens_of(model_dir: str | Path) -> dict:
    """bos_token, eos_token, ... and additional_special_tokens, as transformers passes them to
    templates: tokenizer_config.json, then the older special_tokens_map.json for what it lacks."""
    d = Path(model_dir)
    sources = (_json(d / "tokenizer_config.json"), _json(d / "special_tokens_map.json"))
    out: dict = {}
    for key in SPECIAL_KEYS:
        for src in sources:
            text = _token_text(src.get(key))
            if text is not None:
                out[key] = text
                break
    for src in sources:
        extra = src.get("additional_special_tokens")
        if isinstance(extra, list):
            out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
            break
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
    """The model's chat template, compiled, or None when it has none. A checkpoint's template
    that does not compile disables chat (with a warning) rather than the whole router; one
    given with --chat-template is an error."""
    source = find_chat_template_source(model_dir, override)
    if source is None:
        return None
    try:
        return ChatTemplate(source, special_tokens_of(model_dir))
    except ChatTemplateError as e:
        if override:
            raise
        log.warning("the checkpoint's chat template is unusable, /v1/chat/completions is off: %s", e)
        return None
