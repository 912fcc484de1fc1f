"""Hardening on a live in-process cluster: garbage on every cluster socket is rejected and the workers keep
serving with nothing leaked; with CurveZMQ keys configured, every cluster socket refuses a peer without them.
Every cluster serves the fast random-weight model (tests.engine_helpers.fast_model); "still serving" means a
chat's answer equals its single-node greedy answer."""

from __future__ import annotations

import json
import random
import time

import httpx
import msgpack
import zmq

from cluster.protocol import AbortRequest, Generate, Ping, pack
from cluster.transport import client_socket, generate_keys
from tests.cluster_helpers import running_cluster, slow_steps
from tests.engine_helpers import fast_model
from tests.cluster_requests import MODEL, QUESTIONS, assert_still_serving, at_baseline, chat, wait_until


def _generate(request: dict, **fields) -> bytes:
    """A generate frame with `request` as it is (a client may send one that does not validate)."""
    return msgpack.packb({"version": 1, "type": "generate", "request": request, **fields})


def _garbage(rng: random.Random) -> list[list[bytes]]:
    """Random, truncated, oversized-looking and mutated control/KV messages (each a list of frames)."""
    valid = pack(Generate(request={"request_id": "g", "prompt_token_ids": [1, 2, 3], "sampling": {}}))
    out = [[rng.randbytes(rng.randint(0, 64))] for _ in range(40)]
    out += [[valid[:k]] for k in range(0, len(valid), 7)]  # truncated
    out += [[bytes(b ^ (1 << rng.randint(0, 7)) if rng.random() < 0.1 else b for b in valid)] for _ in range(40)]
    out += [[msgpack.packb({"version": 2, "type": "ping", "seq": 1})],  # wrong version
            [msgpack.packb({"version": 1, "type": "launch_missiles"})],  # unknown type
            [pack(AbortRequest(request_id="never-seen"))],  # unknown request id
            [_generate({"request_id": "x", "prompt_token_ids": [], "sampling": {}})],  # empty prompt
            [_generate({"request_id": "y", "prompt_token_ids": [10**9], "sampling": {}},
                       prefilled=True)],  # token id outside the vocabulary
            [_generate({"request_id": "z", "prompt_token_ids": [1], "sampling": {"max_tokens": -5}})],
            [pack(Ping(seq=1)), b"extra frame"], [b""], [b"\x00" * 100_000]]
    return out


def test_garbage_on_every_cluster_socket_is_rejected_and_the_workers_keep_serving():
    rng = random.Random(7)
    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 0") as (
            base, client, workers):
        ctx = zmq.Context()
        endpoints = [w.endpoints[k] for w in workers.values() for k in ("control", "kv") if w.endpoints.get(k)]
        sent = 0
        try:
            for endpoint in endpoints:
                sock = client_socket(ctx, zmq.DEALER, endpoint)
                for frames in _garbage(rng):
                    sock.send_multipart(frames)
                    sent += 1
                time.sleep(0.5)
                sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        assert sent > 300  # about 100 per socket (control x2, KV)
        assert all(w.healthy for w in workers.values())
        assert_still_serving(base)
        assert wait_until(lambda: at_baseline(workers))


def test_curve_keys_are_required_on_every_cluster_socket(tmp_path):
    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 0",
                         security=f'curve_keys_dir = "{keys_dir}"') as (base, client, workers):
        assert_still_serving(base)  # keys work end to end
        ctx = zmq.Context()
        try:
            decode = workers["decode-0"]
            control = client_socket(ctx, zmq.DEALER, decode.endpoints["control"])  # no keys
            try:
                control.send(pack(Ping(seq=1)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the worker already refused the handshake: there is no connection to queue the ping on
            assert not control.poll(1500)  # never answered
            sub = client_socket(ctx, zmq.SUB, decode.endpoints["events"])
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            chat(base, QUESTIONS[1])  # makes KV events
            assert not sub.poll(1500)  # nothing delivered without the keys
            for sock in (control, sub):
                sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        r = httpx.get(base + "/health", timeout=10)
        assert r.status_code == 200


def test_overload_beyond_the_queue_bound_gets_503_with_retry_after():
    """Overload on a cluster: beyond max_num_seqs running + max_waiting queued, requests get 503 with
    Retry-After at once (nothing lost: each either completes or is refused before it runs). The decode worker's
    steps are stretched to >= 50 ms, so that a request lasts over a second (as on the real model) and the eight
    arrive while the first two hold the bound."""
    import threading

    with running_cluster(1, 1, loaded=fast_model(), engine="max_num_seqs = 1\nmax_waiting = 1") as (
            base, client, workers):
        slow_steps(workers["decode-0"], 0.05)
        codes, retry = [], []

        def one(i):
            r = httpx.post(base + "/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 24, "ignore_eos": True})
            codes.append(r.status_code)
            if r.status_code == 503:
                retry.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(set(codes)) == [200, 503] and len(codes) == 8
        assert all(r is not None and float(r) > 0 for r in retry)
        assert wait_until(lambda: at_baseline(workers))
        # one request asking for more choices than the cluster could ever hold (1 running + 1 queued): 400, not
        # a 503 that no retry could cure
        r = httpx.post(base + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": "Hi", "n": 3,
                                                                     "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "lower n" in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", timeout=120, json={"model": MODEL, "prompt": "Hi", "n": 2,
                                                                     "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def _answers(sock, n: int, timeout_s: float) -> list:
    """Up to `n` messages from a worker's control socket, decoded, within `timeout_s`."""
    from cluster.protocol import PROTOCOL_VERSION, TO_ROUTER, unpack

    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        out.append(unpack(sock.recv_multipart()[0], TO_ROUTER, PROTOCOL_VERSION))
    return out


BAD_FIELD_TYPES = [  # well-formed messages whose request has a field of the wrong type: each must get a 400
    {"prompt_token_ids": "abc"}, {"prompt_token_ids": [True, 2]}, {"prompt_token_ids": [1.5]},
    {"prompt_token_ids": [[1], [2]]}, {"cache_salt": 7}, {"arrival_time": "now"},
    {"sampling": {"stop_token_ids": ["x"]}}, {"sampling": {"ignore_eos": "yes"}},
    {"sampling": {"stop": [3]}}, {"sampling": {"temperature": "hot"}}, {"sampling": {"logit_bias": [["a", 1]]}},
]


def test_generate_with_fields_of_the_wrong_type_is_answered_400_and_leaves_nothing():
    """Wire fuzz of the kind the reliability run found (a string prompt reached the engine and raised a
    TypeError nobody answered): every worker answers each such request 400 `rejected`, keeps no route for it,
    and serves afterwards."""
    from cluster.protocol import Rejected

    with running_cluster(1, 1, loaded=fast_model(), routing="local_prefill_max_tokens = 0") as (
            base, client, workers):
        ctx = zmq.Context()
        try:
            for w in workers.values():
                sock = client_socket(ctx, zmq.DEALER, w.endpoints["control"])
                for i, bad in enumerate(BAD_FIELD_TYPES):
                    request = {"request_id": f"bad-{i}", "prompt_token_ids": [1, 2, 3], "sampling": {}}
                    request.update({k: v for k, v in bad.items() if k != "sampling"})
                    request["sampling"] = bad.get("sampling", {})
                    sock.send(_generate(request, prefilled=w.role == "decode",
                                        decode_endpoint=None if w.role == "decode" else "tcp://127.0.0.1:9"))
                got = _answers(sock, len(BAD_FIELD_TYPES), 10)
                sock.close(linger=0)
                assert [type(m) for m in got] == [Rejected] * len(BAD_FIELD_TYPES), (w.name, got)
                assert sorted(m.request_id for m in got) == sorted(f"bad-{i}" for i in range(len(BAD_FIELD_TYPES)))
                assert all(m.status == 400 for m in got), got
                assert not w.routes, w.routes
        finally:
            ctx.destroy(linger=0)
        assert_still_serving(base)


def test_prefilled_request_whose_kv_never_comes_fails_at_its_deadline():
    """A decode worker told to expect KV that no prefill worker ever sends holds the request (no blocks)
    until a transfer could no longer start (`TransferConfig.kv_start_deadline_s`: here 1 s in the prefill
    queue + 2 s of "busy" retries + 2 s for the offer), then answers an error: nothing waits forever."""
    from cluster.protocol import Output
    from cluster.request import FinishReason

    with running_cluster(1, 1, loaded=fast_model(), engine="queue_timeout_s = 1", transfer="timeout_s = 2") as (
            base, client, workers):
        decode = workers["decode-0"]
        ctx = zmq.Context()
        try:
            sock = client_socket(ctx, zmq.DEALER, decode.endpoints["control"])
            request = {"request_id": "orphaned", "prompt_token_ids": list(range(1, 40)), "sampling": {}}
            sock.send(pack(Generate(request=request, prefilled=True)))
            assert wait_until(lambda: decode.stats().awaiting_kv == 1)
            start = time.monotonic()
            got = _answers(sock, 1, 15)
            waited = time.monotonic() - start
            sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        assert len(got) == 1 and isinstance(got[0], Output), got
        assert got[0].output.finish_reason == FinishReason.ABORT and "never started" in got[0].output.error
        assert 3.5 < waited < 12, waited
        assert not decode.routes and wait_until(lambda: decode.stats().awaiting_kv == 0)  # stats lag a step


def test_a_transfer_that_cannot_start_fails_its_request_and_frees_its_blocks():
    """If opening a KV transfer fails on the prefill worker (here: the sender raises), that request ends with an
    error, no other request is affected, and its blocks are freed, for a one-chunk prompt (handed off in the
    step that opens the transfer) and a multi-chunk one. A decode endpoint that is not an endpoint is a 400
    before anything runs."""
    from cluster.protocol import Rejected
    from tests.cluster_requests import long_text

    with running_cluster(1, 1, loaded=fast_model(), engine="prefill_chunk_size = 64",
                         routing="local_prefill_max_tokens = 0") as (base, client, workers):
        prefill = workers["prefill-0"]
        real_open = prefill.sender.open

        def broken_open(*args, **kwargs):
            raise RuntimeError("simulated failure")

        prefill.sender.open = broken_open
        try:
            for prompt in ("Once upon a time", long_text(300)):
                r = httpx.post(base + "/v1/completions", timeout=120,
                               json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
                assert r.status_code >= 500 and "could not start the KV transfer" in r.text, r.text
        finally:
            prefill.sender.open = real_open
        assert wait_until(lambda: at_baseline(workers)), [w.stats() for w in workers.values()]
        assert not prefill.handoffs.requests and not prefill.routes
        assert_still_serving(base)

        ctx = zmq.Context()
        try:
            sock = client_socket(ctx, zmq.DEALER, prefill.endpoints["control"])
            request = {"request_id": "bad-endpoint", "prompt_token_ids": [1, 2, 3], "sampling": {}}
            sock.send(pack(Generate(request=request, decode_endpoint="not an endpoint")))
            got = _answers(sock, 1, 10)
            sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)
        assert len(got) == 1 and isinstance(got[0], Rejected) and got[0].status == 400, got


def test_a_decode_worker_declared_dead_but_alive_stops_the_migrated_request():
    """The router declares a decode worker dead (its heartbeat deadline; here forced) while it streams: the
    request moves to the other decode worker and completes in full, and the first worker, which was only
    silent, is told to stop it instead of generating to max_tokens for nobody. (Decode steps are stretched to
    >= 20 ms, so that the first worker could not have finished the 300 tokens by itself meanwhile.)"""
    with running_cluster(0, 2, loaded=fast_model()) as (base, client, workers):
        for name in ("decode-0", "decode-1"):
            slow_steps(workers[name], 0.02)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        usage, moved_from = None, None
        with httpx.stream("POST", base + "/v1/completions", timeout=300, json=body) as r:
            for n, line in enumerate(r.iter_lines()):
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                usage = event.get("usage") or usage
                if moved_from is None and n >= 10:
                    stream = next(iter(client.streams.values()))
                    moved_from = stream.decode
                    loop = client._tasks[0].get_loop()
                    loop.call_soon_threadsafe(client._mark_dead, moved_from)
                    old = workers[moved_from.spec.name]
                    assert wait_until(lambda: old.stats().num_running == 0 and not old.routes), old.stats()
                    assert old.stats().tokens_out < 300, old.stats()  # stopped, not finished
        assert moved_from is not None and usage["completion_tokens"] == 300
