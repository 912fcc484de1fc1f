"""`mlx-pd profile`: one worker's prefill curve, decode speed and KV capacity, set against the machine's peaks.

    mlx-pd profile                                  # the default model, in this process, with the real engine
    mlx-pd profile --max-len 4096 --json p.json     # longer prompts (minutes on a CPU)
    mlx-pd profile --topology local-1p1d --worker prefill-0   # that worker's engine settings
    mlx-pd profile --url http://127.0.0.1:8000      # any OpenAI endpoint over HTTP (a cluster's router too)

What runs (in-process mode; `--url` mode is benchmarks/profile_http.py): the model is loaded into a
`cluster.engine.EngineCore` with the worker's `EngineConfig`, and the engine's own scheduler runs every
step, so chunked prefill (`prefill_chunk_size`), the paged KV pool and the decode mirror are what is timed.

1. Warm-up: one prefill and one decode batch, not measured.
2. Prefill: for each prompt length (default 128, 256, ..., `--max-len`; plus the held-out length, default
   3/4 of the longest) `--repeats` prompts, each made unique by a random ``[profile xxxxxxxxxxxx]`` head,
   so the prefix cache never hits (checked: `cached_tokens` is recorded per prompt and must be 0). TTFT is
   add -> first token; prefill time is the time inside the engine steps that computed the prompt. The
   median per length enters the fit ``t = a*T + b*T^2`` (benchmarks/roofline.py); the held-out length
   does not, and its prediction error is reported.
3. Decode: at each batch size (default 1, 4, 8, 16) that many unique 128-token prompts are prefilled, then
   `--decode-steps` decode steps are timed: tokens/s = tokens / step time.
4. Against the peaks (benchmarks/chips.py: the Apple chip table, or measured here): MFU per prefill length,
   MBU per decode batch, the KV bytes per token from the model's config, and how many sequences of each
   `--context` length fit the KV pool.

The JSON (`--json`) holds every sample and the fit; a router can predict a worker's prefill time as
``fit.a * T + fit.b * T**2`` seconds (see `predicted_prefill_s`).
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from benchmarks import roofline


@dataclass(frozen=True)
class ProfileConfig:
    """What a profile measures; see the module doc. Lengths above the context limit - 1 are dropped."""

    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    held_out: tuple[int, ...] = (1536,)
    repeats: int = 2
    batches: tuple[int, ...] = (1, 4, 8, 16)
    decode_steps: int = 16
    decode_prompt_tokens: int = 128
    contexts: tuple[int, ...] = (2048, 8192)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 16 or len(set(self.lengths)) < 2:
            raise ValueError(f"lengths must be >= 2 distinct prompt lengths of >= 16 tokens, got {self.lengths}")
        if set(self.lengths) & set(self.held_out):
            raise ValueError(f"a held-out length must not be among the fitted lengths: {self.held_out}")
        if self.repeats < 1 or self.decode_steps < 1 or min(self.batches, default=1) < 1:
            raise ValueError("repeats, decode_steps and batch sizes must be >= 1")


def default_lengths(max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(fitted lengths, held-out lengths) for `--max-len`: powers of two from 128 to max_len (and max_len
    itself), held out 3/4 of max_len rounded to 64 tokens."""
    if max_len < 256:
        raise ValueError(f"--max-len must be >= 256, got {max_len}")
    lengths = [n for n in (128 << k for k in range(16)) if n <= max_len]
    if lengths[-1] != max_len:
        lengths.append(max_len)
    held = max(64, round(0.75 * max_len / 64) * 64)
    if held in lengths:
        held += 64
    return tuple(lengths), (held,)


class PromptMaker:
    """Unique prompts of an exact token length: a random head, then text from the prompt set, tokenized."""

    def __init__(self, tokenizer, seed: int = 0):
        from benchmarks.loadgen import load_prompts

        self.tok, self.rng = tokenizer, random.Random(seed)
        self.filler = list(tokenizer.encode(" ".join(load_prompts()), add_special_tokens=False))

    def __call__(self, tokens: int) -> tuple[int, ...]:
        head = list(self.tok.encode(f"[profile {self.rng.getrandbits(48):012x}] ", add_special_tokens=False))
        body = []
        while len(head) + len(body) < tokens:
            body += self.filler
        return tuple((head + body)[:tokens])


def _params(model) -> dict:
    """{params_total, params_matmul, param_bytes} of an mlx-lm model: matmul = all but the embedding table
    and an untied lm_head (which mlx-pd's runner applies to the last prompt row only)."""
    from mlx.utils import tree_flatten

    flat = tree_flatten(model.parameters())
    total = sum(v.size for _, v in flat)
    skip = sum(v.size for k, v in flat if "embed_tokens" in k or k.startswith("lm_head"))
    return {"params_total": total, "params_matmul": total - skip, "param_bytes": sum(v.nbytes for _, v in flat)}


def time_prefill(core, ids: Sequence[int]) -> dict:
    """Run one prompt to its first token on `core` (idle before and after); {tokens, ttft_s, prefill_s,
    cached_tokens, steps}."""
    from cluster.request import GenerateRequest, SamplingParams

    rid = f"profile-{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    core.add_request(GenerateRequest(rid, tuple(ids), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    inside, steps, out = 0.0, 0, None
    while out is None:
        s = time.perf_counter()
        outs = core.step()
        inside += time.perf_counter() - s
        steps += 1
        out = next((o for o in outs if o.request_id == rid and (o.token_ids or o.finished)), None)
    ttft = time.perf_counter() - t0
    if out.error:
        raise RuntimeError(f"prefill of {len(ids)} tokens failed: {out.error}")
    while core.has_work():
        core.step()
    return {"tokens": len(ids), "ttft_s": ttft, "prefill_s": inside, "cached_tokens": out.num_cached_tokens,
            "steps": steps}


def time_decode(core, prompts: Sequence[Sequence[int]], steps: int) -> dict:
    """Prefill `prompts` together (untimed), then time `steps` decode steps of the whole batch.

    Returns {batch, steps, tokens, step_s (list), tokens_per_s, context_tokens_mean (KV tokens the batch
    reads per step, summed over sequences)}."""
    from cluster.request import GenerateRequest, SamplingParams

    rids = [f"profile-dec-{uuid.uuid4().hex[:10]}" for _ in prompts]
    sp = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for rid, ids in zip(rids, prompts):
        core.add_request(GenerateRequest(rid, tuple(ids), sp))
    started: set[str] = set()
    while len(started) < len(rids):
        started.update(o.request_id for o in core.step() if o.token_ids)
    times, tokens, contexts = [], 0, []
    for _ in range(steps):
        contexts.append(sum(len(core.sequences[r].token_ids) for r in rids if r in core.sequences))
        s = time.perf_counter()
        outs = core.step()
        times.append(time.perf_counter() - s)
        tokens += sum(len(o.token_ids) for o in outs)
        if any(o.error for o in outs):
            raise RuntimeError(f"decode at batch {len(prompts)} failed: {next(o.error for o in outs if o.error)}")
    for rid in rids:
        core.abort(rid)
    return {"batch": len(prompts), "steps": steps, "tokens": tokens, "step_s": times,
            "tokens_per_s": tokens / sum(times), "context_tokens_mean": statistics.fmean(contexts)}


def run_engine_profile(cfg: ProfileConfig, engine_config=None, model: Optional[str] = None,
                       served_name: Optional[str] = None, progress: bool = True, log=print) -> dict:
    """Load the model into an EngineCore and measure (module doc, steps 1-3). Returns the raw result."""
    from tqdm import tqdm

    from cluster.config import EngineConfig
    from cluster.engine import EngineCore
    from cluster.model import load_model, served_model

    engine_config = engine_config or EngineConfig()
    path, spec = served_model(model, served_name, engine_config.dtype)
    model_obj, tokenizer = load_model(path, dtype=engine_config.dtype)
    core = EngineCore(model_obj, tokenizer, spec, engine_config)
    limit = core.max_model_len - 1
    lengths = sorted({min(n, limit) for n in cfg.lengths})  # --max-len 8192 means the context limit
    held = [n for n in cfg.held_out if n < limit and n not in lengths]
    make = PromptMaker(tokenizer, cfg.seed)
    time_prefill(core, make(min(lengths)))  # warm-up
    time_decode(core, [make(cfg.decode_prompt_tokens) for _ in range(min(4, max(cfg.batches)))], 2)
    work = [(n, False) for n in lengths] + [(n, True) for n in held]
    samples = []
    with tqdm(total=len(work) * cfg.repeats, desc="prefill", unit="prompt", disable=not progress, leave=False) as bar:
        for _ in range(cfg.repeats):  # whole sweeps, so slow drift spreads over every length
            for n, is_held in work:
                samples.append({**time_prefill(core, make(n)), "held_out": is_held})
                bar.update(1)
    decode = []
    for b in tqdm(cfg.batches, desc="decode", unit="batch", disable=not progress, leave=False):
        if b > core.config.max_num_seqs:  # the engine's, resolved from the KV budget when unset
            log(f"skipping decode batch {b}: above max_num_seqs={core.config.max_num_seqs}")
            continue
        decode.append(time_decode(core, [make(cfg.decode_prompt_tokens) for _ in range(b)], cfg.decode_steps))
    kv_token = roofline.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                           core.store.dtype.size, engine_config.kv_bits, engine_config.kv_group_size)
    return {"mode": "engine", "config": asdict(cfg), "engine": asdict(engine_config),
            "model": {"name": spec.model_id, "path": str(path), "dtype": engine_config.dtype,
                      "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                      "kv_bits": engine_config.kv_bits, "kv_group_size": engine_config.kv_group_size,
                      "max_model_len": core.max_model_len, "kv_bytes_per_token": kv_token, **_params(model_obj)},
            "kv_pool": {"usable_blocks": core.pool.num_usable_blocks, "block_size": core.block_size,
                        "bytes": core.store.nbytes},
            "prefill_samples": samples, "decode": decode}


def analyze(result: dict, peak) -> dict:
    """Add the fit, held-out errors, MFU, MBU and capacity to a raw result (either mode); returns it."""
    m = result["model"]
    result["peak"] = peak.to_dict()
    by_len: dict[tuple[int, bool], list[dict]] = {}
    for s in result["prefill_samples"]:
        by_len.setdefault((s["tokens"], s["held_out"]), []).append(s)
    points = []
    for (n, held), ss in sorted(by_len.items()):
        t = statistics.median(s["prefill_s"] for s in ss)
        points.append({"tokens": n, "held_out": held, "prefill_s": t,
                       "ttft_s": statistics.median(s["ttft_s"] for s in ss),
                       "cached_tokens_max": max(s.get("cached_tokens") or 0 for s in ss),
                       "tokens_per_s": n / t, "mfu": roofline.mfu(m["params_matmul"], n / t, peak.flops)})
    fitted = [p for p in points if not p["held_out"]]
    fit = roofline.fit_prefill([p["tokens"] for p in fitted], [p["prefill_s"] for p in fitted])
    for p in points:
        p["predicted_s"] = fit.predict(p["tokens"])
    result["prefill"] = points
    result["fit"] = fit.to_dict()
    held = [p for p in points if p["held_out"]]
    result["held_out"] = roofline.held_out_errors(fit, [p["tokens"] for p in held], [p["prefill_s"] for p in held])
    for d in result["decode"]:
        per_step = roofline.decode_bytes_per_step(m["param_bytes"], m["kv_bytes_per_token"], [d["context_tokens_mean"]])
        steps_per_s = d["tokens_per_s"] / d["batch"]
        d.update(bytes_per_step=per_step, mbu=roofline.mbu(per_step, steps_per_s, peak.bandwidth_bytes_per_s),
                 roofline_tokens_per_s=roofline.decode_roofline_tokens_per_s(d["batch"], per_step,
                                                                             peak.bandwidth_bytes_per_s))
        if d.get("step_s"):
            d["step_s_p50"] = statistics.median(d["step_s"])
    pool = result["kv_pool"]
    result["capacity"] = [{"context": c, "sequences": roofline.capacity(pool["usable_blocks"], pool["block_size"], c)}
                          for c in result["config"]["contexts"] if c <= m["max_model_len"]]
    return result


def predicted_prefill_s(profile: dict, tokens: int) -> float:
    """A saved profile's predicted prefill seconds of a `tokens`-token prompt (what a router may use)."""
    fit = profile["fit"]
    return fit["a"] * tokens + fit["b"] * tokens * tokens

