"""The OpenAI API of a real server, through the `openai` package."""

import json

import openai
import pytest
import requests

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client, base_url):
    models = client.models.list().data
    assert len(models) == 1
    info = requests.get(base_url + "/get_model_info").json()
    assert info["model_path"].endswith(".gguf") and models[0].root == info["model_path"]


def test_chat_plain(client):
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_streaming_equals_plain(client):
    kw = dict(model="default", messages=QUESTION, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_n2_and_seed(client):
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=6, temperature=1.0,
                                       n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 12  # counted over both choices
    again = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=6, temperature=1.0,
                                           n=2, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the most likely
        assert bytes(t.bytes).decode() == t.token


def test_completion_logprobs_and_n2_stream(client):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 3
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
    stream = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                       temperature=0, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [r.choices[0].text] * 2


def test_usage_cached_tokens_on_repeated_prompt(client):
    messages = [{"role": "system", "content": "You answer tersely. Session 8841."}] + QUESTION
    first = client.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="default", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    # Everything but the last prompt token comes from the radix cache.
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_response_format_json_schema_and_regex(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = client.completions.create(model="default", prompt="Is the sky blue?", max_tokens=4, temperature=0,
                                  extra_body={"regex": "(yes|no)"})
    assert r.choices[0].text in ("yes", "no")


def test_stop_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="default", messages=QUESTION, max_completion_tokens=12,
                                       temperature=0, stop=["France"])
    assert r.choices[0].message.content == "The capital of "
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="default", messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_errors_have_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=QUESTION, max_tokens=2, top_p=1.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"
    assert "top_p" in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"
