"""Incremental detokenisation and stop strings.

IncrementalDetokenizer emits text that never splits a multi-byte character: the pieces it
returns, concatenated, equal `tokenizer.decode(all_ids, skip_special_tokens=True)`.

    ids:  [ ... emitted ... | prefix_offset ... read_offset | new ids ]
    prefix_text = decode(ids[prefix_offset:read_offset])     (already emitted; context)
    full_text   = decode(ids[prefix_offset:])
    emit full_text[len(prefix_text):] unless it ends with U+FFFD (an incomplete character)

Decoding a short window instead of the whole output keeps each step O(window). If a tokenizer
breaks the window's prefix property, that step falls back to decoding the whole output.

StopMatcher holds back a tail of the text that could begin a stop string (at most the longest
stop - 1 characters), so a stop string that straddles two steps is still cut out: text is
truncated before the first match (OpenAI semantics).
"""
from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces that concatenate to the full decode."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # emitted so far
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if full.endswith(REPLACEMENT):
            return ""
        if full.startswith(prefix):
            new = full[len(prefix):]
        else:  # window lost its prefix property (tokenizer clean-ups): decode everything
            whole = self._decode(self.token_ids)
            if not whole.startswith(self.text):
                return ""  # cannot retract text already sent; wait for the flush
            new = whole[len(self.text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end: return whatever is still held back (e.g. an incomplete character)."""
        whole = self._decode(self.token_ids)
        rest = whole[len(self.text):] if whole.startswith(self.text) else ""
        self.text += rest
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return rest


class StopMatcher:
    """Cuts a text stream before the first occurrence of any stop string."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # received, not yet released
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add text; return what can be released. Sets `stopped` when a stop string matched."""
        if self.stopped:
            return ""
        if not self._stops:  # nothing to hold back
            return text
        self._pending += text
        hits = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])  # the earliest match (first listed on a tie)
            out, self._pending, self.stopped = self._pending[:at], "", True
            return out
        keep = self._partial_match_len()
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out

    def _partial_match_len(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        for k in range(min(self._holdback, len(self._pending)), 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """At the end: release the held-back tail (it holds no complete stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


@dataclass
class TextDelta:
    """Text released by one step of the output."""

    text: str
    stopped: bool  # a stop string matched: the output ends here with finish_reason "stop"


class OutputText:
    """Detokenizer and stop matcher for one request's output."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stops)

    @property
    def token_ids(self) -> list[int]:
        return self.detok.token_ids

    def add(self, token_ids: list[int]) -> TextDelta:
        """Add the tokens of one event."""
        text = self.stops.feed(self.detok.push(token_ids))
        return TextDelta(text, self.stops.stopped)

    def finish(self) -> TextDelta:
        """The node finished the request: release everything still held back."""
        text = self.stops.feed(self.detok.flush())
        if not self.stops.stopped:
            text += self.stops.flush()
        return TextDelta(text, self.stops.stopped)
