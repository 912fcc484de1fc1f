"""Cluster mode end to end, workers in-process (tests/cluster_helpers.py): disaggregated output equals
single-node output token for token; disconnects; no leaked blocks (dead workers: tests/test_worker_death.py). The same worker
classes run as Ray actors under `mlx-pd up` (tests/test_launch.py).

Every cluster here serves the fast random-weight model (tests.engine_helpers.fast_model) and checks answers
against its single-node greedy output, except the speculative-counter test, whose drafts need the real model
repeating its prompt. Where a test acts while a prefill runs or needs a request to outlast an action, it
stretches the workers' steps (`slow_steps`) instead of relying on the real model's slowness."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cluster.stats_metrics import PREFIX
from tests.cluster_helpers import running_cluster, slow_steps
from tests.cluster_requests import (ALL_REMOTE, MODEL, QUESTIONS, assert_still_serving, at_baseline, chat,
                                    chat_ids, long_text, post_and_leave, reference_text, wait_until)
from tests.engine_helpers import fast_model


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
        assert wait_until(lambda: workers["prefill-0"].stats().kv_blocks_sent >= moved)
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
        assert "".join(parts) == full and wait_until(lambda: workers["decode-0"].stats().tokens_out > 0)
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
        assert workers["prefill-0"].stats().kv_bytes_sent == 0
        from cluster.launch.workers import probe_worker  # what tools see: the stats a ping returns

        assert probe_worker(workers["decode-0"].endpoints["control"])["tokens_out"] > 0


def test_prompt_longer_than_the_context_is_400_before_any_transfer():
    with running_cluster(1, 1, loaded=fast_model(), engine="max_model_len = 256", routing=ALL_REMOTE) as (
            base, client, workers):
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": long_text(400), "max_tokens": 4})
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        assert workers["prefill-0"].stats().kv_bytes_sent == 0 and not client.streams


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
                           until=lambda: workers["prefill-0"].stats().kv_blocks_sent > 0)
        else:
            with httpx.stream("POST", base + "/v1/completions", timeout=300, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break
        # the response is closed: the router aborts on both workers
        assert wait_until(lambda: at_baseline(workers)), [w.stats() for w in workers.values()]
        assert not client.streams and all(not w.inflight for w in client.workers)
        out = {n: w.stats().tokens_out for n, w in workers.items()}  # as fresh as the baseline seen
        if when == "during_prefill":  # the client left while the prompt computed: no token anywhere
            assert out == {"prefill-0": 0, "decode-0": 0}, out
        else:  # the decode worker stopped short of max_tokens (the first token came from the prefill worker)
            assert out["decode-0"] < max_tokens - 1, out
        assert_still_serving(base)


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
        assert wait_until(lambda: workers["decode-0"].stats().reservations_busy > 0)


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
            reserved_at_once.append(workers["decode-0"].stats().transfers_inflight)
            time.sleep(0.1)
        assert codes == [200] * 4
        assert max(reserved_at_once) <= 2  # not all four reserved while they wait in the prefill queue
        sent = workers["prefill-0"].stats()
        assert sent.transfer_timeouts == 0 and sent.transfers_pending == 0
        assert wait_until(lambda: at_baseline(workers))


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
        per_worker = lambda: sum(w.stats().num_draft_tokens for w in workers.values())  # noqa: E731
        assert wait_until(lambda: per_worker() > 0 and client.stats().num_draft_tokens == per_worker())
        metrics = httpx.get(base + "/metrics", timeout=10).text
        drafted = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith(PREFIX + "draft_tokens_total")]
        assert drafted and drafted[0] == per_worker(), [ln for ln in metrics.splitlines() if "draft" in ln]

