"""Async load generator for any OpenAI-compatible endpoint (streaming chat completions).

    cfg = WorkloadConfig(url="http://127.0.0.1:8000", max_tokens=64)
    result = asyncio.run(run_benchmark(cfg, num_requests=32, concurrency=8, seed=0))
    result["summary"]["ttft_s"]["p99"]

Each request is ``POST /v1/chat/completions`` with ``stream: true``, ``temperature: 0``,
``ignore_eos: true`` (servers that do not know it, like mlx_lm.server, ignore it), ``max_tokens``
and ``stream_options.include_usage``; optionally ``logit_bias`` -100 on the EOS ids, which makes
servers without ``ignore_eos`` produce ``max_tokens`` tokens too. A prompt is a user message's text or a
tuple of chat messages (the workloads of benchmarks/scenarios.py). Prompts come from
``benchmarks/prompts.jsonl`` and are made unique per request with a prefix like ``[req 4f2a1c] ``
(unless ``shared_prefix``), so that the prefix cache does not turn the benchmark into a cache
benchmark. A warm-up (not measured) runs first. Requests go out at a fixed concurrency (closed
loop) or as a Poisson process of ``rate`` requests/s (open loop; ``concurrency`` then caps the
requests in flight when given).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence, Union

import httpx

from benchmarks.sse import SSEParser, parse_chunk
from benchmarks.stats import RequestRecord, summarize

PROMPTS_PATH = Path(__file__).with_name("prompts.jsonl")
Prompt = Union[str, tuple]  # a user message's text, or a whole tuple of {"role", "content"} messages


def prompt_key(prompt: Prompt) -> str:
    """One string naming a request's prompt (its record's `prompt`; matches answers across servers)."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(f"[{m['role']}] {m['content']}" for m in prompt)


def messages(prompt: Prompt) -> list[dict]:
    """The chat messages sent for `prompt`."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


@dataclass(frozen=True)
class WorkloadConfig:
    """What every request of a run looks like and where it goes.

    `url` may be the server root (``http://host:port``), the ``/v1`` base, or the full
    ``/v1/chat/completions`` address. `model` None leaves the field out (both mlx-pd and
    mlx_lm.server then use their one model).
    """

    url: str
    model: Optional[str] = None
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    suppress_token_ids: tuple[int, ...] = ()  # sent as logit_bias -100: equal lengths on servers without ignore_eos

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def endpoint(self) -> str:
        """The chat completions address derived from `url`."""
        url = self.url.rstrip("/")
        if url.endswith("/chat/completions"):
            return url
        if url.endswith("/v1"):
            return url + "/chat/completions"
        return url + "/v1/chat/completions"

    def body(self, prompt: Prompt) -> dict:
        """The JSON body for one prompt (a user message's text, or a tuple of messages)."""
        body = {"messages": messages(prompt), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.suppress_token_ids:
            body["logit_bias"] = {str(t): -100.0 for t in self.suppress_token_ids}
        if self.model:
            body["model"] = self.model
        return body


def load_prompts(path: Optional[Path] = None) -> list[str]:
    """The prompt texts of a JSONL file (one ``{"prompt": ...}`` object a line)."""
    lines = Path(path or PROMPTS_PATH).read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path or PROMPTS_PATH}")
    return prompts


def make_prompts(n: int, seed: int = 0, *, shared_prefix: bool = False, tag: str = "req",
                 base: Optional[Sequence[str]] = None) -> list[str]:
    """`n` prompts cycled over a seeded shuffle of `base`, each with a unique ``[tag xxxxxx] `` prefix.

    With `shared_prefix` the prompts are returned bare (repeats hit the prefix cache on purpose).
    The same (n, seed, tag) always gives the same list.
    """
    rng = random.Random(f"{seed}:{tag}")
    pool = list(base if base is not None else load_prompts())
    rng.shuffle(pool)
    texts = [pool[i % len(pool)] for i in range(n)]
    if shared_prefix:
        return texts
    seen: set[str] = set()
    out = []
    for text in texts:
        ident = f"{rng.getrandbits(24):06x}"
        while ident in seen:
            ident = f"{rng.getrandbits(24):06x}"
        seen.add(ident)
        out.append(f"[{tag} {ident}] {text}")
    return out


async def send_request(client: httpx.AsyncClient, cfg: WorkloadConfig, index: int, prompt: Prompt,
                       t0: float) -> RequestRecord:
    """Send one streaming request and time it; never raises for server or network errors."""
    rec = RequestRecord(index=index, prompt=prompt_key(prompt))
    start = time.perf_counter()
    rec.start_s = start - t0
    last = None
    parts: list[str] = []
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        async with client.stream("POST", cfg.endpoint, json=cfg.body(prompt), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:500]}"
                return rec
            parser = SSEParser()
            async for line in resp.aiter_lines():
                for data in parser.feed(line):
                    chunk = parse_chunk(data)
                    now = time.perf_counter()
                    if chunk.error:
                        rec.error = chunk.error
                    if chunk.usage_tokens is not None:
                        rec.usage_tokens = chunk.usage_tokens
                        rec.prompt_tokens, rec.cached_tokens = chunk.prompt_tokens, chunk.cached_tokens
                    if chunk.finish_reason:
                        rec.finish_reason = chunk.finish_reason
                    if chunk.content:
                        if last is None:
                            rec.ttft_s = now - start
                        else:
                            rec.itls_s.append(now - last)
                        last = now
                        rec.content_chunks += 1
                        parts.append(chunk.content)
    except (httpx.HTTPError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.text = "".join(parts)
    rec.output_tokens = rec.usage_tokens if rec.usage_tokens is not None else rec.content_chunks
    if rec.error is None and rec.ttft_s is None:
        rec.error = "the stream ended without any content"
    if rec.error is None:
        rec.e2e_s = time.perf_counter() - start
    return rec


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, disable=not enabled)


async def run_load(cfg: WorkloadConfig, prompts: Sequence[Prompt], *, concurrency: Optional[int] = None,
                   rate: Optional[float] = None, seed: int = 0, progress: bool = True,
                   desc: str = "bench") -> tuple[list[RequestRecord], float]:
    """Send every prompt once; return (records in prompt order, wall seconds from first send to last end).

    Closed loop with `concurrency` workers when `rate` is None; else Poisson arrivals at `rate`
    requests/s (exponential gaps from `seed`), with at most `concurrency` in flight when given.
    """
    if rate is None and not concurrency:
        raise ValueError("give a concurrency, a rate, or both")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    width = concurrency or len(prompts) or 1
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    records: list[Optional[RequestRecord]] = [None] * len(prompts)
    with _progress(len(prompts), desc, progress) as bar:
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            t0 = time.perf_counter()

            async def one(i: int) -> None:
                records[i] = await send_request(client, cfg, i, prompts[i], t0)
                bar.update(1)

            if rate is None:
                queue = iter(range(len(prompts)))

                async def worker() -> None:
                    for i in queue:  # a shared iterator: each index is taken once
                        await one(i)

                await asyncio.gather(*(worker() for _ in range(min(width, len(prompts)))))
            else:
                rng = random.Random(seed)
                gate = asyncio.Semaphore(concurrency) if concurrency else None

                async def gated(i: int) -> None:
                    if gate is None:
                        return await one(i)
                    async with gate:
                        await one(i)

                tasks = []
                for i in range(len(prompts)):
                    if i:
                        await asyncio.sleep(rng.expovariate(rate))
                    tasks.append(asyncio.create_task(gated(i)))
                await asyncio.gather(*tasks)
            ends = [r.start_s + (r.e2e_s or 0.0) for r in records if r is not None]
            duration = max(ends, default=0.0) if ends else time.perf_counter() - t0
    return [r for r in records if r is not None], duration


async def warmup(cfg: WorkloadConfig, num_requests: int, concurrency: int, *, seed: int = 0,
                 progress: bool = True) -> list[RequestRecord]:
    """Unmeasured requests with their own prompts (tag ``warm``); returns their records for checks."""
    if num_requests <= 0:
        return []
    prompts = make_prompts(num_requests, seed, tag="warm")
    records, _ = await run_load(cfg, prompts, concurrency=max(1, concurrency), progress=progress, desc="warm-up")
    return records


async def run_benchmark(cfg: WorkloadConfig, *, num_requests: int, concurrency: Optional[int] = None,
                        rate: Optional[float] = None, warmup_requests: Optional[int] = None, seed: int = 0,
                        shared_prefix: bool = False, progress: bool = True,
                        prompts: Optional[Sequence[Prompt]] = None, workload: str = "chat",
                        slos: Optional[dict[str, float]] = None) -> dict:
    """Warm up, run `num_requests`, and return ``{"config", "summary", "records"}`` (JSON-ready).

    `prompts` (default: `num_requests` unique chat prompts) is what the measured requests send, e.g. a
    workload of benchmarks/scenarios.py named `workload`; `slos` ({metric: seconds}) adds goodput."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    n_warm = warmup_requests if warmup_requests is not None else max(2, concurrency or 2)
    warm = await warmup(cfg, n_warm, concurrency or 2, seed=seed, progress=progress)
    failed = [r for r in warm if not r.ok]
    if warm and len(failed) == len(warm):
        raise RuntimeError(f"every warm-up request failed; first error: {failed[0].error}")
    if prompts is None:
        prompts = make_prompts(num_requests, seed, shared_prefix=shared_prefix)
    elif len(prompts) != num_requests:
        raise ValueError(f"got {len(prompts)} prompts for {num_requests} requests")
    records, duration = await run_load(cfg, prompts, concurrency=concurrency, rate=rate, seed=seed,
                                       progress=progress)
    return {"config": {**vars(replace(cfg, api_key=None)), "endpoint": cfg.endpoint, "num_requests": num_requests,
                       "concurrency": concurrency, "rate": rate, "warmup_requests": n_warm, "seed": seed,
                       "shared_prefix": shared_prefix, "workload": workload, "slo_s": slos or {}},
            "summary": summarize(records, duration, slos),
            "records": [r.to_dict() for r in records]}
