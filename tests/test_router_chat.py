"""/v1/chat/completions: template rendering against transformers, request validation, and the
chat response shapes through the real router (fake nodes) with the openai client."""
from __future__ import annotations

import json

import pytest

from router.chat_api import ChatPrompt, parse_chat_request
from router.chat_template import ChatTemplate, ChatTemplateError, find_chat_template_source, load_chat_template
from router.openai_api import ApiError
from test_router_integration import TEXT, cluster, reference, run, served, tokens  # noqa: F401 (fixtures)

NAME, VOCAB = "tiny", 512

# A template in the style of real checkpoints (a default system turn, loop variables, a
# namespace, tojson, raise_exception on roles that do not alternate), written for this test.
RICH_TEMPLATE = """{%- set ns = namespace(turn=0) -%}
{%- if messages[0]['role'] != 'system' -%}
{{ bos_token }}<|system|>
You are terse.{{ eos_token }}
{% else %}{{ bos_token }}{% endif -%}
{%- for message in messages -%}
{%- if message['role'] in ['user', 'assistant'] -%}
{%- if (message['role'] == 'user') != (ns.turn % 2 == 0) -%}
{{ raise_exception('roles must alternate user/assistant') }}
{%- endif -%}
{%- set ns.turn = ns.turn + 1 -%}
{%- endif -%}
<|{{ message['role'] }}|>{% if message.name is defined %} {{ message.name | tojson }}{% endif %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}{{ eos_token }}{{ '\\n' if not loop.last else '' }}
{%- endfor -%}
{%- if add_generation_prompt %}
<|assistant|>
{% endif -%}"""

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT},
     {"role": "assistant", "content": "  ok  "}, {"role": "user", "content": "again\nplease", "name": "bob \"b\" 'c' <d> & é"}],
    [{"role": "user", "content": ""}],
]


def hf_render(model_dir, messages, template=None, add_generation_prompt=True) -> str:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [None, RICH_TEMPLATE])
@pytest.mark.parametrize("agp", [True, False])
def test_rendering_equals_transformers(llama_dir, template, agp):
    """The router's Jinja rendering against transformers' apply_chat_template: the embedded
    model's own template and a richer one, every conversation, with and without the
    generation prompt."""
    ours = load_chat_template(llama_dir, template)
    for messages in CONVERSATIONS:
        assert ours.render(messages, agp) == hf_render(llama_dir, messages, template, agp)


def test_template_errors():
    t = ChatTemplate(RICH_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate("{{ messages[5]['content'] }}").render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses to reach into Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_where_the_template_comes_from(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    assert find_chat_template_source(d) is None
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert find_chat_template_source(d) == "D"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "C", "eos_token": {"content": "</s>"}}))
    assert find_chat_template_source(d) == "C"
    assert load_chat_template(d).special_tokens == {"eos_token": "</s>"}
    (d / "chat_template.jinja").write_text("J")
    assert find_chat_template_source(d) == "J"
    f = tmp_path / "mine.jinja"
    f.write_text("F")
    assert find_chat_template_source(d, str(f)) == "F"
    assert find_chat_template_source(d, "{{ messages }}") == "{{ messages }}"
    with pytest.raises(ChatTemplateError, match="no such file"):
        find_chat_template_source(d, str(tmp_path / "missing.jinja"))


def parse(body):
    return parse_chat_request(json.dumps(body).encode(), NAME, VOCAB)


def test_parse_fields():
    r = parse({"messages": [{"role": "system", "content": "s"},
                            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                            {"role": "assistant", "content": None}],
               "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, "user": "alice", "add_generation_prompt": False,
               "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False})
    assert r.prompt == ChatPrompt(({"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"},
                                   {"role": "assistant", "content": ""}), add_generation_prompt=False)
    assert (r.max_tokens, r.temperature, r.stream, r.include_usage, r.tenant) == (7, 0.0, True, True, "alice")
    assert parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}).max_tokens == 3


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, "frequency_penalty"),
])
def test_parse_errors(body, param):
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse({"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert info.value.status == 404


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Prefill runs the prompt"}]


def test_chat_through_the_router(llama_dir, served, tokens):
    """Non-streaming and streaming chat through the router and fake disaggregated nodes: the
    prompt ids are the tokenizer's ids of transformers' rendering, the reply is the tokens the
    nodes sent, the shapes are chat.completion[.chunk] with the role first."""
    prompt_ids = served.tokenizer(hf_render(llama_dir, MESSAGES), add_special_tokens=False)["input_ids"]
    ids, want = reference(served, tokens, prompt_ids, 11)
    extra = {"return_token_ids": True, "ignore_eos": True}

    async def go():
        async with cluster(served, tokens) as c:
            client = c.client()
            r = await client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=11,
                                                     temperature=0, extra_body=extra)
            assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
            assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
            assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["token_ids"] == ids
            assert r.model_extra["prompt_token_ids"] == prompt_ids
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 11)
            chunks = [ch async for ch in await client.chat.completions.create(
                model=NAME, messages=MESSAGES, max_tokens=11, stream=True, stream_options={"include_usage": True},
                extra_body=extra)]
            assert all(ch.object == "chat.completion.chunk" for ch in chunks)
            body, usage = chunks[:-1], chunks[-1]
            assert body[0].choices[0].delta.role == "assistant" and body[0].choices[0].delta.content == ""
            assert body[0].model_extra["prompt_token_ids"] == prompt_ids
            assert "".join(ch.choices[0].delta.content or "" for ch in body) == want
            assert sum((ch.choices[0].model_extra.get("token_ids") or [] for ch in body), []) == ids
            assert body[-1].choices[0].finish_reason == "length"
            assert usage.choices == [] and usage.usage.completion_tokens == 11
            # the template's refusal is the client's error, and nothing reaches a node
            n_before = len(c.nodes["prefill"].requests)
            with pytest.raises(Exception) as info:
                await client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "x"}])
            assert getattr(info.value, "status_code", None) == 400
            assert len(c.nodes["prefill"].requests) == n_before

    run(go())


def test_a_model_without_a_template_refuses_chat(served, tokens):
    import dataclasses

    bare = dataclasses.replace(served, chat_template=None)

    async def go():
        async with cluster(bare, tokens) as c:
            with pytest.raises(Exception) as info:
                await c.client().chat.completions.create(model=NAME, messages=MESSAGES)
            assert getattr(info.value, "status_code", None) == 400 and "--chat-template" in str(info.value)

    run(go())
