"""Single-node mode and a cluster answer the same load the same way: single-node mode is the decode worker's
loop behind an in-process channel, so a request is admitted, refused with 503 and Retry-After, or refused with
400 by one rule in both (a worker holding one running and one queued sequence, the fast random-weight model)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx

from cluster.model import DEFAULT_MODEL as MODEL
from tests.cluster_helpers import running_cluster, slow_steps
from tests.engine_helpers import fast_model
from tests.live_server import live_server

LIMITS = {"max_num_seqs": 1, "max_waiting": 1, "max_model_len": 256}


@contextmanager
def single_node():
    """Yield (base_url, stats(), worker) of a single-node server with LIMITS."""
    with live_server(loaded=fast_model(), **LIMITS) as (base, client):
        yield base, client.stats, client.worker


@contextmanager
def decode_only_cluster():
    """Yield (base_url, stats(), worker) of an in-process cluster of one decode worker with LIMITS."""
    engine = "\n".join(f"{k} = {v}" for k, v in LIMITS.items())
    with running_cluster(prefill=0, decode=1, loaded=fast_model(), engine=engine) as (base, client, workers):
        yield base, client.stats, workers["decode-0"]


def answers_to_overload(mode) -> list:
    """Send, in order: A (streamed, runs), B (queued behind A), C (beyond the queue), D (a prompt over the
    context). Returns [(status, has Retry-After)] for A, B, C, D."""
    with mode() as (base, stats, worker):
        slow_steps(worker, 0.1)  # A's 20 tokens keep the one running slot for seconds
        statuses: dict[str, tuple] = {}

        def stream(name: str) -> None:
            body = {"model": MODEL, "prompt": f"{name} story", "max_tokens": 20, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
                statuses[name] = (r.status_code, "retry-after" in r.headers)

        def wait_for(what, predicate) -> None:
            deadline = time.monotonic() + 60
            while not predicate(stats()):
                assert time.monotonic() < deadline, f"never {what}: {stats()}"
                time.sleep(0.02)

        threads = [threading.Thread(target=stream, args=(name,)) for name in "AB"]
        threads[0].start()
        wait_for("running A", lambda s: s.num_running == 1)
        threads[1].start()
        wait_for("queued B", lambda s: s.num_waiting == 1)
        body = {"model": MODEL, "prompt": "C story", "max_tokens": 4}
        c = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert stats().num_running == 1 and stats().num_waiting == 1  # C was answered while A ran and B waited
        d = httpx.post(base + "/v1/completions", json={**body, "prompt": "word " * 300}, timeout=60)
        for t in threads:
            t.join(120)
        assert c.status_code != 503 or "queue" in c.json()["error"]["message"], c.text
        assert d.status_code != 400 or "context" in d.json()["error"]["message"], d.text
        return [statuses["A"], statuses["B"], (c.status_code, "retry-after" in c.headers),
                (d.status_code, "retry-after" in d.headers)]


def test_single_node_and_cluster_give_the_same_answers_to_the_same_overload():
    expected = [(200, False), (200, False), (503, True), (400, False)]
    assert answers_to_overload(single_node) == expected
    assert answers_to_overload(decode_only_cluster) == expected
