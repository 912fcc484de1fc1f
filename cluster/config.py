"""Engine configuration: frozen dataclasses validated on construction.

A bad value raises `ValueError` naming the field and the rule, so a typo in a topology file or on the
command line fails at start, never mid-request.
"""

from __future__ import annotations

import dataclasses

import sys
from dataclasses import dataclass, field
from typing import Optional

from cluster.request import MAX_DRAFT_TOKENS, SPECULATIVE_METHODS

KV_DTYPES = ("float32", "bfloat16", "float16")


def default_dtype() -> str:
    """bfloat16 on a Mac (Metal); float32 elsewhere, the fastest dtype on MLX's CPU backend."""
    return "bfloat16" if sys.platform == "darwin" else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """How one engine (a colocated single-node engine or a decode/prefill worker) runs its model.

    - `block_size`: tokens per KV block, the unit of hashing, prefix reuse, transfer and quantization.
    - `kv_cache_gb`: the KV pool's byte budget in GiB (2**30 bytes); the number of blocks follows from the
      model's bytes per block (see `cluster.kv.store.kv_bytes_per_block`). `num_blocks`, when set, wins.
      For a model with recurrent layers it also holds the `state_cache_gb` of state snapshots and the
      recurrent states of `max_num_seqs` running sequences.
    - `max_num_seqs`: sequences in the running batch at most; None = follows the KV budget
      (`cluster.kv.plan.auto_max_num_seqs`: one sequence per `AUTO_TOKENS_PER_SEQ` tokens of the pool, at
      least 16, at most 256).
    - `max_num_batched_tokens`: tokens per engine step at most (decode tokens, drafts and prompt chunks
      together; vLLM's token budget); None = max(prefill_chunk_size, max_num_seqs + block_size). It must
      leave a block for prompts beside one token of every running sequence.
    - `itl_target_ms`: while sequences decode, a step's prompt chunk is sized so that the step takes at most
      this long (the streams' inter-token latency); None = twice the measured decode step.
    - `prefill_slowdown`: a long prompt computed beside decoding streams finishes within about this many times
      its prefill time alone (predicted by the step budget's cost model when its first chunk runs); where the
      ITL target's share of each step would not get it there, its chunks grow until it does, stretching the
      streams' steps to twice the ITL target at most. None: the ITL target alone sizes the chunks (the prompt
      gets what the streams leave).
    - `async_scheduling`: the overlapped loop: a step's plain rows (no grammar, drafts, penalties or logprobs)
      sample on the device and are read back after the next step is built and dispatched, so the host's
      scheduling and bookkeeping overlap the device's compute (vLLM's async scheduling; mlx-lm's generation
      loop). Off for models with recurrent layers. False: every step is read back before the next.
    - `long_prefill_token_threshold`: a prompt with at most this many tokens left is never cut into chunks
      while others decode, so short requests keep their TTFT; the whole short prompts of one step add up to at
      most this many tokens.
    - `prefill_chunk_size`: tokens of one prompt computed per engine step at most (2048 as in the seeds);
      it is also the step's token budget for prefill, so one long prompt never freezes running streams.
    - `max_model_len`: context limit in tokens; None = the model's `max_position_embeddings`.
    - `dtype`: weights and KV dtype; float32 is the fastest on MLX's CPU backend (measured: bf16 ~2.5x and
      fp16 ~4x slower), bfloat16 is the usual choice on a Mac.
    - `kv_bits` / `kv_group_size`: quantized KV (mlx-lm's names); None = unquantized.
    - `enable_prefix_caching`: reuse cached full blocks across requests.
    - `skip_load_check`: skip the load check (cluster/load_check.py) for a family the tests cover
      (`cluster.model_families.FAMILIES`); any other family is checked regardless.
    - `state_cache_gb`: GiB for recurrent-state snapshots, the prefix cache of models with recurrent layers
      (cluster/kv/snapshots.py; LRU by bytes). Taken from `kv_cache_gb` (the pool gets the rest; with
      `num_blocks` set, on top of it); None = half of `kv_cache_gb`; 0 keeps none, so such a model recomputes every prompt in full. Unused
      by models without recurrent layers or with the prefix cache off.
    - `state_snapshot_interval`: tokens between the state snapshots taken while a prompt is computed (a
      multiple of `block_size`; prefill chunks end there); None = `prefill_chunk_size` rounded down to whole
      blocks. When the sequence finishes, those at 1, 2, 4, 8, ... intervals stay (a later prompt sharing a
      long prefix, such as a system prompt, restores from one) and the rest are dropped.
    - `ssd_cache_gb`: GiB of disk for the SSD tier under the pool (cluster/kv/disk_tier.py): every cached block
      is also written there (and every recurrent-state snapshot), prefix hits reach it, and it survives a
      restart; 0 (default) keeps none. Not in a worker group (logged). `ssd_cache_dir`: its folder (None:
      `kv-tier` in mlx-pd's cache folder, `$MLX_PD_CACHE` or ~/.cache/mlx-pd, and in it one per cluster worker,
      by name); each server needs its own.
    - `max_waiting`: requests queued (beyond those the next step admits into free running slots) before new
      ones get 503 with Retry-After; a request whose `n` exceeds `max_num_seqs + max_waiting` gets 400.
    - `decode_mirror_gb`: GiB for contiguous copies of the decode batch's contexts kept between decode
      steps (`cluster.kv.decode_mirror`); None = as large as the KV pool, 0 disables it (every step gathers
      from the pool). Not part of `kv_cache_gb`: the two add up to the KV memory at most (the mirror holds
      only the running batch's contexts, so it is usually far smaller).
    - `queue_timeout_s`: a request still waiting for its first admission after this many seconds (the KV
      pool stayed full) is aborted with a message; the router answers 503 with Retry-After.
    - `speculative_method`: speculative decoding for requests that do not choose ("prompt_lookup" or
      "draft_model", see decode_node/speculative.py); None = off unless a request asks for it.
    - `num_draft_tokens`: the most draft tokens per sequence per step for requests that do not choose
      (1..16); each sequence adapts its own number below it to its acceptance rate.
    - `draft_model`: the draft model's source (anything `--model` accepts; it must share the target's
      tokenizer). None = a copy of the target, quantized to `draft_quantize_bits` (4 when unset). A draft
      model is loaded when this is set or `speculative_method` is "draft_model". Its KV lives in a second
      pool of `num_blocks` blocks of its own size (same block ids, same KV format), on top of `kv_cache_gb`.
    - `draft_quantize_bits`: quantize the draft model's weights (4 or 8 bits, mlx's `nn.quantize`); None =
      as loaded (4 for a copy of the target).
    - `draft_cost_per_token`: a draft token's cost relative to a plain decode step, which the adaptive draft
      length weighs against the acceptance rate (decode_node/speculative.py); None = measured at load (the draft's
      forward time over the target's, plus verification). Above ~1 the draft model never pays and each
      sequence's draft length stays at 0 apart from probes.
    """

    block_size: int = 32
    kv_cache_gb: float = 1.0
    num_blocks: Optional[int] = None
    max_num_seqs: Optional[int] = None
    prefill_chunk_size: int = 2048
    max_num_batched_tokens: Optional[int] = None
    itl_target_ms: Optional[float] = None
    prefill_slowdown: Optional[float] = 1.25
    long_prefill_token_threshold: int = 256
    async_scheduling: bool = True
    max_model_len: Optional[int] = None
    dtype: str = field(default_factory=default_dtype)
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    enable_prefix_caching: bool = True
    state_cache_gb: Optional[float] = None
    state_snapshot_interval: Optional[int] = None
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: Optional[str] = None
    max_waiting: int = 256
    queue_timeout_s: float = 120.0
    decode_mirror_gb: Optional[float] = None
    speculative_method: Optional[str] = None
    num_draft_tokens: int = 4
    draft_model: Optional[str] = None
    draft_quantize_bits: Optional[int] = None
    draft_cost_per_token: Optional[float] = None
    skip_load_check: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {rule}")

        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise bad("block_size", "must be an integer in [1, 1024]")
        if self.num_blocks is None and not self.kv_cache_gb > 0:
            raise bad("kv_cache_gb", "must be > 0")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise bad("num_blocks", "must be >= 2 (block 0 is reserved as the null block)")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1 or unset (follows the KV budget)")
        if self.prefill_chunk_size < 1:
            raise bad("prefill_chunk_size", "must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < (
                (self.max_num_seqs or 1) + self.block_size):
            raise bad("max_num_batched_tokens", "must hold one token of every running sequence and a block of "
                      f"prompt: at least max_num_seqs + block_size = {(self.max_num_seqs or 1) + self.block_size}")
        if self.itl_target_ms is not None and not self.itl_target_ms > 0:
            raise bad("itl_target_ms", "must be > 0 milliseconds or unset (twice the measured decode step)")
        if self.prefill_slowdown is not None and not self.prefill_slowdown > 1:
            raise bad("prefill_slowdown", "must be > 1 (times a prompt's prefill alone) or unset (the ITL target "
                      "alone bounds its chunks)")
        if self.long_prefill_token_threshold < 0:
            raise bad("long_prefill_token_threshold", "must be >= 0 tokens")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.dtype not in KV_DTYPES:
            raise bad("dtype", f"must be one of {', '.join(KV_DTYPES)}")
        if self.kv_bits not in (None, 4, 8):
            raise bad("kv_bits", "must be 4, 8 or unset")
        if self.kv_group_size not in (32, 64, 128):
            raise bad("kv_group_size", "must be 32, 64 or 128 (the group sizes mx.quantize accepts)")
        if self.decode_mirror_gb is not None and not self.decode_mirror_gb >= 0:
            raise bad("decode_mirror_gb", "must be >= 0 (0 disables the decode mirror)")
        if self.state_snapshot_interval is not None and (self.state_snapshot_interval < self.block_size
                                                         or self.state_snapshot_interval % self.block_size):
            raise bad("state_snapshot_interval", f"must be a positive multiple of block_size={self.block_size}")
        if self.state_cache_gb is not None and not self.state_cache_gb >= 0:
            raise bad("state_cache_gb", "must be >= 0 GiB (0 keeps no recurrent-state snapshots)")
        if not 0 <= self.ssd_cache_gb < float("inf"):
            raise bad("ssd_cache_gb", "must be a finite number of GiB >= 0 (0 keeps no SSD tier)")
        if not self.queue_timeout_s > 0:
            raise bad("queue_timeout_s", "must be > 0 seconds")
        if self.max_waiting < 1:
            raise bad("max_waiting", "must be >= 1")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise bad("speculative_method", f"must be one of {', '.join(SPECULATIVE_METHODS)} or unset")
        if not isinstance(self.num_draft_tokens, int) or not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise bad("num_draft_tokens", f"must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise bad("draft_model", "must be a model folder, .gguf file or repo id, or unset (a copy of the target)")
        if self.draft_quantize_bits not in (None, 4, 8):
            raise bad("draft_quantize_bits", "must be 4, 8 or unset")
        if self.draft_cost_per_token is not None and not 0 <= self.draft_cost_per_token < 100:
            raise bad("draft_cost_per_token", "must be in [0, 100) or unset (measured at load)")

    @property
    def uses_draft_model(self) -> bool:
        """True when this engine loads a draft model (decode_node/drafters.py builds it)."""
        return self.speculative_method == "draft_model" or self.draft_model is not None


@dataclass(frozen=True)
class TransferConfig:
    """How KV blocks move between a prefill worker and a decode worker (`kv_transfer/`).

    - `timeout_s`: every wait of a transfer has this deadline (seconds): the sender's wait for a reservation
      answer and for the final acknowledgement, and the receiver's wait between two messages of a transfer.
      On expiry both sides free their blocks and report an error. A prefill chunk must compute within it, so
      on slow machines (MLX's CPU backend: ~50 prompt tokens/s for a 135M model) use smaller chunks or more time.
    - `reserve_timeout_s`: how long a sender keeps retrying a receiver that answers "busy" (no free blocks);
      None = `timeout_s` for a bare KVSender, and the engine's `queue_timeout_s` (if longer) in a prefill
      worker, since a request waiting for decode capacity is queued, not stuck.
    - `max_blocks_per_message`: blocks per `blocks` message at most (one 2048-token chunk is 64 blocks of 32).
    - `layers_per_message`: None sends all layers of a block batch in one message; a number splits it by
      layers (smaller frames, earlier first bytes on slow links).
    - `watermark_blocks`: a receiver answers "busy" rather than reserve when fewer than this many blocks
      would stay free (room for the running sequences' next tokens).
    - `max_frame_bytes`: the largest frame a receiver accepts (ZeroMQ drops the peer beyond it).
    - `max_message_bytes`: a `blocks` message's KV bytes at most (layers, then blocks, are split to fit). A
      message is encrypted (CurveZMQ), written, received and decrypted whole, so one message of a whole chunk
      (94 MB for 2048 float32 tokens of SmolLM2) serializes those steps; messages of a few MB overlap them:
      measured over a 1 Gbit/s link with CurveZMQ, float32 KV moved at 0.71x the link in one message a chunk
      and 0.93x in 12.5 MB messages (docs/BENCHMARKS.md, "KV over a shaped link").
    """

    timeout_s: float = 30.0
    reserve_timeout_s: Optional[float] = None
    max_blocks_per_message: int = 64
    layers_per_message: Optional[int] = None
    watermark_blocks: int = 0
    max_frame_bytes: int = 2**31
    max_message_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {rule}")

        if not self.timeout_s > 0:
            raise bad("timeout_s", "must be > 0 seconds")
        if self.reserve_timeout_s is not None and not self.reserve_timeout_s > 0:
            raise bad("reserve_timeout_s", "must be > 0 seconds or unset")
        if self.max_blocks_per_message < 1:
            raise bad("max_blocks_per_message", "must be >= 1")
        if self.layers_per_message is not None and self.layers_per_message < 1:
            raise bad("layers_per_message", "must be >= 1 or unset")
        if self.watermark_blocks < 0:
            raise bad("watermark_blocks", "must be >= 0")
        if self.max_frame_bytes < 1024:
            raise bad("max_frame_bytes", "must be >= 1024")
        if self.max_message_bytes < 1024:
            raise bad("max_message_bytes", "must be >= 1024")

    @property
    def reserve_deadline_s(self) -> float:
        return self.timeout_s if self.reserve_timeout_s is None else self.reserve_timeout_s

    def for_prefill_worker(self, queue_timeout_s: float) -> "TransferConfig":
        """This config as a prefill worker uses it: unless `reserve_timeout_s` is set, a decode worker that
        answers "busy" is retried as long as a request may wait in a queue (`queue_timeout_s`, if longer)."""
        if self.reserve_timeout_s is not None:
            return self
        return dataclasses.replace(self, reserve_timeout_s=max(self.timeout_s, queue_timeout_s))

    def kv_start_deadline_s(self, prefill_queue_timeout_s: float) -> float:
        """Seconds a decode worker waits for the transfer of a prefilled request to start (its first message,
        an offer): the prefill worker may queue the request for `prefill_queue_timeout_s`, then retry "busy"
        answers for its reserve deadline (`for_prefill_worker`), and an offer may take one `timeout_s`."""
        reserve = self.for_prefill_worker(prefill_queue_timeout_s).reserve_deadline_s
        return prefill_queue_timeout_s + reserve + self.timeout_s
