"""Cluster mode end to end, workers in-process (tests/cluster_helpers.py): disaggregated output equals
single-node output token for token; disconnects, dead workers and migration; no leaked blocks. The same worker
classes run as Ray actors under `mlx-pd up` (tests/test_launch.py).

Every cluster here serves the fast random-weight model (tests.engine_helpers.fast_model) and checks answers
against its single-node greedy output, except the speculative-counter test, whose drafts need the real model
repeating its prompt. Where a test acts while a prefill runs or needs a request to outlast an action, it
stretches the workers' steps (`slow_steps`) instead of relying on the real model's slowness."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time

import httpx
import pytest

from router.metrics import PREFIX
from tests.cluster_helpers import running_cluster, slow_steps
from tests.engine_helpers import fast_model, greedy, make_engine, run

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three uses of copper and explain each one in a sentence."]
ALL_REMOTE = "local_prefill_max_tokens = 0"  # every request goes through a prefill worker


def chat(base, text, max_tokens=24, **extra):
    r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def reference_text(prompt_ids, max_tokens, **engine) -> str:
    """The fast model's single-node greedy answer to `prompt_ids` (a fresh engine with `engine` settings)."""
    return run(make_engine(loaded=fast_model(), **engine), [greedy("ref", prompt_ids, max_tokens)])["ref"].text


def chat_ids(text):
    _, tokenizer, _ = fast_model()  # SmolLM2's tokenizer and chat template
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@functools.lru_cache(maxsize=None)
def reference_answer(text: str, max_tokens: int = 24) -> str:
    """The single-node answer `chat(base, text)` must give on a cluster of the fast model (a pure function of
    the two, so computed once)."""
    return reference_text(chat_ids(text), max_tokens)


def assert_still_serving(base) -> None:
    """The cluster answers a new chat exactly as single-node does (greedy)."""
    assert chat(base, QUESTIONS[0])["choices"][0]["message"]["content"] == reference_answer(QUESTIONS[0])


def long_text(n_words=700):
    words = ("the river carries silt from the mountains to the delta where farmers plant rice in spring "
             "and harvest it before the monsoon ").split()
    return " ".join(words[i % len(words)] for i in range(n_words))


def wait_until(pred, timeout=60.0):
    """Poll `pred` until it holds (True) or `timeout` seconds passed (its last value). The default is far
    above the fraction of a second these conditions take on a quiet machine: a loaded one (a CI neighbour,
    a CPU burner) delays a worker's loop by seconds, and a tight deadline then fails a correct run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def post_and_leave(base, path, body, until, timeout=120.0) -> None:
    """POST `body` to `path` on a bare HTTP/1.1 connection and close it, having read nothing, once `until()`
    holds (within `timeout` seconds)."""
    url = httpx.URL(base)
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head + data)
        assert wait_until(until, timeout)


def at_baseline(workers) -> bool:
    return all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_running"] == 0 and s["num_waiting"] == 0
               and s["transfers_inflight"] == 0 for s in (w.stats() for w in workers.values()))


@pytest.mark.parametrize("decode,kv_bits", [(1, None), (2, None), (1, 8)])
def test_disaggregated_greedy_output_equals_single_node(decode, kv_bits):
    """1P1D and 1P2D (and 8-bit KV) answer token for token like single-node, including a
    prompt prefilled in several chunks whose blocks were shipped while the next chunk computed."""
    engine = "prefill_chunk_size = 256" + (f"\nkv_bits = {kv_bits}\nkv_group_size = 32" if kv_bits else "")
    prompts = QUESTIONS + ["Summarize this in one sentence: " + long_text()]
    refs = [reference_text(chat_ids(q), 24, prefill_chunk_size=256, kv_bits=kv_bits, kv_group_size=32)
            for q in prompts]
    with running_cluster(1, decode, loaded=fast_model(), engine=engine, routing=ALL_REMOTE) as (base, _, workers):
        # One at a time, as the references ran: a batch's padding changes float rounding (in either mode),
        # which can flip a near-tie of greedy decoding; batch invariance is not what this test is about.
        for prompt, ref in zip(prompts, refs):
            assert chat(base, prompt)["choices"][0]["message"]["content"] == ref
        moved = sum(len(chat_ids(q)) // 32 for q in prompts)  # the KV really moved (stats lag <= 0.5 s)
        assert wait_until(lambda: workers["prefill-0"].stats()["kv_blocks_sent"] >= moved)
        assert wait_until(lambda: at_baseline(workers))


def test_streamed_disaggregated_answer_arrives_in_order():
    with running_cluster(1, 1, loaded=fast_model(), routing=ALL_REMOTE) as (base, _, workers):
        full = chat(base, QUESTIONS[2], max_tokens=40)["choices"][0]["message"]["content"]
        parts = []
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=300, json={
                "model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 40,
                "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    parts.append(delta.get("content") or "")
        assert "".join(parts) == full and wait_until(lambda: workers["decode-0"].stats()["tokens_out"] > 0)
        # Each worker serves its KV-transfer metrics for Prometheus.
        received = httpx.get(workers["decode-0"].endpoints["metrics"], timeout=10).text
        sent = httpx.get(workers["prefill-0"].endpoints["metrics"], timeout=10).text
        assert 'mlxpd_kv_transfer_bytes_total{direction="receive"}' in received
        assert 'mlxpd_kv_transfer_latency_seconds_count{direction="send"} 2.0' in sent


def test_short_prompts_skip_the_prefill_worker():
    """Conditional disaggregation: below local_prefill_max_tokens the decode worker prefills itself."""
    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 100000") as (
            base, _, workers):
        assert_still_serving(base)  # the answer equals single-node's
        assert workers["prefill-0"].stats()["kv_bytes_sent"] == 0
        from cluster.launch.workers import probe_worker  # what tools see: the stats a ping returns

        assert probe_worker(workers["decode-0"].endpoints["control"])["tokens_out"] > 0


def test_prompt_longer_than_the_context_is_400_before_any_transfer():
    with running_cluster(1, 1, loaded=fast_model(), engine="max_model_len = 256", routing=ALL_REMOTE) as (
            base, client, workers):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": long_text(400), "max_tokens": 4})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        assert workers["prefill-0"].stats()["kv_bytes_sent"] == 0 and not client.streams


@pytest.mark.parametrize("when", ["during_prefill", "after_first_token"])
def test_client_disconnect_frees_blocks_on_both_workers(when):
    """A client leaving during prefill (mid-transfer) or right after the first token: both workers'
    free blocks return to baseline within seconds, and the abort reaches both: the decode worker stops short
    of max_tokens (and, for a client gone during prefill, no token is generated at all). The prefill worker's
    steps are stretched so that its 8 chunks take seconds, as on the real model."""
    max_tokens = 2000  # with ignore_eos, only an abort ends it within the baseline wait
    with running_cluster(1, 1, loaded=fast_model(), engine="prefill_chunk_size = 128", routing=ALL_REMOTE) as (
            base, client, workers):
        slow_steps(workers["prefill-0"], 0.5)
        body = {"model": MODEL, "prompt": long_text(900), "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        if when == "during_prefill":  # the router sends the response's headers with the first token, so the
            # client must leave without waiting for them: a bare connection, closed mid-transfer
            post_and_leave(base, "/v1/completions", body,
                           until=lambda: workers["prefill-0"].stats()["kv_blocks_sent"] > 0)
        else:
            with httpx.stream("POST", base + "/v1/completions", timeout=300, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break
        # the response is closed: the router aborts on both workers
        assert wait_until(lambda: at_baseline(workers)), [w.stats() for w in workers.values()]
        assert not client.streams and all(not w.inflight for w in client.workers)
        out = {n: w.stats()["tokens_out"] for n, w in workers.items()}  # as fresh as the baseline seen
        if when == "during_prefill":  # the client left while the prompt computed: no token anywhere
            assert out == {"prefill-0": 0, "decode-0": 0}, out
        else:  # the decode worker stopped short of max_tokens (the first token came from the prefill worker)
            assert out["decode-0"] < max_tokens - 1, out
        assert_still_serving(base)


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
        assert wait_until(lambda: workers[survivor].stats()["tokens_out"] > 0)
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
        before = workers["decode-0"].stats()["tokens_out"]
        slow_steps(workers["prefill-0"], 0.25)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(base + "/v1/completions", json=body,
                                                                               timeout=120)))
        t.start()
        assert wait_until(lambda: workers["prefill-0"].stats()["num_running"] > 0, 60)
        workers["prefill-0"].stop()
        t.join(120)
        r = result["r"]
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == healthy.json()["choices"][0]["text"] and choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 20
        # every token of the second answer, its first included, came from the decode worker (stats lag a step)
        assert wait_until(lambda: workers["decode-0"].stats()["tokens_out"] - before == 20, 30)
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
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(base + "/v1/completions", json=body,
                                                                               timeout=120)))
        t.start()
        assert wait_until(lambda: workers["decode-0"].stats()["tokens_out"] > 2, 60)
        workers["decode-0"].stop()
        t.join(120)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "stopped responding" in r.json()["error"]["message"]


def test_more_requests_than_the_decode_pool_holds_all_finish():
    """On a live pair: the decode pool holds ~4 of these prompts; 10 arrive at once. Blocks are
    reserved before transfers are accepted, the rest wait (busy) and retry; all finish; nothing leaks."""
    engine = "num_blocks = 60\nmax_num_seqs = 16"
    with running_cluster(1, 1, loaded=fast_model(), engine=engine, routing=ALL_REMOTE) as (base, client, workers):
        # decoding holds each request's blocks for seconds, so the transfers outrun the pool whatever the
        # relative speed of prefill and decode on this CPU (without OpenBLAS a slower prefill never filled it)
        slow_steps(workers["decode-0"], 0.25)
        results = []
        prompts = [f"Case {i}: " + long_text(300) for i in range(10)]

        def one(p):
            r = httpx.post(base + "/v1/completions", timeout=300,
                           json={"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0})
            results.append(r.status_code)

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert results == [200] * 10
        assert wait_until(lambda: at_baseline(workers))
        assert wait_until(lambda: workers["decode-0"].stats()["reservations_busy"] > 0)


def test_requests_queued_at_the_prefill_worker_outlive_the_transfer_deadline():
    """The reliability soak's failure: long prompts queue at the prefill worker for longer than the KV
    transfer's inactivity deadline. The prefill worker offers a transfer only when it starts computing the
    prompt, so a queued request neither holds decode blocks nor times out; every request completes. (The prefill
    worker's steps are stretched to >= 0.25 s: the fast model alone would clear the queue in under a second.)"""
    with running_cluster(1, 1, loaded=fast_model(), engine="prefill_chunk_size = 64", routing=ALL_REMOTE,
                         transfer="timeout_s = 4") as (base, client, workers):
        slow_steps(workers["prefill-0"], 0.25)
        codes, reserved_at_once = [], []

        def one(i):
            r = httpx.post(base + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": f"Report {i}: " + long_text(700), "max_tokens": 4, "temperature": 0})
            codes.append(r.status_code)

        # the last waits for ~2.1k tokens of the others: 33 chunks of 64, over 8 s, twice the transfer deadline
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            reserved_at_once.append(workers["decode-0"].stats()["transfers_inflight"])
            time.sleep(0.1)
        assert codes == [200] * 4
        assert max(reserved_at_once) <= 2  # not all four reserved while they wait in the prefill queue
        sent = workers["prefill-0"].stats()
        assert sent["transfer_timeouts"] == 0 and sent["transfers_pending"] == 0
        assert wait_until(lambda: at_baseline(workers))


def test_decode_worker_death_before_any_token_reruns_the_request_elsewhere():
    """A decode worker dies while the prefill worker is still computing the prompt bound for it (nothing
    streamed yet): the router stops that prefill and re-runs the request on the other decode worker from
    the start; the client gets the whole answer, equal to single-node output. (The prefill worker's 10 chunks
    are stretched to seconds, so the decode worker dies while they compute.)"""
    prompt = "Summarize: " + long_text(600)
    with running_cluster(1, 2, loaded=fast_model(), engine="prefill_chunk_size = 64", routing=ALL_REMOTE) as (
            base, client, workers):
        slow_steps(workers["prefill-0"], 0.25)
        result = {}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        t = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(base + "/v1/completions", json=body, timeout=300)))
        t.start()
        assert wait_until(lambda: workers["prefill-0"].stats()["num_running"] > 0 and client.streams, 60)
        victim = next(iter(client.streams.values())).decode.spec.name
        workers[victim].stop()
        t.join(300)
        r = result["r"]
        assert r.status_code == 200, r.text
        _, tokenizer, _ = fast_model()
        assert r.json()["choices"][0]["text"] == reference_text(tokenizer.encode(prompt), 12)
        survivor = next(n for n in workers if n.startswith("decode") and n != victim)
        assert wait_until(lambda: workers[survivor].stats()["tokens_out"] > 0)
        assert wait_until(lambda: workers["prefill-0"].stats()["kv_blocks_free"]
                          == workers["prefill-0"].stats()["kv_blocks_total"], 60)
        assert all(not w.inflight for w in client.workers)


def test_router_metrics_sum_the_decode_workers_speculative_counters():
    """Speculative decoding runs on the decode workers; the router's /metrics adds up their draft and accepted
    token counters (they were always 0 in cluster mode). On the real model: prompt lookup drafts only once the
    answer repeats the prompt, which the random fast model's output never reliably does."""
    text = "alpha beta gamma delta epsilon zeta eta theta " * 6
    with running_cluster(0, 2) as (base, client, workers):
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "Repeat exactly: " + text, "max_tokens": 24, "temperature": 0,
            "speculative": {"method": "prompt_lookup", "num_draft_tokens": 4}})
        assert r.status_code == 200, r.text
        per_worker = lambda: sum(w.stats().get("num_draft_tokens", 0) for w in workers.values())  # noqa: E731
        assert wait_until(lambda: per_worker() > 0 and client.stats().num_draft_tokens == per_worker())
        metrics = httpx.get(base + "/metrics", timeout=10).text
        drafted = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith(PREFIX + "engine_draft_tokens_total")]
        assert drafted and drafted[0] == per_worker(), [ln for ln in metrics.splitlines() if "draft" in ln]

