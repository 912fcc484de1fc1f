"""The official `openai` client against the router served by uvicorn on a free 127.0.0.1 port."""

from __future__ import annotations

import openai
import pytest

from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, ServerThread, load_tokenizer


@pytest.fixture(scope="module")
def server():
    tok = load_tokenizer()
    engine = FakeEngine(tok)
    with ServerThread(create_app(engine, tok, served_model_names=[MODEL], api_key="k-123")) as s:
        s.engine = engine
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k-123", max_retries=0, timeout=10)


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 5
    assert len(choice.logprobs.content) == 5 and len(choice.logprobs.content[0].top_logprobs) == 2
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("length") == 1


def test_completions_and_stream(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=1, echo=True)
    assert r.choices[0].text.startswith("Once upon a time") and r.usage.completion_tokens == 4
    assert r.choices[0].logprobs.token_logprobs[0] is None
    parts = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True)]
    assert "".join(parts) == r.choices[0].text[len("Once upon a time"):]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_errors(client, server):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=-1)
    assert exc.value.body["param"] == "temperature" and "temperature" in exc.value.message
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1).choices[0].message.content
