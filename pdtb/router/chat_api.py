"""OpenAI `/v1/chat/completions`: request parsing and the chat response shapes.

A chat request is a completion request whose prompt is a conversation: the router renders
it with the model's chat template (pdtb/router/chat_template.py), tokenizes the text without
adding special tokens (the template writes them, as in vLLM), and from there it runs exactly
as /v1/completions does (pdtb/router/completions.py).

Accepted body fields, besides those /v1/completions shares (openai_api.generation_fields:
temperature, top_p, seed, stop, stream, stream_options, user, and the vLLM extensions
ignore_eos, priority, return_token_ids, stop_token_ids, and pd-testbed's slo_tier):
  messages               a non-empty list of {"role", "content"[, "name"]}; role one of ROLES;
                         content a string or a list of {"type": "text", "text": ...} parts
                         (joined); null content only for an assistant turn
  max_completion_tokens  (or the older max_tokens) positive int
  add_generation_prompt  (vLLM) default true: end the prompt with the assistant's turn header
  chat_template_kwargs   (vLLM) extra variables for the template, e.g. {"enable_thinking": false}
Without max_tokens the reply may use the rest of the context (vLLM's chat default).
Refused with 400, because they change the response or are not implemented: n != 1, logprobs,
top_logprobs, tools, tool_choice, functions, function_call, non-text response_format,
parallel_tool_calls, continue_final_message, echo, a message with tool_calls, non-text content
parts, and the non-neutral sampling fields /v1/completions refuses.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdtb.router.openai_api import (NEUTRAL, CompletionRequest, _check_unicode, bad_request, check_model,
                               generation_fields, load_body)

ROLES = ("system", "developer", "user", "assistant", "tool")
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token",
                                    "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"})
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class ChatPrompt:
    """The conversation a chat request asks to continue."""

    messages: tuple[dict, ...]  # {"role": str, "content": str[, "name": str]}, content as one string
    add_generation_prompt: bool = True  # end with the assistant's turn header
    template_kwargs: tuple[tuple[str, object], ...] = ()  # chat_template_kwargs (vLLM): extra template variables


def _content(value, i: int) -> str:
    param = f"messages[{i}].content"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                  param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request("'content' must be a string or a list of text parts", param)


def _message(m, i: int) -> dict:
    if not isinstance(m, dict):
        raise bad_request("each message must be an object with 'role' and 'content'", f"messages[{i}]")
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"'role' must be one of {', '.join(ROLES)}", f"messages[{i}].role")
    if m.get("tool_calls"):
        raise bad_request("tool calls are not supported", f"messages[{i}].tool_calls")
    content = m.get("content")
    if content is None and role != "assistant":
        raise bad_request("'content' is required", f"messages[{i}].content")
    out = {"role": role, "content": "" if content is None else _content(content, i)}
    if isinstance(content, list):  # kept for templates that loop over parts (chat_template.py)
        out["parts"] = [p["text"] for p in content]
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request("'name' must be a string", f"messages[{i}].name")
        out["name"] = name
    _check_unicode([out["content"], name], f"messages[{i}]")
    return out


UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "top_logprobs", "parallel_tool_calls")


def _reject_unsupported(body: dict) -> None:
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or value not in neutral):
            raise bad_request(f"'{key}' is not supported (only {neutral[0]!r})", key)
    for key in UNSUPPORTED:
        if body.get(key) not in (None, [], "none"):
            raise bad_request(f"'{key}' is not supported", key)
    if body.get("logprobs"):
        raise bad_request("'logprobs' is not supported", "logprobs")
    if body.get("continue_final_message"):
        raise bad_request("'continue_final_message' is not supported", "continue_final_message")
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("only the 'text' response_format is supported", "response_format")


def parse_chat_request(raw: bytes, served_name: str, vocab_size: int) -> CompletionRequest:
    """Decode and validate a chat body. Raises ApiError (400, or 404 for an unknown model).
    The prompt is a ChatPrompt: rendering and length checks come later (completions.prepare)."""
    body = load_body(raw)
    model = check_model(body, served_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"'messages' takes at most {MAX_MESSAGES} messages", "messages")
    _reject_unsupported(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if key != "max_tokens" and body.get("max_tokens") is not None:  # the older field loses, but must be valid
        generation_fields({"max_tokens": body["max_tokens"]}, vocab_size)
    fields = generation_fields(body, vocab_size, max_tokens_key=key)
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise bad_request("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs) \
            or RESERVED_TEMPLATE_VARS & set(kwargs):
        raise bad_request("'chat_template_kwargs' must be an object of template variables (not "
                          f"{', '.join(sorted(RESERVED_TEMPLATE_VARS))})", "chat_template_kwargs")
    prompt = ChatPrompt(tuple(_message(m, i) for i, m in enumerate(messages)), agp, tuple(kwargs.items()))
    return CompletionRequest(model=model, prompt=prompt, **fields)


def chat_choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                stop_reason: str | int | None = None) -> dict:
    """choices[0] of a whole chat.completion."""
    c = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
         "finish_reason": finish_reason, "stop_reason": stop_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c


def chat_delta(text: str | None, finish_reason: str | None = None, token_ids: list[int] | None = None,
               stop_reason: str | int | None = None, role: bool = False) -> dict:
    """choices[0] of a chat.completion.chunk; the first chunk carries the role."""
    delta = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        c["stop_reason"] = stop_reason
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c
