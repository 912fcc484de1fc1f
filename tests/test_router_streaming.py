"""SSE answers (usage with logprobs, n seeded choices: shapes, counts, equality with the non-streamed answer)
and client disconnects (the engine sees every abandoned request closed, for streamed and non-streamed answers)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from tests.router_fakes import (MODEL, FakeEngine, ServerThread, chat_body, completion_body, load_tokenizer,
                                parse_sse)


@pytest.fixture
def tok():
    return load_tokenizer()


@pytest.fixture
def engine(tok):
    return FakeEngine(tok, tokens_per_delta=3)


@pytest.fixture
def client(engine, tok):
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        yield c


def stream(client, path: str, body: dict) -> list:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def test_chat_stream_with_usage_and_logprobs_matches_non_streamed(client):
    body = chat_body(max_tokens=10, logprobs=True, top_logprobs=3, stream_options={"include_usage": True})
    events = stream(client, "/v1/chat/completions", body)
    *chunks, last = events
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content_chunks = [c for c in chunks[1:] if "content" in c["choices"][0]["delta"]]
    entries = []
    for c in content_chunks:
        lp = c["choices"][0]["logprobs"]
        assert lp is not None and len(lp["content"]) >= 1
        assert all(len(e["top_logprobs"]) == 3 for e in lp["content"])
        entries += lp["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    assert last["usage"] == whole["usage"]
    assert last["usage"]["completion_tokens"] == len(entries) == 10
    assert entries == whole["choices"][0]["logprobs"]["content"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert len({c["id"] for c in events}) == 1


def test_three_seeded_choices_stream_equal_non_streamed(client):
    body = chat_body(max_tokens=7, n=3, seed=11, temperature=0.8)
    chunks = stream(client, "/v1/chat/completions", body)
    texts, finishes, roles = {}, {}, {}
    for c in chunks:
        (choice,) = c["choices"]
        i = choice["index"]
        if choice["delta"].get("role") == "assistant":
            assert i not in texts, "role chunk must be the first chunk of its choice"
            roles[i] = True
        texts[i] = texts.get(i, "") + choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finishes[i] = finishes.get(i, 0) + 1
    assert set(roles) == set(finishes) == set(texts) == {0, 1, 2}
    assert finishes == {0: 1, 1: 1, 2: 1}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert len(set(texts.values())) == 3


def test_completion_stream_with_echo_and_logprobs_matches_non_streamed(client, tok):
    body = completion_body("Hello world", max_tokens=8, n=2, echo=True, logprobs=2, seed=3,
                           stream_options={"include_usage": True})
    events = stream(client, "/v1/completions", body)
    *chunks, last = events
    whole = client.post("/v1/completions", json=body).json()
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert mine[0]["text"].startswith("Hello world")
        joined = {k: sum((c["logprobs"][k] for c in mine), []) for k in mine[0]["logprobs"]}
        assert joined == whole["choices"][i]["logprobs"]
        assert [c["finish_reason"] for c in mine].count("length") == 1


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = stream(client, "/v1/completions", completion_body(max_tokens=4))
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks)
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_stall_mid_stream_ends_with_an_error_event_and_aborts(tok):
    engine = FakeEngine(tok)
    engine.stall_after = 2
    with TestClient(create_app(engine, tok, served_model_names=[MODEL], request_timeout_s=0.3)) as c:
        events = stream(c, "/v1/chat/completions", chat_body(max_tokens=50))
        assert events[-1]["error"]["code"] == "timeout" and "0.3 s" in events[-1]["error"]["message"]
        assert [e["choices"][0]["delta"].get("content") for e in events[:-1]][1:] and len(events) == 4
        assert engine.closed == [engine.submitted[0].request_id] and engine.active == 0


# ------------------------------------------------------------------------------------------ disconnects


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}


async def _drive(app, path: str, body: dict, *, gone_after_chunks: int | None = None,
                 gone_after_s: float | None = None) -> list[dict]:
    """Call the ASGI app directly; the client 'disconnects' after some body chunks or some time."""
    gone = asyncio.Event()
    data = json.dumps(body).encode()
    sent = []

    async def receive():
        if not sent and not getattr(receive, "done", False):
            receive.done = True
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if gone_after_chunks is not None and len(chunks) >= gone_after_chunks:
            gone.set()

    if gone_after_s is not None:
        asyncio.get_running_loop().call_later(gone_after_s, gone.set)
    await asyncio.wait_for(app(_scope(path), receive, send), 10)
    return sent


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat_body(max_tokens=4000, n=2)), ("/v1/completions", completion_body(max_tokens=4000)),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4000, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 4000, "input": "Hi"})])
async def test_stream_disconnect_closes_every_engine_generator(tok, anyio_backend, path, body):
    """A client gone after the first chunk of a stream (every streaming API, ten times over): each of its engine
    generators is closed and aborted, none finished, nothing is sent after, and a new request is served at once."""
    engine = FakeEngine(tok, max_model_len=8192, delay_s=0.01)
    app = create_app(engine, tok, served_model_names=[MODEL])
    for _ in range(10):
        before = len(engine.submitted)
        sent = await _drive(app, path, {**body, "stream": True}, gone_after_chunks=1)
        ids = [r.request_id for r in engine.submitted[before:]]
        assert ids and engine.active == 0
        assert set(engine.closed) >= set(ids) and not set(engine.finished) & set(ids)
        assert set(engine.aborted) >= set(ids)
        n_sent = len(sent)
        await asyncio.sleep(0.05)
        assert len(sent) == n_sent  # nothing after the disconnect
    t = time.monotonic()
    sent = await _drive(app, "/v1/completions", completion_body(max_tokens=3))
    assert sent[0]["status"] == 200 and time.monotonic() - t < 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("stall", [True, False])
@pytest.mark.parametrize("streamed", [True, False])
async def test_disconnect_before_the_first_token_or_during_a_long_answer(tok, anyio_backend, stall, streamed):
    engine = FakeEngine(tok, max_model_len=8192, delay_s=0.01)
    engine.stall = stall  # stalled = a long prefill; else a long decode
    app = create_app(engine, tok, served_model_names=[MODEL])
    t = time.monotonic()
    body = completion_body(max_tokens=4000, n=3, stream=streamed)
    await _drive(app, "/v1/completions", body, gone_after_s=0.3)
    assert time.monotonic() - t < 1.5
    ids = [r.request_id for r in engine.submitted]
    assert len(ids) == 3 and engine.active == 0
    assert set(engine.closed) == set(ids) and set(engine.aborted) == set(ids)
    assert engine.finished == []


def test_disconnects_through_uvicorn(tok):
    engine = FakeEngine(tok, max_model_len=8192, delay_s=0.01)
    app = create_app(engine, tok, served_model_names=[MODEL])
    with ServerThread(app) as server, httpx.Client(base_url=server.url) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=4000, stream=True)) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        engine.stall = True
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=completion_body(max_tokens=4000), timeout=0.3)
        deadline = time.monotonic() + 2
        while (engine.active or len(engine.closed) < 4) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.active == 0 and len(engine.closed) == 4 and engine.finished == []
        engine.stall = False
        r = http.post("/v1/completions", json=completion_body(max_tokens=3), timeout=2)
        assert r.status_code == 200
        metrics = http.get("/metrics").text
        assert "mlxpd_router_active_sequences 0.0" in metrics
