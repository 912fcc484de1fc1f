"""Request models and their translation into SamplingParams / GenerateRequests; a fuzz test that no
JSON body makes the app answer 500."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cluster.request import SamplingParams
from router.app import create_app
from router.errors import APIError
from router.openai.request import INT64_MAX, ChatCompletionRequest, CompletionRequest
from router.params import build_sampling, clamp_max_tokens, make_requests, seeded
from tests.router_fakes import MODEL, FakeEngine, load_tokenizer


@pytest.mark.parametrize("value,expected", [(0, 0), (7, 7), (7.0, 7), (1e18, 10**18), (2**80, 2**80),
                                            (None, None)])
def test_max_tokens_accepts_integral_numbers(value, expected):
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": value}).max_tokens == expected


@pytest.mark.parametrize("value", [-1, 1.5, float("inf"), float("nan"), True, "10", [1], {}])
def test_max_tokens_rejects_the_rest(value):
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": value})
    assert exc.value.errors()[0]["loc"] == ("max_tokens",)


@pytest.mark.parametrize("prompt,expected", [("abc", "abc"), ([1, 2], [1, 2]), (["abc"], "abc"), ([[3]], [3])])
def test_prompt_shapes(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == expected


def test_chat_content_parts_and_defaults():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}], "extra": 1, "max_completion_tokens": 9, "max_tokens": 3})
    assert req.messages[0].content == "a\nb" and req.messages[1].content is None
    assert req.requested_max_tokens == 9 and req.n is None and not req.include_usage
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                                "stream_options": {"include_usage": True}})
    assert req.include_usage and req.requested_max_tokens is None


def test_clamp_max_tokens():
    assert clamp_max_tokens(None, 10, 100) == 90
    assert clamp_max_tokens(10**18, 10, 100) == 90
    assert clamp_max_tokens(5, 10, 100) == 5
    for n in (100, 101):
        with pytest.raises(APIError) as exc:
            clamp_max_tokens(5, n, 100)
        assert exc.value.status == 400 and str(n) in exc.value.message and "100" in exc.value.message


def test_seeds_per_choice_and_request_ids():
    sp = SamplingParams(seed=INT64_MAX - 1, temperature=1.0)
    assert [seeded(sp, i).seed for i in range(3)] == [INT64_MAX - 1, INT64_MAX, -(2**63)]
    assert seeded(SamplingParams(), 5).seed is None
    reqs = make_requests("cmpl-x", [1, 2], SamplingParams(seed=3), 2, "salt", 12.5)
    assert [(r.request_id, r.sampling.seed, r.cache_salt, r.arrival_time) for r in reqs] == [
        ("cmpl-x-0", 3, "salt", 12.5), ("cmpl-x-1", 4, "salt", 12.5)]


def test_build_sampling_names_the_field():
    tok = load_tokenizer()
    req = CompletionRequest.model_validate({"prompt": "x", "min_p": 1.5})
    with pytest.raises(APIError) as exc:
        build_sampling(req, max_tokens=4, logprobs=None, prompt_logprobs=None, tok=tok)
    assert exc.value.status == 400 and exc.value.param == "min_p" and "min_p" in exc.value.message


# ------------------------------------------------------------------------------------------ fuzz

_json = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=6)
_fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs",
           "top_logprobs", "echo", "logit_bias", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "user", "cache_salt"]
_num = st.floats(-3, 3) | st.integers(-3, 3)
_good = {"model": st.just(MODEL), "prompt": st.sampled_from(["hi", [1, 2, 3], ["x"], [[4]]]),
         "messages": st.just([{"role": "user", "content": "hi"}]),
         "max_tokens": st.integers(0, 10**20) | st.floats(0, 1e20), "max_completion_tokens": st.integers(0, 99),
         "n": st.integers(0, 4), "stream": st.booleans(), "echo": st.booleans(), "ignore_eos": st.booleans(),
         "temperature": _num, "top_p": _num, "top_k": st.integers(-2, 70000), "min_p": _num,
         "presence_penalty": _num, "frequency_penalty": _num, "repetition_penalty": _num,
         "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
         "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
         "logprobs": st.integers(-1, 21) | st.booleans(), "top_logprobs": st.integers(-1, 21),
         "seed": st.integers(-(2**64), 2**64), "stop_token_ids": st.lists(st.integers(-5, 60000), max_size=2),
         "logit_bias": st.dictionaries(st.sampled_from(["1", "-1", "70000", "x"]), st.floats(-200, 200), max_size=2)}
# mostly plausible values (so requests get past validation and reach the engine), sometimes any JSON
_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": _good["prompt"], "messages": _good["messages"]},
    optional={f: st.one_of(_good.get(f, _json), _good.get(f, _json), _json) for f in _fields
              if f not in ("model", "prompt", "messages")})


@pytest.fixture(scope="module")
def fuzz_client():
    tok = load_tokenizer()
    with TestClient(create_app(FakeEngine(tok, max_model_len=64), tok, served_model_names=[MODEL])) as c:
        yield c


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_body, chat=st.booleans())
def test_no_body_gives_a_500(fuzz_client, body, chat):
    r = fuzz_client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert r.status_code in (200, 400, 404), r.text  # TestClient also re-raises any app exception
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
