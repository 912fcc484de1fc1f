"""The projection of `mlx-pd bench transfer`: an 8B model's prompt KV shipped over real links, next to its
prefill on an M3 Ultra. Arithmetic, no measurement; `Projection` holds every constant and its source, and
`projection_rows` gives one row per prompt length, link and KV format (benchmarks/transfer_bench.py adds them
to its result and tables).

    KV bytes/token   bf16: layers x 2 x kv_heads x head_dim x 2          (Llama-3.1-8B: 131,072)
                     4-bit, group g, bf16 scales: values / 2 + 2 x values / g x 2   (g 64: 36,864)
    prefill FLOPs of tokens [a, b) = 2 x P x (b - a) + 2 x layers x hidden x (b^2 - a^2)
                     P = matmul weights (embedding lookup and the last-row-only lm_head left out);
                     the second term is causal attention: QK^T and PV, 2 x hidden FLOPs each per
                     (query, key) pair and layer, b^2/2 - a^2/2 pairs
    prefill seconds  = FLOPs / (peak FLOP/s x MFU)
    transfer seconds = bytes / link bytes/s
    exposed          = when the last block lands minus when prefill ends, with 2048-token chunks each
                       shipped as soon as computed and after the previous chunk's transfer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Projection:
    """Constants of the projection table, each with its source (see docs/BENCHMARKS.md)."""

    # Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B): 32 layers, hidden 4096, 32 query heads,
    # 8 KV heads, head_dim 4096 / 32 = 128, MLP 14336.
    model: str = "Llama-3.1-8B"
    num_layers: int = 32
    hidden_size: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 14336
    group_size: int = 64  # 4-bit KV, bf16 scales and biases
    # ASSUMPTION: M3 Ultra 80-core GPU ~28 TFLOP/s fp16/fp32 (80 cores x 128 ALUs x 2 x ~1.4 GHz; Apple
    # publishes no figure). MFU 0.6: llama.cpp PR #3084 measured LLaMA-7B F16 pp512 at 1,265 tok/s on an
    # M2 Ultra 76-core, 2 x 6.5e9 x 1265 = 16.4 TFLOP/s of its ~27 peak = 0.61.
    peak_flops: float = 28e12
    mfu: float = 0.6
    chunk_tokens: int = 2048  # mlx-pd's prefill chunk (docs/DESIGN.md)
    # 10 GbE: 1.25 GB/s line rate; ASSUMPTION 90% TCP goodput (1500-byte MTU caps it near 94%).
    # Thunderbolt 5: 80 Gb/s = 10 GB/s line rate; ASSUMPTION 4 GB/s (32 Gb/s) over IP: Thunderbolt
    # networking reaches well under line rate (e.g. 16.4 Gb/s iperf3 on a 40 Gb/s TB4/USB4 link).
    links: tuple = (("10 GbE", 1.25e9 * 0.9), ("Thunderbolt 5", 4e9))

    @property
    def matmul_params(self) -> int:
        """Weights every prompt token multiplies: attention (q, o: hidden^2; k, v: hidden x kv_heads x head_dim)
        and MLP (3 x hidden x intermediate) per layer (Llama-3.1-8B: 6.98e9 of its 8.03e9)."""
        kv = self.num_kv_heads * self.head_dim
        h = self.hidden_size
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size
        return self.num_layers * per_layer

    def kv_bytes_per_token(self, kv_bits: Optional[int]) -> int:
        values = self.num_layers * 2 * self.num_kv_heads * self.head_dim
        if kv_bits is None:
            return values * 2
        return values * kv_bits // 8 + 2 * (values // self.group_size) * 2

    def prefill_flops(self, start: int, stop: int) -> float:
        attention = 2.0 * self.num_layers * self.hidden_size * (stop**2 - start**2)  # causal: QK^T and PV
        return 2.0 * self.matmul_params * (stop - start) + attention

    def prefill_seconds(self, start: int, stop: int) -> float:
        return self.prefill_flops(start, stop) / (self.peak_flops * self.mfu)

    def exposed_seconds(self, tokens: int, bytes_per_s: float, kv_bits: Optional[int]) -> float:
        """Time from the end of prefill until the last block lands, chunks shipped as they are computed."""
        compute_end = sent_end = 0.0
        for a in range(0, tokens, self.chunk_tokens):
            b = min(tokens, a + self.chunk_tokens)
            compute_end += self.prefill_seconds(a, b)
            sent_end = max(compute_end, sent_end) + (b - a) * self.kv_bytes_per_token(kv_bits) / bytes_per_s
        return sent_end - compute_end


def projection_rows(proj: Projection = Projection(), prompts=(2048, 8192, 32768)) -> list[dict]:
    """One row per prompt length (tokens) x link x KV format (bf16, 4-bit): KV bytes, prefill and transfer
    seconds, whether the transfer fits inside prefill, and the seconds exposed after prefill."""
    rows = []
    for t in prompts:
        prefill = proj.prefill_seconds(0, t)
        for link, bw in proj.links:
            for label, bits in (("bf16", None), ("4-bit", 4)):
                nbytes = t * proj.kv_bytes_per_token(bits)
                rows.append({"tokens": t, "link": link, "format": label, "kv_bytes": nbytes, "prefill_s": prefill,
                             "transfer_s": nbytes / bw, "hidden": nbytes / bw <= prefill,
                             "exposed_s": proj.exposed_seconds(t, bw, bits)})
    return rows
