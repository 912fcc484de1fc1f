"""One HTTP request of the reliability harness, classified into an outcome (benchmarks/reliability_report.py).

    reply = await send(client, base_url, "/v1/chat/completions", body, headers, disconnect_after=2)
    reply.outcome  # completed | disconnected | error | refused | lost

`classify_stream(events)` is the pure part: from the SSE events of a finished stream to text, finish reason,
usage, error and whether it ended properly.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Optional

import httpx


@dataclass
class Reply:
    outcome: str
    status: int = 0
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    error: Optional[str] = None
    retry_after: Optional[str] = None
    events: int = 0
    elapsed_s: float = 0.0

    def describe(self) -> str:
        return (f"{self.outcome} status={self.status} finish={self.finish_reason} events={self.events} "
                f"error={(self.error or '')[:160]!r}")


def _choice_text(choice: dict) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text") or ""


def classify_stream(datas: list[str]) -> Reply:
    """The reply of a complete SSE stream given its event data strings (after `data: `)."""
    r = Reply(outcome="lost", status=200)
    done = False
    for data in datas:
        if data == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            r.error = f"unparsable event {data[:80]!r}"
            continue
        if "error" in obj:
            err = obj["error"]
            r.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            continue
        for choice in obj.get("choices") or []:
            r.events += 1
            r.text += _choice_text(choice)
            r.finish_reason = choice.get("finish_reason") or r.finish_reason
        if obj.get("usage"):
            r.completion_tokens = obj["usage"].get("completion_tokens")
    if r.error is not None:
        r.outcome = "error"
    elif done and r.finish_reason is not None:
        r.outcome = "completed"
    else:
        r.error = f"the stream ended without {'a finish reason' if done else '[DONE]'}"
    return r


def classify_json(status: int, body: bytes, retry_after: Optional[str]) -> Reply:
    """The reply of a non-streamed answer (or of a stream refused before it started)."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if status != 200:
        msg = obj.get("error", {}).get("message") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) \
            else body[:200].decode("utf-8", "replace")
        outcome = "refused" if status == 503 and retry_after else "error"
        return Reply(outcome, status, error=f"HTTP {status}: {msg}", retry_after=retry_after)
    if not isinstance(obj, dict) or not obj.get("choices"):
        return Reply("lost", status, error=f"a 200 answer without choices: {body[:120]!r}")
    choice = obj["choices"][0]
    usage = obj.get("usage") or {}
    r = Reply("completed", status, text=_choice_text(choice), finish_reason=choice.get("finish_reason"),
              completion_tokens=usage.get("completion_tokens"), events=1)
    if r.finish_reason in (None, "error", "abort"):
        r.outcome, r.error = "error", f"finish_reason {r.finish_reason!r}"
    return r


async def send(client: httpx.AsyncClient, base_url: str, path: str, body: dict, headers: Optional[dict] = None,
               *, disconnect_after: Optional[int] = None, timeout_s: float = 300.0) -> Reply:
    """POST `body`; streams when body["stream"]. `disconnect_after`: close the connection after that many
    chunks (outcome "disconnected"). A transport error or no end within `timeout_s` is "lost"."""
    t0 = time.monotonic()
    try:
        r = await asyncio.wait_for(_send(client, base_url + path, body, headers or {}, disconnect_after), timeout_s)
    except asyncio.TimeoutError:
        r = Reply("lost", error=f"no end within {timeout_s:.0f} s")
    except httpx.HTTPError as exc:
        r = Reply("lost", error=f"{type(exc).__name__}: {exc}")
    r.elapsed_s = time.monotonic() - t0
    return r


async def _send(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
                disconnect_after: Optional[int]) -> Reply:
    if not body.get("stream"):
        resp = await client.post(url, json=body, headers=headers)
        return classify_json(resp.status_code, resp.content, resp.headers.get("retry-after"))
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            return classify_json(resp.status_code, await resp.aread(), resp.headers.get("retry-after"))
        datas, chunks = [], 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            datas.append(data)
            if data.startswith("{") and '"choices"' in data:
                chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                r = classify_stream(datas)
                r.outcome, r.error = "disconnected", None
                return r  # leaving the `async with` closes the connection mid-stream
    return classify_stream(datas)
