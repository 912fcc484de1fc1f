"""Speculative decoding through the HTTP API (real SmolLM2, float32): stops inside an accepted draft block,
streamed and not, with both drafters chosen per request; the server default; /metrics; refusals of bad options."""

from __future__ import annotations

import httpx
import pytest

from tests.live_server import serve_app
from tests.speculation_helpers import DRAFTERS, REPEAT, REWRITE, speculative_engine
from tests.test_api_real import MODEL, post, stream_events


@pytest.fixture(scope="module")
def server():
    from cluster.launch.single_node import start_in_process_worker
    from router.app import create_app
    from router.tokenizer import RouterTokenizer

    core = speculative_engine(max_num_seqs=4)
    client = start_in_process_worker(core, model_name=MODEL)
    app = create_app(client, RouterTokenizer(core.tokenizer), served_model_names=[MODEL])
    try:
        with serve_app(app) as base:
            yield base, core
    finally:
        client.stop()


def chat(content: str, max_tokens: int, **kw) -> dict:
    return {"model": MODEL, "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
            "messages": [{"role": "user", "content": content}], **kw}


def answer(base: str, body: dict) -> tuple[str, str, list[str], int]:
    """(text, finish_reason, logprob tokens, completion_tokens) of a non-streamed chat answer."""
    r = post(base, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    return (choice["message"]["content"], choice["finish_reason"],
            [e["token"] for e in choice["logprobs"]["content"]], data["usage"]["completion_tokens"])


def streamed(base: str, body: dict) -> tuple[str, str, list[str], int]:
    """The same, joined from the SSE chunks (with `include_usage`)."""
    events = stream_events(base, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    text, finish, tokens = "", None, []
    for e in events[:-1]:
        for c in e["choices"]:
            text += c["delta"].get("content") or ""
            finish = c["finish_reason"] or finish
            tokens += [x["token"] for x in (c.get("logprobs") or {}).get("content") or []]
    assert events[-1]["choices"] == []
    return text, finish, tokens, events[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("method", DRAFTERS)
def test_stops_inside_accepted_blocks_through_the_api(server, method):
    """EOS, a stop string and max_tokens 1..8 with speculation, streamed and not: equal to the plain answers;
    nothing after the stop; completion_tokens equals the tokens delivered and the logprob entries."""
    base, core = server
    spec = {"speculative": {"method": method, "num_draft_tokens": 4}}
    drafted = core.speculator.num_draft_tokens
    for content, stop in ((REPEAT, None), (REWRITE, " next Tuesday")):
        full = answer(base, chat(content, 40))
        kw = {"stop": stop} if stop else {}
        ref = answer(base, chat(content, 40, **kw))
        assert ref[1] == "stop" and ref[3] == len(ref[2]) < 40
        if stop:
            assert ref[0] == full[0][:full[0].index(stop)]
        for get in (answer, streamed):
            assert get(base, chat(content, 40, **kw, **spec)) == ref
    full = answer(base, chat(REWRITE, 8))
    for m in range(1, 9):
        for get in (answer, streamed):
            text, finish, tokens, count = get(base, chat(REWRITE, m, **spec))
            assert (finish, tokens, count) == ("length", full[2][:m], m)
            assert full[0].startswith(text)
    assert core.speculator.num_draft_tokens > drafted


def test_metrics_and_refusals(server):
    base, core = server
    post(base, "/v1/chat/completions", chat(REPEAT, 16, speculative={"method": "prompt_lookup"}))
    text = httpx.get(base + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("mlx_pd_draft")}
    assert values["mlx_pd_draft_tokens_total"] == core.speculator.num_draft_tokens > 0
    assert values["mlx_pd_draft_accepted_tokens_total"] == core.speculator.num_accepted_tokens > 0
    assert 0 < values["mlx_pd_draft_acceptance_rate"] <= 1
    for bad in ({"method": "medusa"}, {"method": "prompt_lookup", "num_draft_tokens": 17}, {"num_draft_tokens": 2}):
        r = post(base, "/v1/chat/completions", chat("Hi", 4, speculative=bad))
        assert r.status_code == 400 and "speculative" in r.json()["error"]["message"], r.text


def test_a_missing_draft_model_is_a_400():
    from cluster.launch.single_node import start_in_process_worker
    from router.app import create_app
    from router.tokenizer import RouterTokenizer
    from tests.engine_helpers import make_engine

    core = make_engine()
    client = start_in_process_worker(core, model_name=MODEL)
    app = create_app(client, RouterTokenizer(core.tokenizer), served_model_names=[MODEL])
    try:
        with serve_app(app) as base:
            r = post(base, "/v1/chat/completions", chat("Hi", 4, speculative={"method": "draft_model"}))
            assert r.status_code == 400 and "--draft-model" in r.json()["error"]["message"]
    finally:
        client.stop()
