"""The client side of the lab's fault table (benchmarks/lab/faults.py): requests and the router's view, seen
from the client host.

`Client` sends OpenAI completions from the client host's network namespace: its threads enter that namespace
(setns(2) with CLONE_NEWNET, which Linux applies to the calling thread only), so every connection starts
there and crosses the client's shaped link, as from a laptop of a real lab, while the rest of the process
stays in this machine's namespace (where `ip` and `kill` act on the lab). Each request is recorded as a dict
(`new_record`) on one clock (`Client.now()`, seconds since the client was made), which the faults share.

`Watch` polls the router's `/dashboard/api/state` every `interval_s` from the same namespace and keeps the
router's view of each worker: when its `alive` flag changed, the most requests in flight it had, its last
`tokens_out`.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import httpx

from benchmarks.sse import DONE, SSEParser

CLONE_NEWNET = 0x40000000  # <sched.h>
STATE_PATH = "/dashboard/api/state?since=1e12"  # the state without its history samples (none is that new)


def enter_namespace(ns: str) -> None:
    """Move the calling thread into network namespace `ns` (`ip netns` name); OSError when it cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns} failed")


def wait_until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll `pred` until it is true (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def new_record(tag: str, max_tokens: int, stream: bool, t: float) -> dict:
    """What one request saw: `status` (None: no answer), `retry_after` (the header), `ttft_s` (after sending,
    to the first text), `first_at` / `end_s` (on the client's clock), `chunks` (with text), `max_gap_s` (the
    longest wait between them), `tokens` (usage's completion_tokens), `finish`, `errors` (SSE error events:
    {"code", "message"}), `body` (a non-200 answer's start), `exception` (no answer: connection or timeout)."""
    return {"tag": tag, "stream": stream, "max_tokens": max_tokens, "sent_at": t, "status": None,
            "retry_after": None, "ttft_s": None, "first_at": None, "end_s": None, "chunks": 0, "max_gap_s": 0.0,
            "tokens": None, "finish": None, "errors": [], "body": None, "exception": None}


def complete(rec: dict) -> bool:
    """The request got all its tokens: 200, `max_tokens` tokens (ignore_eos), finish "length", no error."""
    return (rec["status"] == 200 and rec["tokens"] == rec["max_tokens"] and rec["finish"] == "length"
            and not rec["errors"] and rec["exception"] is None)


class Client:
    """HTTP to the lab's router from the client host (see the module docstring); `threads` requests at once."""

    def __init__(self, ns: str, base_url: str, api_key: str, model: str, threads: int = 24,
                 read_timeout_s: float = 60.0):
        self.base, self.model, self.read_timeout_s = base_url.rstrip("/"), model, read_timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="lab-client", initializer=enter_namespace,
                                       initargs=(ns,))
        self.records: list[dict] = []
        self._local = threading.local()
        self._t0 = time.monotonic()

    def now(self) -> float:
        """Seconds on the client's clock (since it was made)."""
        return time.monotonic() - self._t0

    def _http(self) -> httpx.Client:
        if getattr(self._local, "http", None) is None:
            self._local.http = httpx.Client(headers=self.headers, timeout=httpx.Timeout(
                self.read_timeout_s, connect=10.0))
        return self._local.http

    def get_json(self, path: str, timeout_s: float = 5.0) -> tuple[Optional[int], Optional[dict]]:
        """(status, JSON body or None) of GET `path`; (None, None) without an answer."""
        return self.pool.submit(self.get_here, path, timeout_s).result(timeout=timeout_s + 30)

    def get_here(self, path: str, timeout_s: float) -> tuple[Optional[int], Optional[dict]]:
        """`get_json` on the calling thread, which must be one of the pool's (in the client's namespace)."""
        try:
            r = self._http().get(self.base + path, timeout=timeout_s)
        except httpx.HTTPError:
            return None, None
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, None

    def state(self) -> Optional[dict]:
        """The router's `/dashboard/api/state`, or None when it does not answer 200."""
        status, body = self.get_json(STATE_PATH)
        return body if status == 200 else None

    def send(self, tag: str, prompt: str, max_tokens: int, stream: bool = True) -> tuple[dict, Future]:
        """POST /v1/completions (greedy, ignore_eos, usage in the stream): (its record, appended to `records` at
        once and filled in as the answer arrives; a Future that is done when it is)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        rec = new_record(tag, max_tokens, stream, self.now())
        self.records.append(rec)
        return rec, self.pool.submit(self._run, rec, body)

    def _run(self, rec: dict, body: dict) -> dict:
        t0, last = time.monotonic(), None
        try:
            with self._http().stream("POST", f"{self.base}/v1/completions", json=body) as r:
                rec["status"], rec["retry_after"] = r.status_code, r.headers.get("retry-after")
                if r.status_code != 200 or not rec["stream"]:
                    data = r.read().decode(errors="replace")
                    if r.status_code != 200:
                        rec["body"] = data[:300]
                    else:
                        answer = json.loads(data)
                        rec["tokens"] = answer["usage"]["completion_tokens"]
                        rec["finish"] = answer["choices"][0]["finish_reason"]
                        rec["ttft_s"] = time.monotonic() - t0
                    return rec
                parser = SSEParser()
                for data in (d for line in r.iter_lines() for d in parser.feed(line)):
                    if data == DONE:
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec["errors"].append({k: chunk["error"].get(k) for k in ("code", "message")})
                    rec["tokens"] = (chunk.get("usage") or {}).get("completion_tokens", rec["tokens"])
                    for choice in chunk.get("choices", []):
                        rec["finish"] = choice.get("finish_reason") or rec["finish"]
                        if choice.get("text"):
                            now = time.monotonic()
                            if last is None:
                                rec["ttft_s"], rec["first_at"] = now - t0, self.now()
                            else:
                                rec["max_gap_s"] = max(rec["max_gap_s"], now - last)
                            last = now
                            rec["chunks"] += 1
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            rec["exception"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            rec["end_s"] = self.now()
        return rec

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Watch:
    """The router's view of its workers over time (see the module docstring); `start()`, then `stop()`."""

    def __init__(self, client: Client, interval_s: float = 0.25):
        self.client, self.interval_s = client, interval_s
        self.alive: dict[str, bool] = {}
        self.changes: list[tuple[float, str, bool]] = []  # (client time, worker, alive)
        self.peak_inflight: dict[str, int] = {}
        self.tokens_out: dict[str, int] = {}
        self._stop = threading.Event()
        self._future: Optional[Future] = None

    def start(self) -> "Watch":
        self._future = self.client.pool.submit(self._loop)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._future is not None:
            self._future.result(timeout=30)

    def reset_peaks(self) -> None:
        """Forget the peak of requests in flight seen so far (a fault's window starts)."""
        self.peak_inflight = {}

    def went(self, name: str, alive: bool, since: float) -> Optional[float]:
        """When (client time) the router's view of `name` first became `alive` at or after `since`."""
        return next((t for t, n, a in self.changes if n == name and a is alive and t >= since), None)

    def _poll(self) -> None:
        status, state = self.client.get_here(STATE_PATH, 5.0)
        if status != 200 or state is None:
            return
        t = self.client.now()
        for w in state.get("workers", []):
            name, alive = w["name"], bool(w["alive"])
            if self.alive.get(name) is not alive:
                self.changes.append((t, name, alive))
            self.alive[name] = alive
            self.peak_inflight[name] = max(self.peak_inflight.get(name, 0), w.get("inflight") or 0)
            if w.get("tokens_out") is not None:
                self.tokens_out[name] = w["tokens_out"]

    def _loop(self) -> None:  # on a thread of the client's pool
        while not self._stop.wait(self.interval_s):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - a router down for a moment is what some faults do
                pass
