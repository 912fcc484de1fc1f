"""Requests against a test cluster (tests/cluster_helpers.py) and the single-node answers they must equal:
chats, long prompts, a client that leaves, a request in the background, and waits with deadlines."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time

import httpx

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


def post_in_background(url: str, body: dict, timeout_s: float = 120):
    """POST `body` to `url` on a thread; returns a function that waits for the response (at most `timeout_s`)."""
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url, json=body, timeout=timeout_s)))
    t.start()

    def answer() -> httpx.Response:
        t.join(timeout_s)
        assert "r" in result, f"no answer from {url} within {timeout_s} s"
        return result["r"]

    return answer


def at_baseline(workers) -> bool:
    return all(s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0
               and s.transfers_inflight == 0 for s in (w.stats() for w in workers.values()))
