"""The load check: before a server says ready, prove on the real weights that the engine's paged path gives
what mlx-lm's own cache path gives (`run_load_check`), and build the serving engine from what it found
(`checked_engine`).

The structural gate (cluster/model_structure.py) says that every cache slot, rope and head is of a kind the
engine serves; the load check proves that the model's code uses them as the engine assumes. A probe engine, over
a small pool of the serving block size and a short prefill chunk, generates `PROBE_TOKENS` greedy tokens for
three prompts of different lengths batched together (the longest crossing every block, chunk and sliding window
the model has; a window longer than `MAX_PROBE_WINDOW` positions is shrunk for the probe,
`windows_shrunk`, so that a few dozen tokens cross it on the same code path), then for a fourth
prompt that shares the longest one's first blocks (a prefix hit that reuses them). mlx-lm's own forward over the
model's own `make_cache()` then runs each prompt with the tokens the engine chose (teacher forcing: one forward
per prompt): each chosen token must be mlx-lm's greedy choice (or within the tolerance of it: a near tie) and its
logprob within `tolerance(dtype)` of mlx-lm's. The output head is compared with the model's own call first. The
probe's KV is float whatever `kv_bits` the server uses: mlx-lm's own forward keeps float KV, and quantized KV
read back across chunks is an approximation by design, not a fault of the paths (the quantized formats are
compared with mlx-lm's `QuantizedKVCache` in tests/test_quantized_kv.py).

A family the tests do not cover learns its batched mask's rank here: rank 4 first, else rank 5 (attention that
splits grouped queries). A check that fails raises `LoadCheckError` naming the prompt, the token, and the first
layer and position where the paths part (`_locate`: every layer's output in the probe's first step, beside mlx-lm's
prefill of the same prompt).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from cluster.config import EngineConfig
from cluster.model import ModelSpec
from cluster.model_structure import VerifiedModel, body_of, layers_of, text_model, verify_model
from cluster.request import GenerateRequest, SamplingParams
from cluster.stats import LoadCheckReport

logger = logging.getLogger(__name__)

PROBE_TOKENS = 4  # greedy tokens generated per probe prompt
MAX_PROBE_WINDOW = 128  # a longer sliding window is shrunk for the probe (`windows_shrunk`): a cheap probe
PROBE_SEED = 20261206


class LoadCheckError(ValueError):
    """The paged path and mlx-lm's own path part: the message names where."""


@dataclass(frozen=True)
class LoadCheck:
    """What the load check proved. `checks`: each check passed, in words; `seconds`: its cost; `verified`: the
    model as the serving engine runs it (the mask rank found); `skipped`: the check was skipped (a family the tests
    cover, `EngineConfig.skip_load_check`); `peak_blocks`: per KV cache group of the probe engine, the most blocks
    its requests held at once."""

    checks: tuple[str, ...]
    seconds: float
    verified: VerifiedModel
    skipped: bool = False
    peak_blocks: tuple[tuple[str, int], ...] = ()

    def report(self) -> LoadCheckReport:
        """What a worker reports of it (in its stats, to the router's `GET /v1/models` and `mlx-pd status`)."""
        return LoadCheckReport(model_type=self.verified.model_type, passed=self.checks,
                               seconds=round(self.seconds, 3), skipped=self.skipped)

    def summary(self) -> str:
        """One line for the log (`LoadCheckReport.summary`, as `mlx-pd status` shows it)."""
        return self.report().summary()


def tolerance(dtype: str) -> float:
    """The largest logprob difference (nats) between the two paths that counts as equal: float32 1e-3 as the
    tests; half precision rounds each path differently, 0.15."""
    return 2e-3 if dtype == "float32" else 0.15


def checked_engine(model, tokenizer, spec: ModelSpec, config: EngineConfig, replicas=None, open_tier: bool = True):
    """The serving `EngineCore` for `model`, after the load check (`run_load_check`; skipped for a tested family
    when `config.skip_load_check`). The engine's `load_check` is the result. `replicas`: a worker group's
    followers (`cluster.runner.Replicas`), which run the same load check at the same time on their shards;
    `open_tier`: as `EngineCore`'s. Raises ValueError (the structural gate) or `LoadCheckError`."""
    from cluster.engine import EngineCore

    verified = verify_model(model)
    if config.skip_load_check and verified.tested:
        check = LoadCheck((), 0.0, verified, skipped=True)
    else:
        check = run_load_check(model, tokenizer, spec, config, verified)
    logger.info("%s", check.summary())
    engine = EngineCore(model, tokenizer, spec, config, verified=check.verified, replicas=replicas,
                        open_tier=open_tier)
    engine.load_check = check
    return engine


def run_load_check(model, tokenizer, spec: ModelSpec, config: EngineConfig,
                   verified: Optional[VerifiedModel] = None) -> LoadCheck:
    """Run the probe (module docstring) for `model` as `config` would serve it. Returns the `LoadCheck`; raises
    `LoadCheckError` naming where the paths part."""
    verified = verified or verify_model(model)  # a structural refusal is raised as it is
    try:
        return _run_load_check(model, tokenizer, spec, config, verified)
    except LoadCheckError:
        raise
    except Exception as exc:  # mlx-lm's own path or the probe's setup cannot run this model here
        raise LoadCheckError(f"{verified.model_type} model: the load check could not run ({type(exc).__name__}: "
                             f"{exc})") from exc


def _run_load_check(model, tokenizer, spec, config, verified: VerifiedModel) -> LoadCheck:
    t0 = time.monotonic()
    tol = tolerance(config.dtype)
    vocab = int(model(mx.zeros((1, 1), dtype=mx.int32), cache=make_prompt_cache(model)).shape[-1])
    checks = [_check_head(model, verified, vocab, tol)]
    long = sorted({w for w in verified.layer_windows if w is not None and w > MAX_PROBE_WINDOW})
    small = {w: config.block_size + config.block_size // 2 + 2 * i for i, w in enumerate(long)}
    with windows_shrunk(model, small):
        probed = verify_model(model, verified.mask_rank) if long else verified
        if long and set(long) & set(probed.layer_windows):  # the window is not an attribute found: run as is
            probed, small = verified, {}
        prompts, prefix, notes = _probe_prompts(probed, config, spec, vocab)
        ranks = [verified.mask_rank] if verified.tested else [4, 5]
        failure: Optional[LoadCheckError] = None
        for rank in ranks:
            try:
                found, peak = _probe(model, tokenizer, spec, config, probed.with_mask_rank(rank), prompts, prefix,
                                     tol)
            except LoadCheckError as exc:
                failure = failure or exc
                continue
            if not verified.tested:
                checks.append(f"batched mask of rank {rank}")
            checks += found + notes + [f"window of {w} positions shrunk to {v} for the probe" for w, v in small.items()]
            return LoadCheck(tuple(checks), time.monotonic() - t0, verified.with_mask_rank(rank), peak_blocks=peak)
    raise failure


@contextmanager
def windows_shrunk(model, sizes: dict[int, int]):
    """Within the block, every integer attribute whose name says "window" and whose value is a key of `sizes` (a
    sliding window of that many positions), on the model's modules and on their `args` / `config` objects (where
    `make_cache` and the bodies read them), holds the key's value instead; restored on exit. A probe then crosses
    a long window in a few tokens on the same code path."""
    changed: list = []
    if sizes:
        seen: set = set()
        for _, module in model.named_modules():
            for owner in (module, getattr(module, "args", None), getattr(module, "config", None)):
                if owner is None or id(owner) in seen or not hasattr(owner, "__dict__"):
                    continue
                seen.add(id(owner))
                for name, value in list(vars(owner).items()):
                    if "window" in name and type(value) is int and value in sizes:
                        changed.append((owner, name, value))
                        object.__setattr__(owner, name, sizes[value])
    try:
        yield
    finally:
        for owner, name, value in changed:
            object.__setattr__(owner, name, value)


def _check_head(model, verified: VerifiedModel, vocab: int, tol: float) -> str:
    """The head found (`call_head`) over the body's output equals the model's own call on 8 tokens."""
    tokens = mx.array([_tokens(8, vocab, 1)], dtype=mx.int32)
    own = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
    mx.eval(own)  # one forward at a time: a pipeline rank's transfers run in call order on every rank
    _, body = body_of(text_model(model))
    try:
        ours = verified.head(body(tokens, cache=make_prompt_cache(model))[0]).astype(mx.float32)
        diff = float(mx.max(mx.abs(_logprobs(ours) - _logprobs(own[0]))).item())
    except Exception as exc:  # the model's own call does what a stand-in body cannot answer
        raise LoadCheckError(f"{verified.model_type} model: its output head cannot be run apart from its body "
                             f"({type(exc).__name__}: {exc})") from None
    if diff > tol:
        raise LoadCheckError(f"{verified.model_type} model: the output head found by calling its Model.__call__ "
                             f"on the body's output differs from the model's own call by {diff:.3g} nats; the "
                             "head does more than the engine can apply on the rows it samples")
    return "output head equals the model's own call"


def _probe_prompts(verified: VerifiedModel, config: EngineConfig, spec: ModelSpec, vocab: int):
    """(three prompts of tokens below `vocab`, a prompt sharing the first one's first blocks, notes on what was
    not crossed)."""
    bs = config.block_size
    windows = [w for w in verified.layer_windows if w is not None]
    crossed = [w for w in windows if w <= MAX_PROBE_WINDOW]
    notes = [f"window of {w} positions not crossed (longer than {MAX_PROBE_WINDOW} and not found to shrink)"
             for w in sorted(set(windows)) if w > MAX_PROBE_WINDOW]
    longest = max([2 * _chunk(config)] + [w + bs for w in crossed]) + bs // 2 + 1
    longest = min(longest, spec.max_model_len - PROBE_TOKENS - 1)
    lengths = (longest, bs + 3, 3)
    prompts = [_tokens(n, vocab, i + 2) for i, n in enumerate(lengths)]
    shared = max(1, (longest - 1) // bs) * bs
    prefix = prompts[0][:shared] + _tokens(bs // 2 + 2, vocab, 9)
    return prompts, prefix, notes


def _chunk(config: EngineConfig) -> int:
    """The probe's prefill chunk: one block."""
    return config.block_size


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.RandomState(PROBE_SEED + seed)
    return rng.randint(min(100, vocab // 2), vocab, size=n).tolist()


def _logprobs(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _reference(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """mlx-lm's own logprobs after `prompt` and each of `tokens` but the last (teacher forcing: one forward of the
    model over its own `make_cache()`): float32 [len(tokens), vocab]."""
    sequence = mx.array([prompt + tokens[:-1]], dtype=mx.int32)
    logits = model(sequence, cache=make_prompt_cache(model))[0, len(prompt) - 1:]
    return np.array(_logprobs(logits))


def _probe(model, tokenizer, spec, config, verified, prompts, prefix, tol):
    """Run the probe engine; returns (the checks passed, the peak blocks per group) or raises LoadCheckError."""
    from cluster.engine import EngineCore

    bs = config.block_size
    need = sum(-(-(len(p) + PROBE_TOKENS) // bs) + 1 for p in prompts + [prefix])
    probe_config = dataclasses.replace(
        config, num_blocks=2 * need + 4, max_num_seqs=4, prefill_chunk_size=_chunk(config), kv_bits=None,
        max_num_batched_tokens=None, enable_prefix_caching=True, state_cache_gb=None if not verified.num_state_layers
        else 0.05, state_snapshot_interval=None, speculative_method=None, draft_model=None, decode_mirror_gb=None,
        kv_cache_gb=max(config.kv_cache_gb, 0.05), max_model_len=None, ssd_cache_gb=0.0)
    engine = EngineCore(model, tokenizer, spec, probe_config, verified=verified)
    first = [_request(f"probe-{i}", p) for i, p in enumerate(prompts)]
    peak: dict[str, int] = {}
    outputs = _run(engine, first, peak, verified.model_type)
    where = (model, tokenizer, spec, verified, config.dtype)
    for i, (p, req) in enumerate(zip(prompts, first)):
        _compare(outputs[req.request_id], tol, f"probe prompt {i} ({len(p)} tokens, batched with "
                 f"{len(prompts) - 1} others)", where, p)
    hit = _request("probe-prefix", prefix)
    result = _run(engine, [hit], peak, verified.model_type)
    cached = result[hit.request_id][1]
    if cached < bs:
        raise LoadCheckError(f"{verified.model_type} model: the probe's prefix-hit prompt reused {cached} cached "
                             f"tokens, expected at least one {bs}-token block")
    _compare(result[hit.request_id], tol, f"probe prompt sharing {cached} cached tokens", where,
             prefix)
    windows = sorted({w for w in verified.layer_windows if w is not None and w < len(prompts[0])})
    checks = [f"3 prompts of {', '.join(str(len(p)) for p in prompts)} tokens batched on the paged pool "
              f"({bs}-token blocks, {_chunk(config)}-token chunks), {PROBE_TOKENS} tokens each",
              f"prefix hit reusing {cached} tokens"]
    checks += [f"window of {w} positions crossed" for w in windows]
    if verified.num_state_layers:
        checks.append("recurrent state restored from a snapshot")
    return checks, tuple(sorted(peak.items()))


def _request(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, logprobs=0,
                                                              ignore_eos=True))


def _run(engine, requests: list[GenerateRequest], peak: dict, model_type: str) -> dict:
    """Step `engine` until `requests` finish: request id -> ([(token, logprob)], cached prompt tokens). `peak`
    (group name -> blocks) is raised to the most blocks each group's requests held after a step."""
    got: dict = {r.request_id: ([], 0) for r in requests}
    for r in requests:
        engine.add_request(r)
    for _ in range(10_000):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens, cached = got[out.request_id]
            if out.error:
                raise LoadCheckError(f"{model_type} model: a probe request failed on the paged path: {out.error}")
            tokens += [(t, lp.logprob) for t, lp in zip(out.token_ids, out.logprobs or ())]
            got[out.request_id] = (tokens, max(cached, getattr(out, "num_cached_tokens", 0) or 0))
        for g in engine.kv.group_stats():
            if g.blocks_used is not None:
                peak[g.group] = max(peak.get(g.group, 0), g.blocks_used)
    return got


def _compare(result, tol, what, where, prompt) -> None:
    """Each token the paged path chose must be mlx-lm's greedy choice after the same tokens (or within `tol` of
    it: a near tie), with its logprob within `tol` of mlx-lm's; raise LoadCheckError naming where the paths part
    (`where`: the model, tokenizer, spec, verified model and dtype, for `_locate`)."""
    model, verified = where[0], where[3]
    pairs, _ = result
    if len(pairs) != PROBE_TOKENS:
        raise LoadCheckError(f"{verified.model_type} model: {what}: the paged path gave {len(pairs)} tokens, "
                             f"expected {PROBE_TOKENS}")
    reference = _reference(model, prompt, [t for t, _ in pairs])
    for t, ((ours, lp), ref_lps) in enumerate(zip(pairs, reference)):
        best = int(ref_lps.argmax())
        if float(ref_lps[best]) - float(ref_lps[ours]) > tol:
            raise LoadCheckError(f"{verified.model_type} model: {what}: token {t} is {ours} on the paged path but "
                                 f"{best} in mlx-lm's own forward ({lp:.4f} vs {float(ref_lps[best]):.4f} nats)"
                                 + _locate(*where, prompt, tol))
        if abs(lp - float(ref_lps[ours])) > tol:
            raise LoadCheckError(f"{verified.model_type} model: {what}: token {t}'s logprob is {lp:.5f} on the paged "
                                 f"path but {float(ref_lps[ours]):.5f} in mlx-lm's own forward (tolerance {tol})"
                                 + _locate(*where, prompt, tol))


def _locate(model, tokenizer, spec, verified: VerifiedModel, dtype: str, prompt: list[int], tol: float) -> str:
    """"; first parting at layer i, position p" from every layer's output on `prompt`: the paged path (a fresh
    engine's first step, the prompt solo and batched beside a shorter copy) beside mlx-lm's own prefill; "" when
    no layer's output differs there."""
    _, body = body_of(text_model(model))
    try:
        ours = _layer_outputs(body, lambda: _paged_prefill(model, tokenizer, spec, verified, dtype, prompt))
        # evaluated whole: a pipeline rank's send runs with it, as on every other rank
        theirs = _layer_outputs(body, lambda: mx.eval(model(mx.array([prompt]), cache=make_prompt_cache(model))))
    except Exception as exc:  # a diagnosis only: the check has failed already
        return f" (the layer that parts could not be found: {type(exc).__name__}: {exc})"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        n = min(a.shape[1], b.shape[1])
        diff = np.abs(np.array(a[0, :n].astype(mx.float32)) - np.array(b[0, :n].astype(mx.float32))).max(axis=-1)
        scale = max(1.0, float(np.abs(np.array(b[0, :n].astype(mx.float32))).max()))
        bad = np.nonzero(diff > max(tol, 1e-3) * scale)[0]
        if bad.size:
            return f"; the paths first part at layer {i}, position {int(bad[0])} of the prompt"
    return ("; every layer's output agrees when the prompt runs in one step: the paths part across prefill chunks or "
            "in a later step")


def _paged_prefill(model, tokenizer, spec, verified: VerifiedModel, dtype: str, prompt: list[int]) -> None:
    """The prompt's prefill through a fresh engine's paged pool, batched beside a shorter prompt (the longest row
    runs first: the first row is the prompt)."""
    from cluster.engine import EngineCore

    n = len(prompt)
    config = EngineConfig(block_size=16, num_blocks=2 * (-(-n // 16) + 2) + 4, prefill_chunk_size=max(n, 16),
                          enable_prefix_caching=False, max_num_seqs=2, dtype=dtype,
                          state_cache_gb=0.01 if verified.num_state_layers else None)
    engine = EngineCore(model, tokenizer, spec, config, verified=verified)
    for i, p in enumerate((prompt, prompt[: max(1, n // 2)])):
        engine.add_request(_request(f"locate-{i}", p))
    engine.step()


def _layer_outputs(body, run) -> list[mx.array]:
    """The first row's output of each layer of `body` in the first call that `run` makes: [1, T, hidden]."""
    layers = layers_of(body)
    seen: list = [None] * len(layers)
    originals = [type(layer) for layer in layers]

    def recorder(i, cls):
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            if seen[i] is None:
                h = out[0] if isinstance(out, tuple) else out
                seen[i] = h[:1]
            return out
        return type(cls.__name__, (cls,), {"__call__": __call__})

    try:
        for i, (layer, cls) in enumerate(zip(layers, originals)):
            layer.__class__ = recorder(i, cls)
        run()
    finally:
        for layer, cls in zip(layers, originals):
            layer.__class__ = cls
    return [s for s in seen if s is not None]
