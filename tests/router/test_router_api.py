"""Router request parsing and validation: every bad input gets the right status and error shape."""
from __future__ import annotations

import json

import pytest

from pdtb.router.config import NodeSpec, RouterConfig
from pdtb.router.openai_api import ApiError, check_lengths, parse_completion_request

NAME, VOCAB, MAX_LEN = "tiny", 512, 64


def parse(body) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_completion_request(raw, NAME, VOCAB)


def error_of(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert set(err.body()["error"]) == {"message", "type", "code", "param"}
    assert err.body()["error"]["message"]
    return err


def test_defaults_and_all_fields():
    r = parse({"model": NAME, "prompt": "hi"})
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.stream, r.tenant) == ("hi", None, 1.0, 1.0, False, "default")
    r = parse({"model": NAME, "prompt": [[1, 2, 3]], "max_tokens": 5, "temperature": 0, "top_p": 0.5,
               "seed": 7, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
               "user": "alice", "ignore_eos": True, "priority": -2, "return_token_ids": True,
               "stop_token_ids": [4], "frequency_penalty": 0.0, "some_future_field": {"x": 1}})
    assert r.prompt == (1, 2, 3) and r.max_tokens == 5 and r.temperature == 0.0 and r.top_p == 0.5
    assert r.seed == 7 and r.stop == ("\n",) and r.stream and r.include_usage and r.tenant == "alice"
    assert r.ignore_eos and r.priority == -2 and r.return_token_ids and r.stop_token_ids == (4,)
    r = parse({"model": NAME, "prompt": "hi", "max_tokens": 2.0, "seed": 7.0, "priority": -1.0})
    assert (r.max_tokens, r.seed, r.priority) == (2, 7, -1) and type(r.seed) is int  # integers, as pydantic reads them


def test_prompt_forms():
    assert parse({"model": NAME, "prompt": ["one string"]}).prompt == "one string"
    assert parse({"model": NAME, "prompt": [5, 6]}).prompt == (5, 6)
    assert parse({"prompt": "no model given"}).model == NAME  # as vLLM: the served model


def test_nulls_mean_absent():
    r = parse({"model": NAME, "prompt": "x", "max_tokens": None, "temperature": None, "stop": None,
               "user": None, "stream_options": None, "n": None, "logprobs": None})
    assert r.max_tokens is None and r.temperature == 1.0 and r.stop == () and r.tenant == "default"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"\xff\xfe", None),
    (b"[1, 2]", None),
    (b'"a string"', None),
    ({"model": NAME}, "prompt"),
    ({"model": NAME, "prompt": ""}, "prompt"),
    ({"model": NAME, "prompt": []}, "prompt"),
    ({"model": NAME, "prompt": [[]]}, "prompt"),
    ({"model": NAME, "prompt": ["a", "b"]}, "prompt"),  # batches are not supported yet
    ({"model": NAME, "prompt": [[1], [2]]}, "prompt"),
    ({"model": NAME, "prompt": 42}, "prompt"),
    ({"model": NAME, "prompt": [1, "a"]}, "prompt"),
    ({"model": NAME, "prompt": [1, True]}, "prompt"),
    ({"model": NAME, "prompt": [1.5]}, "prompt"),
    ({"model": NAME, "prompt": [VOCAB]}, "prompt"),
    ({"model": NAME, "prompt": [-1]}, "prompt"),
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": NAME, "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": NAME, "prompt": "x", "temperature": -0.1}, "temperature"),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "x", "top_p": 1.01}, "top_p"),
    ({"model": NAME, "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": NAME, "prompt": "x", "user": "u" * 257}, "user"),  # a label value in every node's metrics
    ({"model": NAME, "prompt": "x", "seed": 1 << 64}, "seed"),
    ({"model": NAME, "prompt": "x", "priority": -(1 << 70)}, "priority"),
    ({"model": NAME, "prompt": "x", "priority": 1.5}, "priority"),
    ({"model": NAME, "prompt": "x", "priority": 1e300}, "priority"),
    ({"model": NAME, "prompt": "x", "stop": ""}, "stop"),
    ({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": NAME, "prompt": "x", "stop": [1]}, "stop"),
    ({"model": NAME, "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": NAME, "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"model": NAME, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # no stream
    ({"model": NAME, "prompt": "x", "stream_options": []}, "stream_options"),
    ({"model": NAME, "prompt": "x", "user": 5}, "user"),
    ({"model": NAME, "prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"model": NAME, "prompt": "x", "priority": "high"}, "priority"),
    ({"model": NAME, "prompt": "x", "return_token_ids": "true"}, "return_token_ids"),
    ({"model": NAME, "prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"model": NAME, "prompt": "x", "n": 2}, "n"),
    ({"model": NAME, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": NAME, "prompt": "x", "echo": True}, "echo"),
    ({"model": NAME, "prompt": "x", "logprobs": 2}, "logprobs"),
])
def test_bad_bodies_are_400(body, param):
    err = error_of(body)
    assert err.status == 400 and err.type == "invalid_request_error" and err.param == param


def test_nan_is_rejected():
    err = error_of(b'{"model": "tiny", "prompt": "x", "temperature": NaN}')
    assert err.status == 400 and err.param == "temperature"


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "\\ud800 hi"}', "prompt"),  # a lone surrogate: valid JSON, not valid Unicode
    (b'{"prompt": "hi", "user": "\\udfff"}', "user"),
    (b'{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # deeper than json can parse
    (json.dumps({"prompt": "hi", "stop_token_ids": list(range(300))}).encode(), "stop_token_ids"),
])
def test_malformed_strings_depth_and_huge_stop_lists_are_400(raw, param):
    err = error_of(raw)
    assert err.status == 400 and err.param == param


@pytest.mark.parametrize("key,value", [("frequency_penalty", 0.5), ("presence_penalty", -1), ("top_k", 3),
                                       ("min_tokens", 10), ("logit_bias", {"5": -100}), ("suffix", "abc"),
                                       ("repetition_penalty", 1.2), ("min_p", 0.1), ("n", 2)])
def test_output_changing_fields_we_do_not_implement_are_400(key, value):
    err = error_of({"prompt": "x", key: value})
    assert err.status == 400 and err.param == key
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "top_k": -1, "min_tokens": 0, "logit_bias": {},
               "suffix": "", "repetition_penalty": 1.0, "min_p": 0, "n": 1}[key]
    assert parse({"prompt": "x", key: neutral}).prompt == "x"  # the neutral value is fine


def test_an_integral_float_max_tokens_is_that_integer():
    assert parse({"prompt": "x", "max_tokens": 5.0}).max_tokens == 5


def test_stream_chunks_carry_a_null_usage_when_usage_was_asked_for():
    from pdtb.router.openai_api import completion_body

    kw = dict(request_id="r", created=0, model=NAME, choice={"index": 0, "text": "a"}, stream=True)
    assert "usage" not in completion_body(**kw)
    assert completion_body(**kw, usage_key=True)["usage"] is None


def test_usage_reports_cached_prompt_tokens_as_vllm_and_the_openai_client_read_them():
    from openai.types import CompletionUsage

    from pdtb.router.openai_api import usage_body

    # vLLM's usage with --enable-prompt-tokens-details (its streamed chunk drops the null fields)
    assert usage_body(70, 4, 64) == {"prompt_tokens": 70, "completion_tokens": 4, "total_tokens": 74,
                                     "prompt_tokens_details": {"cached_tokens": 64}}
    assert usage_body(5, 1)["prompt_tokens_details"] == {"cached_tokens": 0}  # always there, 0 without a hit
    usage = CompletionUsage.model_validate(json.loads(json.dumps(usage_body(70, 4, 64))))
    assert usage.prompt_tokens_details.cached_tokens == 64 and usage.total_tokens == 74


def test_unknown_model_is_404():
    err = error_of({"model": "gpt-4", "prompt": "x"})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


def test_lengths():
    req = parse({"model": NAME, "prompt": "x", "max_tokens": 10})
    assert check_lengths(req, MAX_LEN - 10, MAX_LEN) == 10
    for n_prompt, param in ((MAX_LEN - 9, "max_tokens"), (MAX_LEN, "prompt"), (MAX_LEN + 5, "prompt"), (0, "prompt")):
        with pytest.raises(ApiError) as info:
            check_lengths(req, n_prompt, MAX_LEN)
        assert info.value.status == 400 and info.value.param == param
    default = parse({"model": NAME, "prompt": "x"})
    assert check_lengths(default, 10, MAX_LEN) == 16
    assert check_lengths(default, MAX_LEN - 3, MAX_LEN) == 3  # the default shrinks to fit


def test_router_config_validation():
    p, d = NodeSpec.parse("prefill=tcp://127.0.0.1:1"), NodeSpec.parse("decode = tcp://127.0.0.1:2")
    assert d == NodeSpec("decode", "tcp://127.0.0.1:2")
    RouterConfig((p, d))
    RouterConfig((NodeSpec("colocated", "tcp://127.0.0.1:3"),))
    for bad in ("prefill", "gpu=tcp://x:1", "prefill=localhost:1"):
        with pytest.raises(ValueError):
            NodeSpec.parse(bad)
    for nodes in ((), (p,), (p, NodeSpec("decode", p.address))):
        with pytest.raises(ValueError):
            RouterConfig(nodes)
    with pytest.raises(ValueError):
        RouterConfig((p, d), request_timeout=0)
