"""Every measured number against the hardware's limit: the prefill fit, MFU, MBU and KV capacity.

Formulas (no model, no MLX; `mlx-pd profile` feeds them measurements):

- **Prefill time** of a T-token prompt, fitted by least squares as ``t(T) = a*T + b*T^2`` (seconds): the
  linear term is the weight matmuls (2 x params FLOPs per token), the quadratic term causal attention
  (QK^T and PV over T/2 keys on average per query). No intercept, by the model's definition; the fixed
  per-request cost ends up in the residuals (and in `a` at short lengths).
- **MFU** (model FLOP/s utilization, PaLM: Chowdhery et al. 2022, appendix B): achieved FLOP/s over peak,
  with the forward pass counted as 2 x N FLOPs per token (Kaplan et al. 2020, "C_forward ~ 2N"):
  ``MFU = 2 * N * tokens_per_s / peak_flops``. N is the matmul parameters: the embedding lookup is no
  matmul, and mlx-pd runs the lm_head on the last prompt row only (cluster/runner.py). Attention's own
  FLOPs are left out, as in that convention, so MFU understates the work done at long prompts.
- **MBU** (model bandwidth utilization, the "LLM inference roofline" convention: Pope et al. 2022,
  "Efficiently Scaling Transformer Inference"; Databricks' "LLM inference performance engineering", 2023):
  a decode step reads every weight once and each sequence's KV once, so
  ``MBU = (param_bytes + kv_bytes_read_per_step) * steps_per_s / peak_bandwidth``.
- **Capacity**: sequences of a given context length that fit a KV budget, counted in whole blocks as the
  pool allocates them: ``floor(usable_blocks / ceil(context / block_size))``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PrefillFit:
    """``t(T) = a*T + b*T^2`` fitted to (tokens, seconds) points, and how well it fits.

    `a` in s/token, `b` in s/token^2; `r2` is the coefficient of determination about the mean of the
    measured times (1 - SS_res / SS_tot; the conservative, centered form even without an intercept);
    `residuals_s` = measured - predicted per point, in input order; `rms_residual_s` their root mean
    square; `max_rel_residual` the largest |residual| / measured.
    """

    a: float
    b: float
    r2: float
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    residuals_s: tuple[float, ...]
    rms_residual_s: float
    max_rel_residual: float

    def predict(self, tokens: float) -> float:
        """Predicted prefill seconds of a `tokens`-token prompt."""
        return self.a * tokens + self.b * tokens * tokens

    def to_dict(self) -> dict:
        return asdict(self)


def fit_prefill(tokens: Sequence[float], seconds: Sequence[float]) -> PrefillFit:
    """Least-squares fit of ``seconds = a*tokens + b*tokens^2`` (see :class:`PrefillFit`).

    Needs at least two distinct token counts; the columns are scaled before solving so that T^2 (up to
    ~10^8) does not swamp T.

    >>> f = fit_prefill([100, 200, 400], [0.1 * 100 + 1e-4 * 100**2, 0.1 * 200 + 1e-4 * 200**2, 0.1 * 400 + 1e-4 * 400**2])
    >>> round(f.a, 6), round(f.b, 8), round(f.r2, 6)
    (0.1, 0.0001, 1.0)
    """
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"tokens and seconds must be equal-length lists, got {t.shape} and {y.shape}")
    if len(np.unique(t)) < 2:
        raise ValueError(f"the fit needs at least two distinct prompt lengths, got {sorted(set(t.tolist()))}")
    scale = float(t.max())
    X = np.stack([t / scale, (t / scale) ** 2], axis=1)
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    a, b = coef[0] / scale, coef[1] / scale**2
    pred = a * t + b * t * t
    res = y - pred
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res**2).sum()) / ss_tot if ss_tot > 0 else (1.0 if not res.any() else math.nan)
    rel = np.abs(res) / np.where(y > 0, y, np.nan)
    return PrefillFit(a=float(a), b=float(b), r2=r2, tokens=tuple(int(v) for v in t),
                      seconds=tuple(float(v) for v in y), residuals_s=tuple(float(v) for v in res),
                      rms_residual_s=float(np.sqrt((res**2).mean())),
                      max_rel_residual=float(np.nanmax(rel)) if np.isfinite(rel).any() else math.nan)


def held_out_errors(fit: PrefillFit, tokens: Sequence[int], seconds: Sequence[float]) -> list[dict]:
    """For prompt lengths left out of the fit: {tokens, measured_s, predicted_s, rel_error} with
    rel_error = (predicted - measured) / measured."""
    out = []
    for n, s in zip(tokens, seconds):
        p = fit.predict(n)
        out.append({"tokens": int(n), "measured_s": float(s), "predicted_s": p,
                    "rel_error": (p - s) / s if s > 0 else math.nan})
    return out


def mfu(matmul_params: float, tokens_per_s: float, peak_flops: float) -> float:
    """Prefill MFU = 2 * N * tokens/s / peak FLOP/s (see the module doc); NaN without a peak."""
    return 2.0 * matmul_params * tokens_per_s / peak_flops if peak_flops > 0 else math.nan


def decode_bytes_per_step(param_bytes: float, kv_bytes_per_token: float, context_lens: Sequence[int]) -> float:
    """Bytes one decode step reads: every weight once, plus each sequence's KV (its context length)."""
    return param_bytes + kv_bytes_per_token * float(sum(context_lens))


def mbu(bytes_per_step: float, steps_per_s: float, peak_bytes_per_s: float) -> float:
    """Decode MBU = bytes read per step * steps/s / peak bandwidth (see the module doc)."""
    return bytes_per_step * steps_per_s / peak_bytes_per_s if peak_bytes_per_s > 0 else math.nan


def decode_roofline_tokens_per_s(batch: int, bytes_per_step: float, peak_bytes_per_s: float) -> float:
    """The bandwidth roofline of batched decode: `batch` tokens per step, a step no faster than its bytes
    over the peak bandwidth (compute ignored; true while batch is far below the ridge point)."""
    return batch * peak_bytes_per_s / bytes_per_step if bytes_per_step > 0 else math.nan


def capacity(kv_budget_blocks: int, block_size: int, context_len: int) -> int:
    """Sequences of `context_len` tokens that fit `kv_budget_blocks` usable blocks (whole blocks each)."""
    if block_size < 1 or context_len < 1:
        raise ValueError(f"block_size and context_len must be >= 1, got {block_size} and {context_len}")
    return max(0, kv_budget_blocks) // math.ceil(context_len / block_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float,
                       kv_bits: int | None = None, kv_group_size: int = 64) -> float:
    """KV bytes of one token across all layers (K and V), from the model's config.

    Unquantized: layers x 2 x kv_heads x head_dim x dtype bytes. With `kv_bits`: bits/8 bytes per value
    plus a scale and a bias of `dtype_bytes` per `kv_group_size` values (mx.quantize's format, as
    cluster.kv.store.kv_bytes_per_block counts it).

    >>> kv_bytes_per_token(30, 3, 64, 4)      # SmolLM2-135M, float32
    46080
    >>> kv_bytes_per_token(32, 8, 128, 2, kv_bits=4)   # Llama-3.1-8B, 4-bit, bf16 scales
    36864.0
    """
    values = num_layers * 2 * num_kv_heads * head_dim
    if kv_bits is None:
        return values * dtype_bytes
    return values * kv_bits / 8 + 2 * values / kv_group_size * dtype_bytes
