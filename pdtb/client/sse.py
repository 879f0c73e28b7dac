"""Incremental SSE parsing, token counting (completions and chat chunks), `usage`.

Incremental server-sent-events parsing and token counting for `/v1/completions` and
`/v1/chat/completions` chunks.

The parser takes bytes as they come off the socket (any split, `\\n` or `\\r\\n` line ends) and
returns the `data` of every event completed so far; it never buffers more than one event, so a
long line (a chunk echoing a 10k-token prompt) is fine, unlike aiohttp's line reader.
"""
from __future__ import annotations


class SSEParser:
    """Feed bytes, get back the data strings of the events they complete."""

    def __init__(self) -> None:
        self._partial = b""  # an incomplete line
        self._data: list[bytes] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        events = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode())
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (":...") and other fields (event:, id:, retry:) are ignored
        return events

    def close(self) -> list[str]:
        """Events completed by the end of the stream (a last event without its blank line)."""
        return self.feed(b"\n\n") if (self._partial or self._data) else []


def count_tokens(chunk: dict) -> int:
    """Output tokens in one completion or chat chunk: len(token_ids) where the server sent them,
    else one per choice with non-empty text (`text`, or a chat chunk's `delta.content`)."""
    n = 0
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        delta = choice.get("delta")
        if ids is not None:
            n += len(ids)
        elif choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
            n += 1
    return n


def usage_tokens(chunk: dict, key: str = "completion_tokens") -> int | None:
    """`usage.completion_tokens` (or another `key` of usage) of a chunk that carries usage (the
    last one, when the request asked for `stream_options.include_usage`), else None."""
    usage = chunk.get("usage")
    n = usage.get(key) if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def cached_tokens(chunk: dict) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (prompt tokens served from the server's prefix
    cache) of a chunk that carries it, else None (vLLM sends it only with
    --enable-prompt-tokens-details)."""
    usage = chunk.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    return usage_tokens({"usage": details}, "cached_tokens") if isinstance(details, dict) else None


def error_message(chunk: dict) -> str | None:
    """The message of an OpenAI-shaped error object, if the chunk is one."""
    err = chunk.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or err)
    return str(err)
