"""`mlx-pd profile --url`: the same profile as benchmarks/profile.py, through an OpenAI endpoint over HTTP.

Works against any endpoint: `mlx-pd serve`, a cluster's router (then the numbers are the whole cluster's:
router, prefill worker, KV transfer and decode worker together), or mlx_lm.server.

- Prefill: one request at a time, ``max_tokens: 1``; the prompt is a unique ``[profile xxxxxxxxxxxx]`` head
  plus filler text cut to the target length with the local copy of the model's tokenizer (`--model`), so
  no prefix cache hits. The prompt length that enters the fit is the server's `usage.prompt_tokens` (chat
  template included) and "prefill time" is the TTFT seen by the client: it includes HTTP, tokenization and
  queueing, which the in-process mode excludes.
- Decode: `batch` concurrent streams of ``--decode-steps`` + 1 tokens; tokens/s = the sum over streams of
  (output tokens - 1) / (e2e - TTFT), i.e. each stream's decode rate while they run together.
- The model facts (parameters, KV bytes per token) come from the local model folder's config.json and
  safetensors headers. The KV pool is the server's own where it tells (an mlx-pd server's dashboard state,
  `served_workers`: each worker's blocks and, for a worker group, each rank's weights, KV and peak bytes),
  else assumed from ``--kv-cache-gb``.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from benchmarks import roofline
from benchmarks.profile import ProfileConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
SAFETENSORS_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U32": 4, "I8": 1, "U8": 1}


def safetensors_params(model_dir: Path) -> dict:
    """{params_total, params_matmul} from the safetensors headers of `model_dir` (no weights read).

    matmul excludes the embedding table and an untied lm_head, as in benchmarks/profile.py."""
    total = skip = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            size = 1
            for d in meta["shape"]:
                size *= d
            total += size
            if "embed_tokens" in name or name.startswith("lm_head"):
                skip += size
    if not total:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return {"params_total": total, "params_matmul": total - skip}


class TextMaker:
    """Unique prompt texts of about `tokens` tokens after the chat template (exact counts come from usage)."""

    def __init__(self, tokenizer, seed: int = 0, template_tokens: int = 30):
        import random

        from benchmarks.loadgen import load_prompts

        self.tok, self.rng, self.template_tokens = tokenizer, random.Random(seed), template_tokens
        self.filler = list(tokenizer.encode(" ".join(load_prompts()), add_special_tokens=False))

    def __call__(self, tokens: int) -> str:
        head = f"[profile {self.rng.getrandbits(48):012x}] "
        want = max(1, tokens - self.template_tokens - len(self.tok.encode(head, add_special_tokens=False)))
        ids = (self.filler * (want // len(self.filler) + 1))[:want]
        return head + self.tok.decode(ids)


async def _profile(url: str, cfg: ProfileConfig, make: TextMaker, api_key: Optional[str], progress: bool) -> dict:
    import httpx
    from tqdm import tqdm

    from benchmarks.loadgen import WorkloadConfig, send_request

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        async def one(prompt: str, max_tokens: int):
            wc = WorkloadConfig(url=url, max_tokens=max_tokens, api_key=api_key)
            rec = await send_request(client, wc, 0, prompt, time.perf_counter())
            if not rec.ok:
                raise RuntimeError(f"{url}: a profile request failed: {rec.error}")
            return rec

        await one(make(min(cfg.lengths)), 1)  # warm-up
        await asyncio.gather(*(one(make(cfg.decode_prompt_tokens), 4) for _ in range(2)))
        work = [(n, False) for n in cfg.lengths] + [(n, True) for n in cfg.held_out]
        samples = []
        with tqdm(total=len(work) * cfg.repeats, desc="prefill", unit="prompt", disable=not progress,
                  leave=False) as bar:
            for _ in range(cfg.repeats):
                for n, held in work:
                    rec = await one(make(n), 1)
                    samples.append({"tokens": rec.prompt_tokens or n, "target_tokens": n, "ttft_s": rec.ttft_s,
                                    "prefill_s": rec.ttft_s, "cached_tokens": rec.cached_tokens, "held_out": held})
                    bar.update(1)
        decode = []
        for b in cfg.batches:
            recs = await asyncio.gather(*(one(make(cfg.decode_prompt_tokens), cfg.decode_steps + 1) for _ in range(b)))
            rates = [(r.output_tokens - 1) / (r.e2e_s - r.ttft_s) for r in recs if r.output_tokens > 1]
            prompt = sum((r.prompt_tokens or cfg.decode_prompt_tokens) for r in recs) / len(recs)
            decode.append({"batch": b, "tokens_per_s": sum(rates), "tokens": sum(r.output_tokens for r in recs),
                           "tpot_s": [r.tpot_s for r in recs], "context_tokens_mean": b * (prompt + cfg.decode_steps / 2)})
    return {"prefill_samples": samples, "decode": decode}


def run_url_profile(url: str, cfg: ProfileConfig, model_dir: Path, dtype: str = "float32",
                    kv_cache_gb: float = 1.0, block_size: int = 32, kv_bits: Optional[int] = None,
                    kv_group_size: int = 64, api_key: Optional[str] = None, progress: bool = True) -> dict:
    """Profile the endpoint at `url` (module doc); returns the raw result for `profile.analyze`."""
    from cluster.model import load_tokenizer, read_model_spec

    spec = read_model_spec(Path(model_dir))
    make = TextMaker(load_tokenizer(Path(model_dir)), cfg.seed)
    raw = asyncio.run(_profile(url, cfg, make, api_key, progress))
    _bucket(raw["prefill_samples"])
    per_value = DTYPE_BYTES[dtype]
    kv_token = roofline.kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, per_value, kv_bits,
                                           kv_group_size)
    params = safetensors_params(Path(model_dir))
    pool = {"usable_blocks": int(kv_cache_gb * 2**30 // (kv_token * block_size)), "block_size": block_size,
            "bytes": int(kv_cache_gb * 2**30), "assumed": True}
    workers = served_workers(url, api_key) or []
    reported = [w for w in workers if w.get("kv_blocks_total")]
    if reported:  # the server's own pool: its first worker that reports one (a decode worker's, in a cluster)
        first = next((w for w in reported if w.get("role") == "decode"), reported[0])
        pool = {"usable_blocks": int(first["kv_blocks_total"]), "block_size": int(first["kv_block_size"]),
                "bytes": None, "assumed": False, "worker": first.get("name")}
    return {"mode": "url", "url": url, "config": asdict(cfg), "workers": workers,
            "model": {"name": spec.model_id, "path": str(model_dir), "dtype": dtype, "layers": spec.num_layers,
                      "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "kv_bits": kv_bits,
                      "kv_group_size": kv_group_size, "max_model_len": spec.max_model_len,
                      "kv_bytes_per_token": kv_token, **params, "param_bytes": params["params_total"] * per_value},
            "kv_pool": pool, **raw}


def served_workers(url: str, api_key: Optional[str] = None, client=None) -> Optional[list[dict]]:
    """The workers an mlx-pd server reports (its dashboard state, router/dashboard.py): per worker its name,
    role, blocks, and for a worker group `parallel` and `ranks` (each rank's weights, KV and peak bytes); None
    from any other server, or when the state cannot be read (no key, an error). `client`: an `httpx.Client` to
    use (tests)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with (client or httpx.Client(timeout=10.0)) as c:
            r = c.get(url.rstrip("/") + "/dashboard/api/state", headers=headers)
        workers = r.json().get("workers") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(workers, list):
        return None
    keep = ("name", "role", "kv_blocks_total", "kv_block_size", "parallel", "ranks")
    return [{k: w.get(k) for k in keep} for w in workers if isinstance(w, dict)]


def _bucket(samples: list[dict]) -> None:
    """Give every repeat of one (target length, held-out) the median of the server's token counts, so the
    analysis groups them (template tokens make counts differ by a token or two between prompts)."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for s in samples:
        groups.setdefault((s["target_tokens"], s["held_out"]), []).append(s)
    for ss in groups.values():
        n = int(statistics.median(s["tokens"] for s in ss))
        for s in ss:
            s["tokens"] = n
