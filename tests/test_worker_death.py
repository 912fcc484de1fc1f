"""Workers that die under a running cluster (in-process workers, tests/cluster_helpers.py): a decode worker's
streams migrate to another decode worker; a request whose prefill worker dies before its decode worker took
over is run by the decode worker; a request with nowhere left to go is the cluster's fault, a 503 with
Retry-After. Answers are checked against the fast model's single-node greedy output; steps are stretched
(`slow_steps`) so that each death lands while the request is where the test means it to be."""

from __future__ import annotations

import json

import httpx

from tests.cluster_helpers import running_cluster, slow_steps
from tests.cluster_requests import (ALL_REMOTE, MODEL, assert_still_serving, at_baseline, long_text,
                                    post_in_background, reference_text, wait_until)
from tests.engine_helpers import fast_model


def test_decode_worker_death_mid_stream_migrates_the_request():
    """The decode worker serving a stream dies; the router notices within its
    heartbeat deadline and re-runs the request on the other decode worker from the prompt plus the tokens
    already streamed: the client sees one uninterrupted stream of the full length. (Decode steps are stretched
    to >= 50 ms so that most of the stream is still to come when the worker dies, as on the real model.)"""
    with running_cluster(1, 2, loaded=fast_model(), routing=ALL_REMOTE) as (base, client, workers):
        for name in ("decode-0", "decode-1"):
            slow_steps(workers[name], 0.05)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        texts, finish, usage, killed = [], None, None, None
        with httpx.stream("POST", base + "/v1/completions", timeout=300, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    texts.append(choice["text"])
                    finish = choice.get("finish_reason") or finish
                if killed is None and len(texts) >= 8:
                    stream = next(iter(client.streams.values()))
                    killed = stream.decode.spec.name
                    workers[killed].stop()  # the worker's loop and sockets die without a word
        assert killed is not None and finish == "length" and usage["completion_tokens"] == 60
        survivor = next(n for n in workers if n.startswith("decode") and n != killed)
        assert wait_until(lambda: workers[survivor].stats().tokens_out > 0)
        assert not next(w for w in client.workers if w.spec.name == killed).alive
        assert_still_serving(base)  # new requests succeed


def test_prefill_worker_death_before_the_first_token_reruns_the_prompt_on_the_decode_worker():
    """The prefill worker dies mid-prompt (its 19 chunks stretched to seconds): the router has the decode worker,
    which was waiting for the KV, prefill the prompt itself, so the client gets the whole answer, the same greedy
    text as on the healthy cluster, with a longer TTFT instead of an error; nothing leaks and later requests are
    served."""
    with running_cluster(1, 1, loaded=fast_model(), engine="prefill_chunk_size = 64", routing=ALL_REMOTE) as (
            base, client, workers):
        body = {"model": MODEL, "prompt": long_text(1200), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        healthy = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert healthy.status_code == 200, healthy.text
        assert httpx.post(base + "/reset_prefix_cache", timeout=30).status_code == 200  # compute it all again
        before = workers["decode-0"].stats().tokens_out
        slow_steps(workers["prefill-0"], 0.25)
        answer = post_in_background(base + "/v1/completions", body)
        assert wait_until(lambda: workers["prefill-0"].stats().num_running > 0, 60)
        workers["prefill-0"].stop()
        r = answer()
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == healthy.json()["choices"][0]["text"] and choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 20
        # every token of the second answer, its first included, came from the decode worker (stats lag a step)
        assert wait_until(lambda: workers["decode-0"].stats().tokens_out - before == 20, 30)
        assert wait_until(lambda: at_baseline({"decode-0": workers["decode-0"]}), 30)
        assert not client.streams and all(not w.inflight for w in client.workers)
        assert_still_serving(base)


def test_prefill_worker_death_after_the_first_token_but_before_its_kv_arrived_reruns_on_the_decode_worker():
    """The prefill worker streams the first token but never finishes the KV transfer (its last message is held
    back), then dies: the decode worker, which would otherwise wait out the transfer's deadline, runs the
    request from its prompt plus that first token, and the client's stream is whole and equal to the healthy
    cluster's greedy answer."""
    with running_cluster(1, 1, loaded=fast_model(), routing=ALL_REMOTE) as (base, client, workers):
        body = {"model": MODEL, "prompt": long_text(300), "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        healthy = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert healthy.status_code == 200, healthy.text
        assert httpx.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        prefill = workers["prefill-0"]
        prefill.sender.finish = lambda *args, **kwargs: None  # the transfer's last message never leaves
        texts, finish = [], None
        with httpx.stream("POST", base + "/v1/completions", timeout=180, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event.get("choices", []):
                    texts.append(choice["text"])
                    finish = choice.get("finish_reason") or finish
                if len(texts) == 1:
                    prefill.stop()
        assert "".join(texts) == healthy.json()["choices"][0]["text"] and finish == "length"
        assert not client.streams and all(not w.inflight for w in client.workers)


def test_losing_the_only_decode_worker_is_a_503_with_retry_after():
    """The only decode worker dies mid-answer with nowhere to migrate: the cluster's fault, not the request's,
    so the client gets a 503 with Retry-After (a retry can succeed once a worker is back), not a 500."""
    with running_cluster(0, 1, loaded=fast_model()) as (base, client, workers):
        slow_steps(workers["decode-0"], 0.05)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
        answer = post_in_background(base + "/v1/completions", body)
        assert wait_until(lambda: workers["decode-0"].stats().tokens_out > 2, 60)
        workers["decode-0"].stop()
        r = answer()
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "stopped responding" in r.json()["error"]["message"]


def test_decode_worker_death_before_any_token_reruns_the_request_elsewhere():
    """A decode worker dies while the prefill worker is still computing the prompt bound for it (nothing
    streamed yet): the router stops that prefill and re-runs the request on the other decode worker from
    the start; the client gets the whole answer, equal to single-node output. (The prefill worker's 10 chunks
    are stretched to seconds, so the decode worker dies while they compute.)"""
    prompt = "Summarize: " + long_text(600)
    with running_cluster(1, 2, loaded=fast_model(), engine="prefill_chunk_size = 64", routing=ALL_REMOTE) as (
            base, client, workers):
        slow_steps(workers["prefill-0"], 0.25)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        answer = post_in_background(base + "/v1/completions", body, timeout_s=300)
        assert wait_until(lambda: workers["prefill-0"].stats().num_running > 0 and client.streams, 60)
        victim = next(iter(client.streams.values())).decode.spec.name
        workers[victim].stop()
        r = answer()
        assert r.status_code == 200, r.text
        _, tokenizer, _ = fast_model()
        assert r.json()["choices"][0]["text"] == reference_text(tokenizer.encode(prompt), 12)
        survivor = next(n for n in workers if n.startswith("decode") and n != victim)
        assert wait_until(lambda: workers[survivor].stats().tokens_out > 0)
        assert wait_until(lambda: workers["prefill-0"].stats().kv_blocks_free
                          == workers["prefill-0"].stats().kv_blocks_total, 60)
        assert all(not w.inflight for w in client.workers)
