"""The router's HTTP API over a FakeEngine: answers, counts, errors (invalid and edge-case inputs), auth, health,
metrics."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from cluster.engine_client import EngineError
from router.app import create_app
from tests.router_fakes import MODEL, FakeEngine, chat_body, completion_body, load_tokenizer, parse_sse


@pytest.fixture
def tok():
    return load_tokenizer()


@pytest.fixture
def engine(tok):
    return FakeEngine(tok)


@pytest.fixture
def client(engine, tok):
    app = create_app(engine, tok, served_model_names=[MODEL, "alias"], request_timeout_s=0.5)
    with TestClient(app) as c:  # raises on any unexpected exception inside the app (a 500)
        yield c


def assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_still_serving(client) -> None:
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------------------------ answers


def test_chat_answer_shape_and_usage(client, engine, tok):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    req = engine.submitted[0]
    expected = engine.tokens_for(req)
    assert choice["message"] == {"role": "assistant", "content": tok.decode(expected)}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    _, prompt_ids = tok.render_chat([{"role": "user", "content": "Say hi"}])
    assert list(req.prompt_token_ids) == prompt_ids
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5, "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    assert req.request_id == body["id"] + "-0"


def test_chat_without_max_tokens_gets_the_context_left(client, engine):
    r = client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    req = engine.submitted[0]
    assert req.sampling.max_tokens == engine.max_model_len - len(req.prompt_token_ids)
    assert r.json()["usage"]["completion_tokens"] == req.sampling.max_tokens


def test_completion_defaults_to_16_tokens_and_text_or_token_prompts(client, engine, tok):
    ids = tok.encode("Once upon a time")
    for prompt in ("Once upon a time", ["Once upon a time"], ids, [ids]):
        r = client.post("/v1/completions", json=completion_body(prompt))
        assert r.status_code == 200, r.text
        assert list(engine.submitted[-1].prompt_token_ids) == ids
        assert r.json()["usage"]["completion_tokens"] == 16
        assert r.json()["object"] == "text_completion"


def test_sampling_fields_reach_the_engine(client, engine, tok):
    body = completion_body(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                           frequency_penalty=-0.5, repetition_penalty=1.1, stop=["\n\n", "END"], seed=7,
                           logit_bias={"42": 5}, ignore_eos=True, cache_salt="tenant-a", user="u",
                           some_unknown_field={"x": 1})
    assert client.post("/v1/completions", json=body).status_code == 200
    req = engine.submitted[-1]
    sp = req.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.5, 0.9, 40, 0.05)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sp.stop == ("\n\n", "END") and sp.seed == 7 and sp.logit_bias == ((42, 5.0),)
    assert sp.ignore_eos and sp.stop_token_ids == () and req.cache_salt == "tenant-a"
    client.post("/v1/completions", json=completion_body(stop="END", top_k=-1, temperature=1e-9))
    sp = engine.submitted[-1].sampling
    assert sp.stop == ("END",) and sp.top_k == 0 and sp.greedy
    assert set(tok.eos_token_ids) <= set(sp.stop_token_ids)  # without ignore_eos


def test_max_tokens_0_and_1(client, engine):
    r = client.post("/v1/completions", json=completion_body(max_tokens=0))
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and engine.submitted == []  # no engine call
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=0, stream=True,
                                                            stream_options={"include_usage": True}))
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 0
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]] == [None, "length"]
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=1, logprobs=True))
    body = r.json()
    assert body["usage"]["completion_tokens"] == 1 and len(body["choices"][0]["logprobs"]["content"]) == 1
    assert body["choices"][0]["finish_reason"] == "length"
    assert_still_serving(client)


@pytest.mark.parametrize("value", [100000000, 2147483647, 10**18, "1e18"])
def test_huge_max_tokens_is_clamped_to_the_context(client, engine, value):
    raw = json.dumps(completion_body()).replace('"Once upon a time"', '"Once upon a time", "max_tokens": '
                                                 + (value if isinstance(value, str) else str(value)))
    r = client.post("/v1/completions", content=raw)
    assert r.status_code == 200, r.text
    req = engine.submitted[-1]
    left = engine.max_model_len - len(req.prompt_token_ids)
    assert req.sampling.max_tokens == left
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == left
    assert_still_serving(client)


def test_stop_token_finishes_with_stop_and_counts_agree(client, engine, tok):
    stop_id = engine.script[3]
    r = client.post("/v1/completions", json=completion_body(max_tokens=10, logprobs=2, stop_token_ids=[stop_id]))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tok.decode(engine.script[:3])
    assert r.json()["usage"]["completion_tokens"] == 4 == len(choice["logprobs"]["tokens"])


def test_chat_logprobs_format(client, engine, tok):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3, logprobs=True, top_logprobs=3))
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [tok.token_text(t) for t in engine.script[:3]]
    for j, e in enumerate(content):
        assert e["logprob"] == pytest.approx(-(j + 1) / 10)
        assert bytes(e["bytes"]) == e["token"].encode()
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
        assert set(e["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=2, logprobs=True))
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])


def test_completion_echo_with_prompt_logprobs(client, engine, tok):
    prompt = "Hello there, friend"
    ids = tok.encode(prompt)
    r = client.post("/v1/completions", json=completion_body(prompt, max_tokens=3, echo=True, logprobs=1))
    choice = r.json()["choices"][0]
    assert engine.submitted[-1].sampling.prompt_logprobs == 1
    assert choice["text"] == prompt + tok.decode(engine.script[:3])
    lp = choice["logprobs"]
    n = len(ids) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == choice["text"]
    assert r.json()["usage"]["completion_tokens"] == 3
    # echo + max_tokens 0: the prompt and its logprobs only (the engine computes them)
    r = client.post("/v1/completions", json=completion_body(prompt, max_tokens=0, echo=True, logprobs=0))
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
    assert r.json()["usage"]["completion_tokens"] == 0
    # echo of a token-id prompt decodes it
    r = client.post("/v1/completions", json=completion_body(ids, max_tokens=0, echo=True))
    assert r.json()["choices"][0]["text"] == tok.decode(ids)


def test_n_choices_use_seed_plus_index(client, engine):
    r = client.post("/v1/completions", json=completion_body(n=3, seed=5, max_tokens=4, temperature=1.0))
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert [q.sampling.seed for q in engine.submitted] == [5, 6, 7]
    assert [q.request_id for q in engine.submitted] == [f"{r.json()['id']}-{i}" for i in range(3)]
    assert r.json()["usage"]["completion_tokens"] == 12
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(set(texts)) == 3
    r = client.post("/v1/completions", json=completion_body(n=2, temperature=0, max_tokens=4))
    a, b = r.json()["choices"]
    assert a["text"] == b["text"]


def test_cached_tokens_reported(tok):
    engine = FakeEngine(tok, cached_tokens=16)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        r = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        assert "mlxpd_router_prefix_cache_hit_tokens_total 16.0" in c.get("/metrics").text


# ------------------------------------------------------------------------------- invalid inputs and errors


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", completion_body(temperature=-1), 400, "temperature"),
    ("/v1/completions", completion_body(top_p=2), 400, "top_p"),
    ("/v1/chat/completions", chat_body(top_p=0), 400, "top_p"),
    ("/v1/completions", completion_body(n=0), 400, "n"),
    ("/v1/completions", completion_body(n=10**9), 400, "n"),
    ("/v1/completions", completion_body(""), 400, "prompt"),
    ("/v1/completions", completion_body([]), 400, "prompt"),
    ("/v1/completions", completion_body(["a", "b"]), 400, "prompt"),
    ("/v1/completions", completion_body([1, -2]), 400, "prompt"),
    ("/v1/completions", completion_body([10**12]), 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content"),
    ("/v1/completions", completion_body(max_tokens=-1), 400, "max_tokens"),
    ("/v1/completions", completion_body(max_tokens=1.5), 400, "max_tokens"),
    ("/v1/completions", completion_body(max_tokens="many"), 400, "max_tokens"),
    ("/v1/completions", completion_body(max_tokens=True), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_completion_tokens=-5), 400, "max_completion_tokens"),
    ("/v1/completions", completion_body(logprobs=21), 400, "logprobs"),
    ("/v1/chat/completions", chat_body(top_logprobs=3), 400, "top_logprobs"),
    ("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/completions", completion_body(presence_penalty=3), 400, "presence_penalty"),
    ("/v1/completions", completion_body(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/completions", completion_body(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("/v1/completions", completion_body(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("/v1/completions", completion_body(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("/v1/completions", completion_body(stop=[""]), 400, "stop"),
    ("/v1/completions", completion_body(stop=["x"] * 17), 400, "stop"),
    ("/v1/completions", completion_body(seed=2**70), 400, "seed"),
    ("/v1/completions", completion_body(top_k=-7), 400, "top_k"),
    ("/v1/completions", completion_body(stream="sure"), 400, "stream"),
    ("/v1/completions", completion_body("hello " * 3000), 400, "prompt"),
    ("/v1/chat/completions", chat_body("x " * 3000), 400, "messages"),
])
def test_invalid_requests_get_400_with_the_field(client, engine, path, body, status, param):
    err = assert_error(client.post(path, json=body), status, param)
    assert err["type"] == "invalid_request_error"
    assert engine.submitted == []
    assert_still_serving(client)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"text"', b"null", b'{"prompt": NaN}',
                                 b"\xff\xfe", b"[" * 100000])
def test_malformed_bodies_get_400(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert_still_serving(client)


def test_prompt_too_long_names_both_lengths(client, engine):
    ids = [5] * engine.max_model_len
    err = assert_error(client.post("/v1/completions", json=completion_body(ids)), 400, "prompt",
                       "context_length_exceeded")
    assert str(engine.max_model_len) in err["message"]
    r = client.post("/v1/completions", json=completion_body(ids[:-1], max_tokens=50))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_unknown_model_404_lists_served_names(client, engine):
    err = assert_error(client.post("/v1/chat/completions", json=chat_body(model="gpt-5")), 404, "model",
                       "model_not_found")
    assert MODEL in err["message"] and "alias" in err["message"]
    assert client.post("/v1/chat/completions", json=chat_body(model="alias", max_tokens=1)).json()["model"] == "alias"
    body = chat_body(max_tokens=1)
    del body["model"]
    assert client.post("/v1/chat/completions", json=body).json()["model"] == MODEL
    assert_error(client.get("/v1/models/nope"), 404, code="model_not_found")
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_still_serving(client)


def test_empty_user_message_is_served(client):
    r = client.post("/v1/chat/completions", json=chat_body("", max_tokens=2))
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_tokens": 2})
    assert r.status_code == 200
    assert_still_serving(client)


def test_unknown_endpoint_and_method_use_the_error_object(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_engine_error_is_503_with_retry_after(client, engine):
    engine.fail_with = EngineError("queue full", retry_after=2.5)
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
    assert_error(r, 503, code="engine_overloaded")
    assert r.headers["retry-after"] == "3"
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3, stream=True))
    assert_error(r, 503)
    assert r.headers["retry-after"] == "3"
    engine.fail_with = EngineError("dead")
    r = client.post("/v1/completions", json=completion_body())
    assert_error(r, 503, code="engine_unavailable")
    assert "retry-after" not in r.headers
    engine.fail_with = ValueError("prompt token ids must be in range")
    assert_error(client.post("/v1/completions", json=completion_body()), 400)
    engine.fail_with = None
    assert_still_serving(client)


def test_engine_failure_finish_is_an_error(client, engine):
    engine.fail_after = 0
    err = assert_error(client.post("/v1/completions", json=completion_body()), 500, code="engine_error")
    assert "scripted failure" in err["message"]
    engine.fail_after = 1
    assert_error(client.post("/v1/completions", json=completion_body()), 500, code="engine_error")
    r = client.post("/v1/completions", json=completion_body(stream=True))
    events = parse_sse(r.text)
    assert r.status_code == 200 and "error" in events[-2] and events[-1] == "[DONE]"
    engine.fail_after = None
    assert_still_serving(client)


def test_stalled_engine_times_out_and_is_aborted(client, engine):
    engine.stall = True
    err = assert_error(client.post("/v1/completions", json=completion_body()), 504, code="timeout")
    assert "0.5 s" in err["message"]
    assert engine.closed == [engine.submitted[0].request_id] and engine.active == 0
    engine.stall = False
    assert_still_serving(client)


# ------------------------------------------------------------------------------------------ auth, health, metrics


def test_api_key(engine, tok):
    app = create_app(engine, tok, served_model_names=[MODEL], api_key="s3cret")
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}):
            r = c.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=headers)
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.post("/reset_prefix_cache"), 401)
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        assert 'status="401"' in c.get("/metrics").text
    assert engine.submitted and len(engine.submitted) == 1


def test_health_follows_the_engine(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    engine.healthy = False
    assert_error(client.get("/health"), 503)
    engine.healthy = True
    assert client.get("/health").status_code == 200


def test_models_and_reset_prefix_cache(client, engine):
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL, "alias"]
    assert data["data"][0]["max_model_len"] == engine.max_model_len
    assert data["data"][0]["load_checks"] is None  # an engine client that reports no load check
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["dropped_blocks"] == 7 and engine.cleared == 1


def test_metrics(client, engine):
    client.post("/v1/chat/completions", json=chat_body(max_tokens=6))
    client.post("/v1/completions", json=completion_body(temperature=-1))
    text = client.get("/metrics").text
    for line in ['mlxpd_router_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0',
                 'mlxpd_router_requests_total{endpoint="/v1/completions",status="400"} 1.0',
                 "mlxpd_router_generation_tokens_total 6.0",
                 "mlxpd_router_time_to_first_token_seconds_count 1.0",
                 "mlxpd_router_time_per_output_token_seconds_count 1.0",
                 "mlxpd_router_inter_token_latency_seconds_count 4.0",  # 3 deltas of 2 tokens: 2nd and 3rd
                 "mlxpd_router_e2e_request_latency_seconds_count 1.0",
                 "mlx_pd_running_sequences 0.0", 'mlx_pd_kv_group_blocks_free{group="full"} 100.0',
                 'mlx_pd_kv_group_blocks_used{group="full"} 0.0', "mlx_pd_prefix_cache_hit_tokens_total 4.0",
                 "mlxpd_router_active_sequences 0.0", "mlx_pd_healthy 1.0"]:
        assert line in text, line
    prompt = client.post("/v1/chat/completions", json=chat_body(max_tokens=1)).json()["usage"]["prompt_tokens"]
    assert f"mlxpd_router_prompt_tokens_total {2.0 * prompt}" in client.get("/metrics").text


def test_tool_choice_auto_without_tools_is_plain_text_and_required_without_tools_is_refused(client):
    """Agent clients send `tools: [], tool_choice: "auto"` (Codex compacting a session): "auto" over no tools asks
    for nothing the server cannot do, so it answers as plain text; "required" over no tools cannot be served."""
    for tools in ([], None):
        body = chat_body(max_tokens=3, tool_choice="auto", **({"tools": tools} if tools is not None else {}))
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] and "tool_calls" not in r.json()["choices"][0]["message"]
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=3, tools=[], tool_choice="required"))
    assert_error(r, 400, "tool_choice")
