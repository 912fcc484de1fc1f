"""Helpers for tests that drive the engine core synchronously on the real SmolLM2 model (float32), or on
`fast_model()`, a small random-weight model with the same tokenizer, where a test needs no real language."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from cluster.config import EngineConfig
from cluster.request import GenerateRequest, RequestOutput, SamplingParams


@functools.lru_cache(maxsize=1)
def real_model():
    """(model, tokenizer, spec) of the default model, loaded once per test session."""
    from cluster.gguf_import import ensure_default_model
    from cluster.model import DEFAULT_MODEL, load_model, read_model_spec

    path = ensure_default_model(progress=False)
    model, tokenizer = load_model(path, "float32")
    return model, tokenizer, read_model_spec(path, model_id=DEFAULT_MODEL)


@functools.lru_cache(maxsize=1)
def fast_model():
    """(model, tokenizer, spec) of a random-weight 2-layer llama with SmolLM2's tokenizer and vocabulary
    (`benchmarks.reliability_long.fast_model_dir`: hidden 256, 4 heads over 2 KV heads, context 8,192; built
    once into the mlx-pd cache), loaded once per test session. A decode step costs a fraction of the real
    model's; its greedy output is garbage text, but deterministic, so tests compare it with a single-node
    reference of the same model. Its spec carries the default model's id, the name the tests' request bodies
    and topologies use (the revision is its own)."""
    from benchmarks.reliability_long import fast_model_dir
    from cluster.model import DEFAULT_MODEL, load_model, read_model_spec

    path = fast_model_dir()
    model, tokenizer = load_model(path, "float32")
    return model, tokenizer, read_model_spec(path, model_id=DEFAULT_MODEL)


def make_engine(loaded=None, **config):
    """A fresh EngineCore over `loaded` = (model, tokenizer, spec), by default the shared real model;
    `config` overrides EngineConfig fields."""
    from cluster.engine import EngineCore

    model, tokenizer, spec = loaded if loaded is not None else real_model()
    config.setdefault("kv_cache_gb", 0.25)
    # a request queued behind a long prompt may wait minutes on a saturated machine; tests of that deadline
    # set their own
    config.setdefault("queue_timeout_s", 900.0)
    return EngineCore(model, tokenizer, spec, EngineConfig(**config))


@dataclass
class Result:
    """Everything one request produced, joined."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        """Join one output delta."""
        self.outputs.append(out)
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += list(out.logprobs or ())

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


def run(engine, requests: list[GenerateRequest], max_steps: int = 100_000) -> dict[str, Result]:
    """Add all requests at once and step the engine until every one has finished."""
    results = {r.request_id: Result() for r in requests}
    for r in requests:
        out = engine.add_request(r)
        if out is not None:
            results[r.request_id].outputs.append(out)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            results[out.request_id].add(out)
    assert not engine.has_work(), "engine did not finish"
    return results


def greedy(rid: str, prompt, max_tokens: int = 16, **kw) -> GenerateRequest:
    """A temperature-0 request."""
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def chat_prompt(text: str) -> list[int]:
    """The default model's chat template applied to one user message."""
    _, tokenizer, _ = real_model()
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
