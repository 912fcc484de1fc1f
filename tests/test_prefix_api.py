"""Prefix-cache cases that go through the HTTP API on the real model: the same prompt twice streamed, a
multi-turn chat, echoed prompt logprobs."""

from __future__ import annotations

import httpx
import pytest

from tests.live_server import live_server
from tests.test_api_real import MODEL, post, stream_events

B = 32


@pytest.fixture(scope="module")
def servers():
    with live_server(kv_cache_gb=0.25) as warm, live_server(kv_cache_gb=0.25, enable_prefix_caching=False) as cold:
        yield warm[0], cold[0]


def test_multi_turn_chat_reuses_turn_one(servers):
    warm, cold = servers
    turn1 = [{"role": "user", "content": "Give me three tips for learning to play the guitar."}]
    r1 = post(warm, "/v1/chat/completions", {"model": MODEL, "messages": turn1, "temperature": 0, "max_tokens": 40}).json()
    reply = r1["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Which tip matters most?"}]
    body = {"model": MODEL, "messages": turn2, "temperature": 0, "max_tokens": 16}
    r2 = post(warm, "/v1/chat/completions", body).json()
    c2 = post(cold, "/v1/chat/completions", body).json()
    assert r2["choices"][0]["message"]["content"] == c2["choices"][0]["message"]["content"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (r1["usage"]["prompt_tokens"] // B) * B


def test_same_prompt_twice_streaming_gives_the_same_answer(servers):
    warm, _ = servers
    body = {"model": MODEL, "prompt": "In a quiet village by the sea, an old fisherman " * 3, "temperature": 0,
            "max_tokens": 12, "stream_options": {"include_usage": True}}
    runs = []
    for _ in range(2):
        events = stream_events(warm, "/v1/completions", body)
        runs.append(("".join(e["choices"][0]["text"] for e in events if e["choices"]), events[-1]["usage"]))
    assert runs[0][0] == runs[1][0] and runs[1][0]
    usage = runs[1][1]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"] - 1


def test_echo_prompt_logprobs_equal_cold(servers):
    warm, cold = servers
    _, tokenizer = None, None
    prompt = "The library opened at nine, and the first visitor asked for a book about " * 2
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    post(warm, "/v1/completions", {**body, "echo": False, "logprobs": None})  # cache the prompt first
    got = post(warm, "/v1/completions", body)
    ref = post(cold, "/v1/completions", body)
    assert got.status_code == 200 and ref.status_code == 200, got.text
    g, r = got.json()["choices"][0]["logprobs"], ref.json()["choices"][0]["logprobs"]
    assert g["tokens"] == r["tokens"]
    assert g["token_logprobs"][0] is None
    for a, b in zip(g["token_logprobs"][1:], r["token_logprobs"][1:]):
        assert abs(a - b) < 1e-3
    n_prompt = got.json()["usage"]["prompt_tokens"]
    assert len(g["token_logprobs"]) == n_prompt + 1  # every prompt position, then the generated token


def test_reset_prefix_cache_endpoint(servers):
    warm, _ = servers
    r = httpx.post(warm + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200
