"""/v1/chat/completions: template rendering against transformers, request validation, and the
chat response shapes through the real router (fake nodes) with the openai client."""
from __future__ import annotations

import json

import pytest

from pdtb.router.chat_api import ChatPrompt, parse_chat_request
from pdtb.router.chat_template import ChatTemplate, ChatTemplateError, find_chat_template_source, load_chat_template
from pdtb.router.openai_api import ApiError
from tests.router.test_router_integration import TEXT, cluster, reference, run, served, tokens  # noqa: F401 (fixtures)

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
    assert r.prompt == ChatPrompt(({"role": "system", "content": "s"},
                                   {"role": "user", "content": "a\nb", "parts": ["a", "b"]},
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
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "max_tokens": "x"}, "max_tokens"),
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


PARTS_TEMPLATE = """{% for message in messages %}<|{{ message['role'] }}|>
{% for part in message['content'] %}{% if part['type'] == 'text' %}[{{ part['text'] }}]{% endif %}{% endfor %}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}"""
THINK_TEMPLATE = """{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}
{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""


def test_templates_that_loop_over_parts_get_parts(llama_dir):
    """A template iterating message content gets OpenAI's list of text parts (a string would
    be walked character by character), as transformers renders the same list."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                      {"type": "text", "text": "this"}]},
                         {"role": "assistant", "content": "ok"}]}
    prompt = parse(body).prompt
    ours = load_chat_template(llama_dir, PARTS_TEMPLATE).render(list(prompt.messages), True)
    theirs = body["messages"][:1] + [{"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]
    assert ours == hf_render(llama_dir, theirs, PARTS_TEMPLATE) and "[Describe][this]" in ours


def test_chat_template_kwargs_reach_the_template(llama_dir):
    import transformers

    prompt = parse({"messages": [{"role": "user", "content": "hi"}],
                    "chat_template_kwargs": {"enable_thinking": False}}).prompt
    ours = load_chat_template(llama_dir, THINK_TEMPLATE).render(list(prompt.messages), True, dict(prompt.template_kwargs))
    tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    theirs = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=THINK_TEMPLATE, tokenize=False,
                                     add_generation_prompt=True, enable_thinking=False)
    assert ours == theirs and ours.endswith("<think></think>")
    for bad in ({"messages": 1}, [1], {"1x": 2}):
        with pytest.raises(ApiError):
            parse({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": bad})


def test_special_tokens_also_come_from_the_older_special_tokens_map(llama_dir, tmp_path):
    """Checkpoints that keep their special tokens in special_tokens_map.json render as
    transformers renders them (the BOS/EOS of the embedded template must not go missing)."""
    import shutil

    d = tmp_path / "legacy"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("bos_token", "eos_token", "pad_token")}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "special_tokens_map.json").write_text(json.dumps({**moved, "sep_token": "<|pad|>"}))
    template = "{{ bos_token }}{{ sep_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    ours = load_chat_template(d, template)
    assert ours.special_tokens["bos_token"] == "<|bos|>" and ours.special_tokens["sep_token"] == "<|pad|>"
    assert ours.render([{"role": "user", "content": "hi"}]) == hf_render(d, [{"role": "user", "content": "hi"}],
                                                                          template)


def test_rendering_is_bounded_and_every_template_failure_is_the_requests_error():
    import time

    big = ChatTemplate("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}")
    with pytest.raises(ChatTemplateError, match="characters"):
        big.render([], max_chars=1000)
    with pytest.raises(ChatTemplateError, match="too long"):
        big.render([], deadline=time.monotonic() - 1)
    for source in ("{{ 1 / 0 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                   "{% for i in range(10**9) %}{% endfor %}"):
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render([])


def test_chat_without_max_tokens_may_use_the_rest_of_the_context():
    from pdtb.router.openai_api import check_lengths, parse_completion_request

    chat = parse({"messages": [{"role": "user", "content": "hi"}]})
    assert check_lengths(chat, 10, 64) == 54  # vLLM's chat default, not /v1/completions' 16
    text = parse_completion_request(b'{"prompt": "hi"}', NAME, VOCAB)
    assert check_lengths(text, 10, 64) == 16


def test_a_large_body_is_parsed_off_the_loop_with_the_same_answers(served, tokens):
    """Bodies over a MiB go through the same parser in a thread: a valid one is served, a bad
    one is the same 400."""
    import aiohttp

    many = [{"type": "text", "text": "a"} for _ in range(60_000)]  # about 1.9 MB of JSON
    good = {"messages": [{"role": "user", "content": many}], "max_tokens": 2}
    bad = {"messages": [{"role": "user", "content": many + [{"type": "image_url"}]}], "max_tokens": 2}

    async def go():
        async with cluster(served, tokens, mode="colocated") as c:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
                async with s.post(c.url + "/v1/chat/completions", json=bad) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "messages[0].content"
                async with s.post(c.url + "/v1/chat/completions", json=good) as r:
                    body = await r.json()
                    assert r.status == 400 and "context" in body["error"]["message"]  # 60,000 parts: too long
                small = {"messages": [{"role": "user", "content": many[:50]}], "max_tokens": 2,
                         "padding_field": "x" * 1_200_000}  # large, but a valid request (unknown fields are ignored)
                async with s.post(c.url + "/v1/chat/completions", json=small) as r:
                    assert r.status == 200, await r.text()

    run(go())
