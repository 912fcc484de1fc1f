"""The transfer handshake: what a sender presents, and how a receiver answers.

Before any block moves, the prefill worker sends an `offer` (wire.Offer) carrying its `KVFormat` and the
prompt's token ids. The decode worker answers with exactly one of:

- `reserved`: it allocated every block the prompt needs (so a burst of transfers can never run it out of
  memory) and says how many leading blocks it already holds in its prefix cache (`num_cached_blocks`),
  in RAM or on its SSD tier (read from disk into the reserved blocks there and then, before it answers);
  the sender skips those. With recurrent layers too: the transfer's last message carries the state after
  the whole prompt, so any cached KV prefix is reused, restore point or not. The reservation carries an `epoch`, which every later message of the transfer
  repeats: a message whose (request_id, epoch) is no longer live is dropped before it touches memory.
- `refused`: the transfer can never succeed here (a KV format or model mismatch, named field by field; a
  prompt longer than the context or the whole pool; a duplicate request id).
- `busy`: not enough free blocks right now (backpressure); the sender retries after `retry_after_s` until
  its deadline (`TransferConfig.reserve_timeout_s`).

`reserve` below is the receiver's decision, through its worker's `KVManager` (no sockets; arrays only where
the SSD tier's blocks are loaded).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Annotated, Callable, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from cluster.kv.hashing import carried_hashes, extend_block_hashes, first_block_key
from cluster.kv.manager import KVManager
from cluster.kv.store import shipped_num_layers

# Fields whose mismatch makes transferred KV meaningless, in the order a refusal names them.
_CHECKED = ("model_id", "revision", "dtype", "kv_bits", "kv_group_size", "block_size", "num_layers",
            "num_kv_heads", "head_dim", "value_dim", "layer_kinds", "state", "speculative_kv")


class StateArray(BaseModel):
    """One array of one recurrent layer's per-sequence state: its dtype and shape without the batch axis."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    dtype: str = Field(pattern="^(float32|float16|bfloat16)$")
    shape: list[Annotated[int, Field(ge=1, lt=2**31)]] = Field(max_length=8)


class KVFormat(BaseModel):
    """What a block's bytes mean: model weights, dtype and quantization, geometry.

    `revision` is the weights' content hash (cluster.model.ModelSpec.revision); `value_dim` is the width of a
    cached value head where it differs from the key's `head_dim` (latent attention), else None;
    `layer_kinds` names what each layer caches (`cluster.model_structure.LayerKind.name`: attention, a
    sliding window, recurrent state, or state beside attention; empty when every layer is plain attention);
    `state` lists the arrays of one sequence's recurrent state, layer by layer (cluster/kv/recurrent_state.py),
    which a transfer carries after the blocks, in the model's dtype; `speculative_kv` is True when the
    worker's speculative decoding keeps KV of its own (a draft model) that transfers must carry too.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    model_id: str = Field(max_length=1024)
    revision: str = Field(max_length=256)
    dtype: str = Field(pattern="^(float32|float16|bfloat16)$")
    kv_bits: Optional[int] = Field(default=None, ge=4, le=8)
    kv_group_size: int = Field(ge=32, le=128)
    block_size: int = Field(ge=1, le=1024)
    num_layers: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=1024)
    head_dim: int = Field(ge=1, le=4096)
    value_dim: Optional[int] = Field(default=None, ge=1, le=4096)
    layer_kinds: list[str] = Field(default=[], max_length=1024)
    state: list[list[StateArray]] = Field(default=[], max_length=1024)
    speculative_kv: bool = False

    @classmethod
    def of(cls, spec, config, speculative_kv: bool = False, layer_kinds: Sequence[str] = (),
           state_shapes: Sequence = ()) -> "KVFormat":
        """The format of an engine with `spec` (cluster.model.ModelSpec) and `config` (EngineConfig);
        `layer_kinds` (`VerifiedModel.layer_kind_names`) and `state_shapes` (`ModelRunner.state_shapes`:
        per recurrent layer, per array, (shape, mx.Dtype)) for models with more than full attention."""
        state = [[StateArray(dtype=str(dtype).removeprefix("mlx.core."), shape=list(shape)) for shape, dtype in layer]
                 for layer in state_shapes]
        return cls(model_id=spec.model_id, revision=spec.revision, dtype=config.dtype, kv_bits=config.kv_bits,
                   kv_group_size=config.kv_group_size, block_size=config.block_size, num_layers=spec.num_layers,
                   num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, value_dim=spec.value_dim,
                   layer_kinds=list(layer_kinds), state=state, speculative_kv=speculative_kv)

    @classmethod
    def of_engine(cls, engine) -> "KVFormat":
        """The format of the blocks and state of a `cluster.engine.EngineCore` (its model, config, layers), as
        they travel: a worker group's whole heads (`KVStore.wire_kv_heads`) and whole model's layers
        (`shipped_num_layers`; a pipeline group's leader sets `engine.group_layer_kinds`)."""
        stores = [g.store for g in engine.kv.block_groups if getattr(g, "store", None) is not None]
        layers = engine.spec.num_layers + sum(shipped_num_layers(s) - s.spec.num_layers for s in stores)
        spec = dataclasses.replace(engine.spec, num_kv_heads=engine.store.wire_kv_heads, num_layers=layers)
        kinds = engine.group_layer_kinds or engine.runner.verified.layer_kind_names
        return cls.of(spec, engine.config, layer_kinds=kinds, state_shapes=engine.kv.state_shapes())

    def mismatches(self, other: "KVFormat") -> list[str]:
        """Human-readable differences, e.g. ["kv_bits: sender 4, receiver 8"] (self = the receiver)."""
        def shown(fmt: "KVFormat", name: str):
            value = getattr(fmt, name)
            return [[f"{a.dtype}{a.shape}" for a in layer] for layer in value] if name == "state" else value

        return [f"{name}: sender {shown(other, name)!r}, receiver {shown(self, name)!r}"
                for name in _CHECKED if getattr(self, name) != getattr(other, name)]

    def extra_key(self, cache_salt: Optional[str] = None) -> int:
        """The first block's hash key, identical to the engine's (cluster.kv.hashing)."""
        return first_block_key(self.model_id, self.revision, self.dtype, self.kv_bits, self.kv_group_size,
                               self.block_size, cache_salt)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: Optional[str] = None, carried: Sequence[int] = (),
                     carried_key: Optional[int] = None) -> list[int]:
        """Chained hashes of the full blocks of `token_ids` in this format: `carried`, those computed elsewhere
        under the first-block key `carried_key`, where that key is this format's (`carried_hashes`), then the
        rest hashed here."""
        key = self.extra_key(cache_salt)
        known = carried_hashes(carried, carried_key, key, len(token_ids), self.block_size)
        return extend_block_hashes(known, token_ids, self.block_size, key)


@dataclass(frozen=True)
class Reservation:
    """Blocks a receiver set aside for one prompt, in every KV cache group with blocks (`tables`, by group
    index, each covering every prompt position; the first group's is `block_table`): the first
    `num_cached_blocks` entries already hold the right KV (prefix-cache hits, referenced), and group g is sent
    from block `first_sent[g]` on (0 before it: out of every later query's reach, never sent)."""

    tables: tuple[tuple[int, ...], ...]
    num_cached_blocks: int
    first_sent: tuple[int, ...]

    @property
    def block_table(self) -> tuple[int, ...]:
        return self.tables[0]


@dataclass(frozen=True)
class Refusal:
    reason: str


@dataclass(frozen=True)
class Busy:
    retry_after_s: float


def reserve(kv: KVManager, request_id: str, fmt: KVFormat, offered: KVFormat, token_ids: Sequence[int],
            hashes: Sequence[int], max_prompt_len: int, watermark_blocks: int = 0,
            retry_after_s: Callable[[], float] = lambda: 0.05) -> Union[Reservation, Refusal, Busy]:
    """Decide an offer of `token_ids` (with their full-block `hashes` in the receiver's format `fmt`) for
    `request_id`, reserving through the worker's block owner `kv`.

    Refuses a format mismatch (naming each differing field), an empty prompt, a prompt of `max_prompt_len`
    tokens or more, or one needing more blocks than the pool has at all. Answers Busy when fewer than
    `needed + watermark_blocks` blocks are free. Otherwise holds the cached prefix (referenced) and the rest,
    newly allocated, under `request_id` (`KVManager.reserve`), so the reservation can never fail later for
    lack of memory; the holding ends with `KVManager.release` or when the request adopts it.
    """
    diff = fmt.mismatches(offered)
    if diff:
        return Refusal("KV format mismatch (" + "; ".join(diff) + "): start both workers with the same model "
                       "and KV settings")
    n = len(token_ids)
    if n == 0:
        return Refusal("the prompt is empty")
    if n >= max_prompt_len:
        return Refusal(f"the prompt has {n} tokens but the receiver's context limit is {max_prompt_len}")
    if kv.has(request_id):
        return Refusal(f"request_id {request_id!r} already holds KV here (a finished transfer awaits its request)")
    pool = kv.pool
    needed = -(-n // fmt.block_size)
    if needed > pool.num_usable_blocks:
        return Refusal(f"the prompt needs {needed} KV blocks but the receiver's pool has "
                       f"{pool.num_usable_blocks}")
    # the state comes with the blocks; blocks on the SSD tier are loaded here instead of sent
    hit = kv.lookup(hashes, token_ids, len(hashes), state_shipped=True, tier=True)
    if kv.free_besides(hit) < needed - hit.num_blocks + watermark_blocks:
        return Busy(retry_after_s())
    held = kv.reserve(request_id, hit, needed, n)
    return Reservation(held.tables, held.num_cached_tokens // fmt.block_size, held.first_sent)
