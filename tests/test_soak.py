"""A short soak (the long one is `mlx-pd bench reliability`): mixed requests on an in-process
1P2D cluster, concurrently — short chats, multi-tenant shared system prompts over two turns, long prompts,
deliberate disconnects — every greedy answer equal to the single-node engine's answer for the same request,
no error besides the deliberate disconnects, and every worker back at its KV baseline afterwards. Cluster and
reference serve the fast random-weight model (tests.engine_helpers.fast_model)."""

from __future__ import annotations

import json
import random
import threading

import httpx

from tests.cluster_helpers import running_cluster
from tests.engine_helpers import fast_model, greedy, make_engine, run
from tests.cluster_requests import MODEL, at_baseline, long_text, wait_until

TENANTS = ["You are a terse assistant for a shipping company. Answer in one short sentence. " * 6,
           "You are a friendly tutor who explains science to children, using simple words. " * 6]
QUESTIONS = ["What is a tide?", "Why is the sky blue?", "How do ships float?", "What is rust?",
             "Where do clouds come from?", "What is a harbour?"]


def workload(seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i, q in enumerate(QUESTIONS):
        jobs.append({"kind": "chat", "messages": [{"role": "user", "content": q}]})
        system = TENANTS[i % 2]
        first = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        jobs.append({"kind": "tenant", "messages": first})
        jobs.append({"kind": "tenant-turn-2", "messages": first + [
            {"role": "assistant", "content": "Good question."}, {"role": "user", "content": "Say more."}]})
    for i in range(3):
        jobs.append({"kind": "long", "messages": [{"role": "user", "content": f"Summarize ({i}): " + long_text(500)}]})
    for i in range(4):
        jobs.append({"kind": "disconnect", "messages": [{"role": "user", "content": f"Tell a long story {i}."}]})
    rng.shuffle(jobs)
    return jobs


def reference(jobs: list[dict]) -> dict[int, str]:
    """Single-node answers, one request at a time (greedy, 20 tokens)."""
    _, tokenizer, _ = fast_model()
    engine = make_engine(loaded=fast_model(), kv_cache_gb=0.25)
    out = {}
    for i, job in enumerate(jobs):
        if job["kind"] != "disconnect":
            ids = tokenizer.apply_chat_template(job["messages"], add_generation_prompt=True)
            out[i] = run(engine, [greedy(f"ref{i}", ids, 20)])[f"ref{i}"].text
    return out


def test_short_soak_on_1p2d_equals_single_node_and_leaks_nothing():
    jobs = workload()
    refs = reference(jobs)
    results: dict[int, object] = {}
    with running_cluster(1, 2, loaded=fast_model(), routing="local_prefill_max_tokens = 128") as (
            base, client, workers):
        def one(i: int, job: dict) -> None:
            body = {"model": MODEL, "messages": job["messages"], "max_tokens": 20, "temperature": 0}
            if job["kind"] == "disconnect":
                with httpx.stream("POST", base + "/v1/chat/completions", timeout=300,
                                  json={**body, "max_tokens": 200, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                            break  # leave after the first token
                results[i] = "left"
                return
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
            results[i] = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r

        sem = threading.Semaphore(4)

        def guarded(i, job):
            with sem:
                one(i, job)

        threads = [threading.Thread(target=guarded, args=(i, job)) for i, job in enumerate(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        errors = {i: r for i, r in results.items() if isinstance(r, httpx.Response)}
        assert errors == {} and len(results) == len(jobs)
        mismatches = {i: (results[i], refs[i]) for i in refs if results[i] != refs[i]}
        assert mismatches == {}
        assert wait_until(lambda: at_baseline(workers))
        assert not client.streams and all(not w.inflight for w in client.workers)
