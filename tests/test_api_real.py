"""API cases against a real single-node server (real SmolLM2, float32): stop strings spanning tokens, usage
with logprobs, n choices, invalid and edge-case inputs, client disconnects."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.live_server import live_server

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 96


@pytest.fixture(scope="module")
def server():
    with live_server(max_model_len=CONTEXT, max_num_seqs=4) as (base, client):
        yield base, client


def post(base: str, path: str, body, **kw) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120, **kw)


def stream_events(base: str, path: str, body) -> list[dict]:
    events = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
    assert events[-1] == {"done": True}
    return events[:-1]


def completion(base: str, prompt: str, **kw) -> dict:
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_answers_paris(server):
    base, _ = server
    r = post(base, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 20,
                                            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("prompt,pick", [
    ("A B C D E F G H", lambda text: text[2:11]),  # a stop string spanning several tokens, picked from the output
    # a stop inside a phrase the model repeats: generation ends at its first occurrence
    ("alpha beta gamma alpha beta gamma alpha beta gamma alpha", lambda text: "beta beta"),
])
def test_stop_string_spanning_tokens_is_never_streamed(server, prompt, pick):
    base, _ = server
    cold = completion(base, prompt, max_tokens=24)["choices"][0]["text"]
    stop = pick(cold)
    assert stop in cold, (cold, stop)
    expected = cold[:cold.index(stop)]
    plain = completion(base, prompt, max_tokens=24, stop=[stop])["choices"][0]
    assert plain["text"] == expected and plain["finish_reason"] == "stop"
    events = stream_events(base, "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0,
                                                      "max_tokens": 24, "stop": stop})
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert streamed == expected
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"


def test_streamed_usage_and_logprobs_match_the_non_streamed_answer(server):
    base, _ = server
    body = {"model": MODEL, "temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 3,
            "messages": [{"role": "user", "content": "Name three colors."}]}
    plain = post(base, "/v1/chat/completions", body).json()
    events = stream_events(base, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    last = events[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    entries = []
    for e in events[:-1]:
        for c in e["choices"]:
            if c["delta"].get("content"):
                assert c["logprobs"] and c["logprobs"]["content"]
            if c.get("logprobs"):
                for entry in c["logprobs"]["content"]:
                    assert len(entry["top_logprobs"]) == 3
                    entries.append(entry)
    assert len(entries) == plain["usage"]["completion_tokens"] == len(plain["choices"][0]["logprobs"]["content"])
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == plain["choices"][0]["message"]["content"]


def test_n_choices_streamed_equal_non_streamed(server):
    base, _ = server
    body = {"model": MODEL, "temperature": 0.8, "seed": 11, "n": 3, "max_tokens": 10,
            "messages": [{"role": "user", "content": "Tell me a fun fact."}]}
    plain = post(base, "/v1/chat/completions", body).json()["choices"]
    events = stream_events(base, "/v1/chat/completions", body)
    joined, finishes = {0: "", 1: "", 2: ""}, {0: 0, 1: 0, 2: 0}
    for e in events:
        for c in e["choices"]:
            joined[c["index"]] += c["delta"].get("content") or ""
            finishes[c["index"]] += c["finish_reason"] is not None
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert [joined[i] for i in range(3)] == [c["message"]["content"] for c in sorted(plain, key=lambda c: c["index"])]
    greedy = post(base, "/v1/chat/completions", {**body, "temperature": 0, "n": 2}).json()["choices"]
    assert greedy[0]["message"]["content"] == greedy[1]["message"]["content"]


BAD_INPUTS = [
    {"temperature": -1}, {"top_p": 2}, {"n": 0}, {"max_tokens": -1}, {"messages": None},
    {"model": "no-such-model"}, {"messages": []},
]


def healthy_after(base: str) -> None:
    assert httpx.get(base + "/health").status_code == 200
    r = post(base, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("patch", BAD_INPUTS)
def test_invalid_inputs_get_4xx_with_error_object(server, patch):
    base, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(base, "/v1/chat/completions", body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["message"]
    healthy_after(base)


def test_malformed_json_and_empty_prompt_get_4xx(server):
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", content=b'{"model": "x", "messages": [', timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": ""})
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"]
    r = post(base, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": ""}]})
    assert r.status_code in (200, 400)  # an empty message still renders a non-empty chat prompt
    healthy_after(base)


@pytest.mark.parametrize("max_tokens", [100000000, 2147483647, 1e18])
def test_huge_max_tokens_is_clamped_to_the_context(server, max_tokens):
    base, _ = server
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "temperature": 0,
                                       "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"] == CONTEXT
    healthy_after(base)


def test_max_tokens_zero_and_one(server):
    base, _ = server
    zero = completion(base, "Hello there", max_tokens=0)
    assert zero["choices"][0]["text"] == "" and zero["usage"]["completion_tokens"] == 0
    one = completion(base, "Hello there", max_tokens=1)
    assert one["usage"]["completion_tokens"] == 1 and one["choices"][0]["finish_reason"] in ("length", "stop")


def test_prompt_longer_than_context_is_400(server):
    base, client = server
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "word " * 400, "max_tokens": 4})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert client.stats().num_running == 0


def test_openai_client_against_real_server(server):
    openai = pytest.importorskip("openai")
    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=20,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=20, stream=True,
        messages=[{"role": "user", "content": "What is the capital of France?"}]) if c.choices]
    assert "".join(parts) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, temperature=-1, messages=[{"role": "user", "content": "x"}])


def test_client_disconnects_free_everything():
    """Clients that go away (two streams closed mid-decode, a non-streamed request abandoned during its prefill,
    round after round) have every request aborted, none run to its end, and every block free again. The check
    counts engine steps, not seconds, so it holds however long a step takes on this CPU (a 128-token chunk of
    the real model takes ~15 s without OpenBLAS, ~0.3 s with it)."""
    with live_server(max_num_seqs=2, kv_cache_gb=0.5, max_model_len=8192, prefill_chunk_size=128) as (base, client):
        core, step, abort = client.engine, client.engine.step, client.engine.abort
        finished: dict[str, str] = {}
        num_steps = [0]

        def counting_step():
            outputs = step()
            num_steps[0] += 1
            finished.update((o.request_id, o.finish_reason.value) for o in outputs if o.finished)
            return outputs

        def recording_abort(request_id):
            output = abort(request_id)
            if output is not None:
                finished[output.request_id] = output.finish_reason.value
            return output

        # both run on the worker's loop thread; nothing of the engine is touched from here
        core.step, core.abort = counting_step, recording_abort
        deadline = time.monotonic() + 30
        while client.stats().kv_blocks_total == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        baseline = client.stats().kv_blocks_total
        long_prompt = "The archive holds many old letters. " * 90  # ~630 tokens: five prefill chunks
        rounds = 6
        for _ in range(rounds):
            streams = []
            for _ in range(2):
                # a stream's first chunk may wait for the previous round's aborts and a prefill chunk on a
                # loaded machine; how long is not what this test is about
                cm = httpx.stream("POST", base + "/v1/completions", timeout=300, json={
                    "model": MODEL, "prompt": "Count slowly:", "max_tokens": 4000, "stream": True})
                lines = cm.__enter__().iter_lines()
                next(lines)  # the first chunk arrived; `lines` is kept, so the stream stays open
                streams.append((cm, lines))
            for cm, _ in streams:
                cm.__exit__(None, None, None)
            t = threading.Thread(target=lambda: _abandon(base, long_prompt), daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive()

        # Nothing runs or waits and every block is free within a few steps of the last client leaving (the
        # router notices a disconnect within 0.2 s; a step may be running). Left running, any of these
        # requests would take thousands of steps; the wall-clock deadline only bounds a failure.
        def idle():
            s = client.stats()
            return (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, baseline)
        steps_then, since = num_steps[0], time.monotonic()
        deadline = since + 600
        while not idle() and (num_steps[0] - steps_then < 30 or time.monotonic() - since < 5):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert idle(), (num_steps[0] - steps_then, client.stats())
        assert len(finished) == 3 * rounds and set(finished.values()) == {"abort"}, finished
        r = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def _abandon(base: str, prompt: str) -> None:
    try:
        httpx.post(base + "/v1/completions", timeout=0.5,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4000, "ignore_eos": True})
    except httpx.TimeoutException:
        pass  # the client gave up during prefill (or before its prompt reached the engine)


def test_request_that_waits_too_long_for_kv_blocks_gets_503_with_retry_after():
    with live_server(block_size=8, num_blocks=17, queue_timeout_s=2.0, max_model_len=128) as (base, client):
        # Each step is followed by a 0.5 s pause, so the first request (27 steps) outlasts the second's 2 s
        # wait on any machine; the first is admitted at once (the deadline is checked as a step starts).
        core, step = client.engine, client.engine.step

        def step_then_pause():
            outputs = step()
            time.sleep(0.5)
            return outputs

        core.step = step_then_pause  # called by the worker's loop thread; nothing of the engine is touched from here
        first_body = {"model": MODEL, "prompt": "word " * 99, "ignore_eos": True, "max_tokens": 27, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=first_body, timeout=60) as first:
            lines = first.iter_lines()  # keep a reference: a discarded iterator closes the stream
            next(lines)
            deadline = time.monotonic() + 60  # the stats snapshot follows the engine by up to one step
            while client.stats().num_running != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            # it holds 13 of the 16 usable blocks from now on, 16 at the end
            second = post(base, "/v1/completions", {"model": MODEL, "prompt": "other " * 40, "max_tokens": 4})
            assert client.stats().num_running == 1  # the first is still running: nothing freed its blocks
        assert second.status_code == 503 and "retry-after" in second.headers
        assert "retry later" in second.json()["error"]["message"]
        healthy_after(base)


def test_n_beyond_what_the_engine_can_hold_is_400_not_503():
    """n larger than running + queued sequences could never be admitted whole: a 400 naming n (a 503 would
    tell the client to retry something that cannot succeed). Found by the reliability run's API fuzz."""
    with live_server(max_num_seqs=1, max_waiting=2) as (base, _):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
        r = post(base, "/v1/completions", {**body, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = post(base, "/v1/completions", {**body, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
