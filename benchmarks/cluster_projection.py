"""Paper projection of the seeds' cluster (prefill on an M3 Ultra, decode on M4 Pro Mac minis, 10 GbE) from the
per-token costs `mlx-pd bench cluster` measures on this machine. Arithmetic, not a measurement.

Method. This machine's costs are turned into *efficiencies*, then applied to the target chip and model:

- prefill: efficiency = FLOPs of a T-token prefill of SmolLM2 / measured seconds / this CPU's matmul peak
  (GFLOP/s of a 1024x1024 float32 `mx.matmul` on the same pinned core, `host_peaks`). Projected seconds =
  FLOPs of the target model / (M3 Ultra peak x that efficiency). A second column uses an assumed MFU instead.
- decode: efficiency = bytes one decode step reads (matmul weights + lm_head once, plus batch x context x KV
  bytes per token) / measured step time / this core's copy bandwidth (NumPy copy of 256 MB, read + write).
  Projected step = the target's bytes / (M4 Pro bandwidth x that efficiency); again also with an assumed one.
- transfer: KV bytes per token from `cluster.kv.store.kv_bytes_per_block` (bfloat16, as on a Mac) over 10 GbE,
  chunks shipped as they are computed, so only what is left after the last chunk is exposed.

FLOPs follow `benchmarks/transfer_projection.Projection`: 2 x matmul weights per token plus causal attention
2 x layers x hidden x (b^2 - a^2) for tokens [a, b); the lm_head runs on the last row only (left out).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Shape:
    """A Llama-style model's shapes (from its config.json)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies: q, o (hidden^2), k, v (hidden x kv_heads x head_dim), MLP 3 x hidden x
        intermediate, per layer."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return self.num_layers * (2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size)

    def prefill_flops(self, start: int, stop: int) -> float:
        attention = 2.0 * self.num_layers * self.hidden_size * (stop**2 - start**2)  # causal: QK^T and PV
        return 2.0 * self.matmul_params * (stop - start) + attention

    def kv_bytes_per_token(self, dtype: str) -> float:
        from cluster.kv.store import kv_bytes_per_block
        from cluster.model import ModelSpec

        spec = ModelSpec(self.name, "-", self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.vocab_size, 8192, ())
        return kv_bytes_per_block(spec, 32, dtype, None, 64) / 32

    def decode_bytes(self, batch: int, context: float, dtype: str, dtype_bytes: int) -> float:
        """Bytes one decode step reads: matmul weights and the lm_head once, each sequence's KV."""
        weights = (self.matmul_params + self.vocab_size * self.hidden_size) * dtype_bytes
        return weights + batch * context * self.kv_bytes_per_token(dtype)


# config.json of HuggingFaceTB/SmolLM2-135M-Instruct (the default model) and meta-llama/Llama-3.1-8B
SMOLLM2 = Shape("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152)
LLAMA_8B = Shape("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256)


@dataclass(frozen=True)
class Targets:
    """The seeds' machines. Every number is a published spec or marked ASSUMPTION."""

    m3_ultra_flops: float = 28e12  # ASSUMPTION: 80-core GPU, 80 x 128 ALUs x 2 x ~1.4 GHz (Apple publishes none)
    m3_ultra_bandwidth: float = 819e9  # Apple's M3 Ultra spec: 819 GB/s
    m4_pro_bandwidth: float = 273e9  # Apple's M4 Pro spec: 273 GB/s
    mfu: float = 0.6  # ASSUMPTION: llama.cpp PR #3084, LLaMA-7B F16 pp512 on M2 Ultra = 0.61 of peak
    bandwidth_efficiency: float = 0.75  # ASSUMPTION: share of peak bandwidth a bf16 decode step reaches
    link_bytes_per_s: float = 1.25e9 * 0.9  # 10 GbE line rate; ASSUMPTION 90% TCP goodput
    chunk_tokens: int = 2048  # mlx-pd's default prefill_chunk_size (512 in the CPU benchmark)
    dtype: str = "bfloat16"  # weights and KV on a Mac
    slo_tpot_s: float = 0.150


@dataclass(frozen=True)
class Measured:
    """This machine's costs (from a `bench cluster` result)."""

    prefill_tokens: int  # a prompt prefilled alone by the pinned prefill worker
    prefill_s: float  # its TTFT through the 1p1d router (prefill + last blocks shipped + first token)
    decode_batch: int
    decode_context: float  # mean tokens of context per sequence during decode
    decode_step_s: float  # ITL p50 of the short chats on the pinned decode worker
    host_flops: float  # matmul FLOP/s of one pinned core
    host_bandwidth: float  # copy bytes/s (read + write) of one pinned core
    dtype: str = "float32"
    dtype_bytes: int = 4


def exposed_transfer_s(shape: Shape, tokens: int, t: Targets, prefill_s) -> float:
    """Seconds from the end of prefill until the last KV block lands (chunks ship as they are computed)."""
    per_token = shape.kv_bytes_per_token(t.dtype)
    compute_end = sent_end = 0.0
    for a in range(0, tokens, t.chunk_tokens):
        b = min(tokens, a + t.chunk_tokens)
        compute_end += prefill_s(a, b)
        sent_end = max(compute_end, sent_end) + (b - a) * per_token / t.link_bytes_per_s
    return sent_end - compute_end


def project(m: Measured, t: Targets = Targets(), tokens: int = 4096, short_chunk: int = 512) -> dict:
    """The projection table's numbers (see the module doc), per model."""
    prefill_eff = SMOLLM2.prefill_flops(0, m.prefill_tokens) / m.prefill_s / m.host_flops
    decode_eff = (SMOLLM2.decode_bytes(m.decode_batch, m.decode_context, m.dtype, m.dtype_bytes)
                  / m.decode_step_s / m.host_bandwidth)
    out = {"measured": asdict(m), "targets": asdict(t), "prompt_tokens": tokens, "prefill_efficiency_here": prefill_eff,
           "decode_efficiency_here": decode_eff, "models": {}}
    for shape in (SMOLLM2, LLAMA_8B):
        row = {}
        for label, eff_p, eff_d in (("same efficiency as here", prefill_eff, decode_eff),
                                    ("assumed efficiency", t.mfu, t.bandwidth_efficiency)):
            def pf(a, b):
                return shape.prefill_flops(a, b) / (t.m3_ultra_flops * eff_p)

            step_m4 = shape.decode_bytes(m.decode_batch, m.decode_context, t.dtype, 2) / (t.m4_pro_bandwidth * eff_d)
            step_m3 = shape.decode_bytes(m.decode_batch, m.decode_context, t.dtype, 2) / (t.m3_ultra_bandwidth * eff_d)
            exposed = exposed_transfer_s(shape, tokens, t, pf)
            row[label] = {
                "prefill_s": pf(0, tokens), "kv_mb": tokens * shape.kv_bytes_per_token(t.dtype) / 1e6,
                "transfer_s": tokens * shape.kv_bytes_per_token(t.dtype) / t.link_bytes_per_s,
                "exposed_transfer_s": exposed, "ttft_long_1p1d_s": pf(0, tokens) + exposed,
                "tpot_1p1d_s": step_m4,
                # single node on the M3 Ultra: a stream waits one prefill chunk (the last, slowest) + a decode step
                "gap_single_chunk512_s": pf(tokens - short_chunk, tokens) + step_m3,
                "gap_single_chunk2048_s": pf(tokens - t.chunk_tokens, tokens) + step_m3,
                "tpot_single_no_prefill_s": step_m3}
        out["models"][shape.name] = row
    return out


def projection_tables(p: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    def s(x: float) -> str:
        return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"

    m = p["measured"]
    quantities = [("prefill of the prompt on the M3 Ultra", "prefill_s"),
                  ("KV of the prompt (bf16), MB", "kv_mb"), ("KV over 10 GbE, all", "transfer_s"),
                  ("KV exposed after the last chunk", "exposed_transfer_s"),
                  ("1P1D: TTFT of the long prompt", "ttft_long_1p1d_s"),
                  ("1P1D: short-chat TPOT (M4 Pro decode)", "tpot_1p1d_s"),
                  ("single M3 Ultra: TPOT, no prefill running", "tpot_single_no_prefill_s"),
                  ("single M3 Ultra: token gap during the prefill, chunk 512", "gap_single_chunk512_s"),
                  ("single M3 Ultra: token gap during the prefill, chunk 2048", "gap_single_chunk2048_s")]
    header = ["quantity", "model", "same efficiency as here", "assumed efficiency"]
    rows = []
    for model, row in p["models"].items():
        for label, key in quantities:
            a, b = row["same efficiency as here"][key], row["assumed efficiency"][key]
            rows.append([label, model] + ([f"{a:.0f}", f"{b:.0f}"] if key == "kv_mb" else [s(a), s(b)]))
    title = (f"Projection for a {p['prompt_tokens']}-token prompt and a decode batch of {m['decode_batch']} x "
             f"{m['decode_context']:.0f} tokens; efficiencies measured here: prefill "
             f"{p['prefill_efficiency_here']:.2f} of matmul peak, decode {p['decode_efficiency_here']:.2f} of copy "
             f"bandwidth ({m['host_flops'] / 1e9:.0f} GFLOP/s, {m['host_bandwidth'] / 1e9:.1f} GB/s per core)")
    return [(title, header, rows)]


def host_peaks(n: int = 1024, reps: int = 20) -> dict:
    """Matmul FLOP/s (float32 mx.matmul, n x n) and copy bytes/s (NumPy, 256 MB, read + write) of this process's
    CPUs (run it under taskset)."""
    import mlx.core as mx
    import numpy as np

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    x = np.ones(2**26, np.float32)
    y = np.empty_like(x)
    np.copyto(y, x)
    flops = copy = 0.0
    for _ in range(3):  # best of 3: other processes only ever slow it down
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(a @ b)
        flops = max(flops, 2.0 * n**3 * reps / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(3):
            np.copyto(y, x)
        copy = max(copy, 2 * x.nbytes * 3 / (time.perf_counter() - t0))
    return {"matmul_flops": flops, "copy_bytes_per_s": copy}


def measure_host_peaks(cpus: Sequence[int]) -> Optional[dict]:
    """host_peaks() in a child process pinned to `cpus` (None if it fails)."""
    import os
    import subprocess

    from benchmarks.cluster_procs import pinned
    from benchmarks.compare import REPO_ROOT
    from cluster.launch.platform import preload_env

    argv = pinned([sys.executable, "-m", "benchmarks.cluster_projection", "--host-peaks"], cpus)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.update(preload_env(env))
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(REPO_ROOT), timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def projection_from(result: dict) -> Optional[dict]:
    """The paper projection from a result's calibration, 1p1d decode gaps and host peaks (None if missing)."""
    s = result.get("systems", {}).get("1p1d")
    host, cal = result.get("host_peaks"), result.get("calibration") or {}
    if not s or not host:
        return None
    quiet = s["summary"]["kinds"]["short, no long prefill"]
    if cal.get("ttft_s"):
        tokens, seconds = cal["prompt_tokens"], cal["ttft_s"]
    else:
        longs = [r for r in s["records"] if r["kind"] == "long" and r["ttft_s"]]
        if not longs:
            return None
        tokens, seconds = longs[0]["prompt_tokens"], min(r["ttft_s"] for r in longs)
    m = Measured(prefill_tokens=tokens, prefill_s=seconds, decode_batch=result["args"]["short_concurrency"],
                 decode_context=quiet["prompt_tokens_mean"] + result["args"]["short_max_tokens"] / 2,
                 decode_step_s=quiet["itl_s"]["p50"], host_flops=host["matmul_flops"],
                 host_bandwidth=host["copy_bytes_per_s"], dtype=result["args"]["dtype"],
                 dtype_bytes={"float32": 4}.get(result["args"]["dtype"], 2))
    return project(m)


if __name__ == "__main__" and sys.argv[1:] == ["--host-peaks"]:
    print(json.dumps(host_peaks()))
