"""A request's prompt as token ids: ids, text, or a conversation rendered then tokenized (long ones
in a thread).

A request's prompt as token ids: token ids as given, a text tokenized, or a conversation
rendered by the model's chat template and then tokenized.

A text that cannot fit the context is refused before tokenizing, long texts are tokenized in a
thread (a 3 MB prompt takes 3 s on the event loop, long enough for the router to miss node pings
and fail other clients' requests), and every conversation is rendered in a thread, bounded in
time and in output size. A chat template writes its own
special tokens (BOS), so its text is tokenized without adding any, as vLLM does.
"""
from __future__ import annotations

import asyncio
import time

from pdtb.router.chat_api import ChatPrompt
from pdtb.router.chat_template import ChatTemplateError
from pdtb.router.config import ServedModel
from pdtb.router.openai_api import bad_request

THREAD_CHARS = 16_384  # longer texts are tokenized off the event loop (conversations always render off it)
RENDER_TIMEOUT_S = 5.0  # a chat template that renders longer than this is the request's 400


async def prompt_ids_of(model: ServedModel, prompt) -> list[int]:
    """Token ids of a CompletionRequest's prompt. Raises ApiError(400)."""
    if isinstance(prompt, ChatPrompt):
        return await _encode(model, await _render(model, prompt), add_special_tokens=False)
    if isinstance(prompt, str):
        return await _encode(model, prompt, add_special_tokens=True)
    return list(prompt)


def _too_long(model: ServedModel, chars: int) -> bool:
    limit = model.max_prompt_chars
    return limit is not None and chars > limit


async def _render(model: ServedModel, prompt: ChatPrompt) -> str:
    """The conversation's prompt text, by the model's chat template."""
    if model.chat_template is None:
        raise bad_request(f"the model `{model.name}` has no chat template; start the router with "
                          "--chat-template FILE to serve /v1/chat/completions", "messages")
    chars = sum(len(m["content"]) for m in prompt.messages)
    if _too_long(model, chars):
        raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens; the messages "
                          f"have {chars} characters, more than that many tokens can hold.", "messages")

    deadline = time.monotonic() + RENDER_TIMEOUT_S

    def render() -> str:
        return model.chat_template.render(list(prompt.messages), prompt.add_generation_prompt,
                                          dict(prompt.template_kwargs), model.max_prompt_chars, deadline)
    try:  # always off the loop: a template is a program, and some are slow
        return await asyncio.wait_for(asyncio.to_thread(render), RENDER_TIMEOUT_S + 1.0)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    except asyncio.TimeoutError:
        raise bad_request("the chat template took too long on this conversation", "messages") from None


async def _encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; a text too long to fit is refused before tokenizing."""
    if _too_long(model, len(text)):
        raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens; the prompt "
                          f"has {len(text)} characters, more than that many tokens can hold "
                          f"(at most {model.max_token_chars} characters a token).", "prompt")

    def encode() -> list[int]:
        return list(model.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    return await asyncio.to_thread(encode) if len(text) > THREAD_CHARS else encode()
