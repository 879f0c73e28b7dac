"""OpenAI `/v1/completions`: request parsing and validation, response and error shapes.

Accepted body fields (null means absent for every optional field):
  model           the served model name; absent means the served model (as vLLM); another name -> 404
  prompt          a string, a list of token ids, or a list holding exactly one of those.
                  Batches (several prompts) are rejected with 400 for now.
  max_tokens      positive int, default 16 (when absent and the prompt leaves less room in the
                  context or in the largest decode or colocated pool, the default shrinks to fit);
                  prompt_len + max_tokens > max_model_len -> 400 (as vLLM)
  temperature     [0, 2], default 1.0;  top_p (0, 1], default 1.0;  seed int
  stop            a string or a list of up to 4 non-empty strings (text is cut before the match)
  stream, stream_options.include_usage, user (the tenant, at most 256 characters; default "default")
  vLLM extensions: ignore_eos, priority (int, lower first), return_token_ids, stop_token_ids
                  (at most 256 ids)
  slo_tier        pd-testbed: the request's SLO tier, 1-32 characters of [A-Za-z0-9_.-]; absent:
                  its tenant's default tier (router --tenant-tier), else none. memfair can key
                  memory quotas by it (node --quota-by slo-tier)
Strings must be valid Unicode (a lone surrogate such as "\ud800" is a 400), and so must the
body's nesting depth stay within what the JSON parser handles.
Rejected because they change the response shape: n != 1, best_of != 1, echo, logprobs; and,
because they would change the output and are not implemented, any non-neutral frequency_penalty,
presence_penalty, repetition_penalty, top_k, min_p, min_tokens, logit_bias or suffix.
Unknown fields are ignored, as OpenAI-compatible servers do.

Errors are `{"error": {"message", "type", "code", "param"}}` with an HTTP status (ApiError).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from pdtb.nodes.protocol import SLO_TIER_RE

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 256  # a node checks every sampled token against them
MAX_USER_CHARS = 256  # the tenant name is a label value in every node's per-tenant metrics


class ApiError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", "invalid_value", param)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` body."""

    model: str
    prompt: "str | tuple[int, ...] | ChatPrompt"  # text to tokenize, token ids as given, or a conversation (chat_api)
    max_tokens: int | None = None  # None: the default (16, or what fits)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first match
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final usage chunk
    tenant: str = "default"  # OpenAI `user`
    ignore_eos: bool = False
    priority: int = 0  # lower runs first
    return_token_ids: bool = False
    slo_tier: str = ""  # SLO tier ("": the tenant's default at the router, else none)


DEFAULT_MAX_TOKENS = 16


def _opt(body: dict, key: str, kinds: tuple[type, ...], what: str, default=None):
    """body[key] checked against `kinds` (bool never counts as a number); None means absent."""
    value = body.get(key)
    if value is None:
        return default
    is_num = float in kinds or int in kinds
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds) or \
            (is_num and isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(f"'{key}' must be {what}", key)
    return value


def _int64(body: dict, key: str, default: int | None) -> int | None:
    """An integer that fits the wire's 64 bits (a float with no fraction is one, as for max_tokens)."""
    value = _opt(body, key, (int, float), "an integer", default)
    if isinstance(value, float):
        if value != int(value):
            raise bad_request(f"'{key}' must be an integer", key)
        value = int(value)
    if value is not None and not -(1 << 63) <= value < (1 << 63):
        raise bad_request(f"'{key}' must fit in 64 bits", key)
    return value


def _token_ids(value: list, param: str, vocab_size: int) -> tuple[int, ...]:
    if not value:
        raise bad_request("prompt must not be empty", param)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request("token ids must be integers", param)
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab_size})", param)
    return tuple(value)


def _prompt(value, vocab_size: int) -> str | tuple[int, ...]:
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise bad_request("batched prompts (several prompts in one request) are not supported", "prompt")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        return value
    if isinstance(value, list):
        return _token_ids(value, "prompt", vocab_size)
    raise bad_request("'prompt' must be a string, a list of token ids, or a list of one of those", "prompt")


def _stop(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


def _check_unicode(value, param: str) -> None:
    """Strings (also in a list) must encode as UTF-8: JSON allows a lone surrogate escape."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                raise bad_request(f"'{param}' is not valid Unicode (a lone surrogate?)", param) from None


# Fields that would change the output if honoured: a value other than their neutral one is
# refused rather than silently ignored.
NEUTRAL = {"n": (1,), "best_of": (1,), "frequency_penalty": (0,), "presence_penalty": (0,),
           "repetition_penalty": (1,), "top_k": (0, -1), "min_tokens": (0,), "min_p": (0,),
           "logit_bias": ({},), "suffix": ("",)}


def _reject_unsupported(body: dict) -> None:
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or value not in neutral):
            raise bad_request(f"'{key}' is not supported (only {neutral[0]!r})", key)
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo")
    if body.get("logprobs") is not None:
        raise bad_request("'logprobs' is not supported", "logprobs")


def load_body(raw: bytes) -> dict:
    """The JSON object of a request body. Raises ApiError(400)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def check_model(body: dict, served_name: str) -> str:
    """The requested model name; absent means the served one, another name is a 404."""
    model = _opt(body, "model", (str,), "a string", served_name)
    if model != served_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error",
                       "model_not_found", "model")
    return model


def generation_fields(body: dict, vocab_size: int, max_tokens_key: str = "max_tokens") -> dict:
    """The CompletionRequest fields both endpoints share (sampling, stopping, streaming,
    tenant, extensions), validated. `max_tokens_key`: the field that holds max_tokens."""
    max_tokens = _opt(body, max_tokens_key, (int, float), "a positive integer")
    if max_tokens is not None and (max_tokens < 1 or max_tokens != int(max_tokens)):
        raise bad_request(f"'{max_tokens_key}' must be a positive integer", max_tokens_key)
    max_tokens = None if max_tokens is None else int(max_tokens)  # 5.0 is 5, as pydantic reads it
    temperature = float(_opt(body, "temperature", (int, float), "a number", 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("'temperature' must be in [0, 2]", "temperature")
    top_p = float(_opt(body, "top_p", (int, float), "a number", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    stream_options = _opt(body, "stream_options", (dict,), "an object", {})
    if stream_options and not body.get("stream"):
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    seed, priority = _int64(body, "seed", None), _int64(body, "priority", 0)
    stop_ids = _opt(body, "stop_token_ids", (list,), "a list of token ids", [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    user = body.get("user")
    if isinstance(user, str) and len(user) > MAX_USER_CHARS:
        raise bad_request(f"'user' (the tenant) takes at most {MAX_USER_CHARS} characters", "user")
    for key in ("user", "stop"):
        _check_unicode(body.get(key), key)
    slo_tier = _opt(body, "slo_tier", (str,), "a string")
    if slo_tier is not None and not SLO_TIER_RE.fullmatch(slo_tier):
        raise bad_request("'slo_tier' must be 1-32 characters of letters, digits, '_', '.' or '-'", "slo_tier")
    return dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=_stop(body["stop"]) if body.get("stop") is not None else (),
        stop_token_ids=_token_ids(stop_ids, "stop_token_ids", vocab_size) if stop_ids else (),
        stream=_opt(body, "stream", (bool,), "a boolean", False),
        include_usage=_opt(stream_options, "include_usage", (bool,), "a boolean", False),
        tenant=_opt(body, "user", (str,), "a string", "default") or "default",
        ignore_eos=_opt(body, "ignore_eos", (bool,), "a boolean", False),
        priority=priority,
        return_token_ids=_opt(body, "return_token_ids", (bool,), "a boolean", False),
        slo_tier=slo_tier or "",
    )


def parse_completion_request(raw: bytes, served_name: str, vocab_size: int) -> CompletionRequest:
    """Decode and validate a request body. Raises ApiError (400, or 404 for an unknown model).
    Length checks against the model need the token count: see `check_lengths`."""
    body = load_body(raw)
    model = check_model(body, served_name)
    if body.get("prompt") is None:
        raise bad_request("'prompt' is required", "prompt")
    _reject_unsupported(body)
    fields = generation_fields(body, vocab_size)
    _check_unicode(body.get("prompt"), "prompt")
    return CompletionRequest(model=model, prompt=_prompt(body["prompt"], vocab_size), **fields)


def check_lengths(req: CompletionRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """Validate the prompt length and return the effective max_tokens. Raises ApiError(400)."""
    if num_prompt_tokens == 0:
        raise bad_request("prompt must not be empty (it tokenizes to no tokens)", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{num_prompt_tokens} tokens, which leaves no room for output.", "prompt")
    if req.max_tokens is None:  # chat: the rest of the context, as vLLM (a reply is not cut at 16)
        default = max_model_len - num_prompt_tokens if not isinstance(req.prompt, (str, tuple)) else DEFAULT_MAX_TOKENS
        return min(default, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + req.max_tokens > max_model_len:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you "
                          f"requested {num_prompt_tokens + req.max_tokens} tokens ({num_prompt_tokens} in the "
                          f"prompt, {req.max_tokens} for the completion).", "max_tokens")
    return req.max_tokens


def completion_body(*, request_id: str, created: int, model: str, choice: dict,
                    usage: dict | None = None, extra: dict | None = None, stream: bool = False,
                    usage_key: bool = False, object_name: str = "text_completion") -> dict:
    """One response (stream=False) or one SSE chunk (stream=True) in OpenAI's text_completion
    shape (or chat.completion[.chunk], by `object_name`). A chunk carries `usage` when it has
    one, or as null when the client asked for usage (`usage_key`: OpenAI's chunks then all
    have the key, null but on the last)."""
    body = {"id": request_id, "object": object_name, "created": created, "model": model,
            "choices": [choice] if choice else [], "system_fingerprint": None}
    if usage is not None or not stream or usage_key:
        body["usage"] = usage
    body.update(extra or {})
    return body


def choice_body(text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None, stop_reason: str | int | None = None) -> dict:
    """choices[0]; token ids are added only when the client asked for them. `stop_reason`
    (vLLM's field): the stop string or stop token id that ended the output, else null."""
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_token_ids is not None:
        c["prompt_token_ids"] = prompt_token_ids
    return c


def usage_body(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """`usage`. `prompt_tokens_details.cached_tokens`: prompt tokens whose KV came from the
    prefix cache (not computed for this request). vLLM sends the object only with
    --enable-prompt-tokens-details (else null); the nodes always know the figure, so it is
    always here, 0 with the cache off."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
