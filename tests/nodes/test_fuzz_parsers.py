"""Fuzzing the untrusted-input parsers: the HTTP request body parser and the control-plane
message decoder. Whatever the bytes, the answer is a typed error or a valid value, never a
crash (the wire decoder of the KV transport is fuzzed in tests/transport/test_transport_wire.py)."""
from __future__ import annotations

import json

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from pdtb.nodes.protocol import MESSAGES, ProtocolError, decode_message
from pdtb.router.chat_api import ChatPrompt, parse_chat_request
from pdtb.router.openai_api import ApiError, CompletionRequest, parse_completion_request

VOCAB = 512
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                           | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                           max_leaves=20)
MSGPACK_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
                              | st.text(max_size=20) | st.binary(max_size=10),
                              lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
                              max_leaves=20)
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "user", "ignore_eos", "priority", "return_token_ids", "n", "echo", "logprobs", "extra_field"]


def _check_parse(raw: bytes, parser=parse_completion_request) -> None:
    try:
        req = parser(raw, "tiny", VOCAB)
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert isinstance(req, CompletionRequest)
    assert req.max_tokens is None or req.max_tokens >= 1  # None: the default, fitted to the prompt later
    if isinstance(req.prompt, ChatPrompt):
        assert req.prompt.messages and all(isinstance(m["content"], str) for m in req.prompt.messages)
    elif not isinstance(req.prompt, str):
        assert all(0 <= t < VOCAB for t in req.prompt)


def test_a_body_without_max_tokens_parses():
    assert parse_completion_request(b'{"prompt": "x"}', "tiny", VOCAB).max_tokens is None
    _check_parse(b'{"prompt": "x"}')


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8))
def test_completion_parser_on_arbitrary_json_objects(body):
    _check_parse(json.dumps(body).encode())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_completion_parser_on_arbitrary_bytes(raw):
    _check_parse(raw)


MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]),
                          st.sampled_from(["user", "system", "assistant", "robot"]) | JSON_VALUES, max_size=4)
CHAT_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "stop", "stream", "tools",
               "response_format", "add_generation_prompt", "logprobs", "n", "user"]


@settings(max_examples=300, deadline=None)
@given(st.lists(MESSAGE, max_size=4) | JSON_VALUES,
       st.dictionaries(st.sampled_from(CHAT_FIELDS), JSON_VALUES, max_size=6))
def test_chat_parser_on_arbitrary_json_objects(messages, body):
    _check_parse(json.dumps({**body, "messages": messages}).encode(), parse_chat_request)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(MESSAGES)), st.dictionaries(st.text(max_size=12), MSGPACK_VALUES, max_size=8),
       st.sampled_from([1, 1, 1, 2, "1", None]))
def test_control_decoder_on_arbitrary_maps(kind, fields, version):
    raw = msgpack.packb({**fields, "type": kind, "v": version}, use_bin_type=True)
    try:
        msg = decode_message(raw)
    except ProtocolError as e:
        assert str(e)
        return
    assert type(msg).__name__ == kind


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_control_decoder_on_arbitrary_bytes(raw):
    try:
        decode_message(raw)
    except ProtocolError:
        pass
