"""The model families the engine reproduces exactly, and the gate that refuses every other one at load.

The engine runs mlx-lm's own model classes over its paged KV cache (cluster/kv/cache_view.py) and applies the
output head itself, on the rows that need logits only (cluster/runner.py). That reproduces mlx-lm's
generation only when three things hold, so a model is served only when all three are checked:

- the family (`model_type`) is in `FAMILIES`: its mlx-lm `Model.__call__` was read and its output head is
  written down here (`Family.head`), and its attention's score layout is known (`Family.mask_rank`);
- every layer is full attention over a plain KV cache (`make_cache` gives `KVCache`), or, in a family whose
  body was read to ask the cache for a windowed mask (`Family.sliding_windows`), a sliding window
  (`RotatingKVCache` of the model's `sliding_window`, no kept prefix), or, in a family whose recurrent
  layers were read to honour `ArraysCache.lengths` (`Family.recurrent`), recurrent state (`ArraysCache`),
  alone or beside a KV cache in one layer (`CacheList(ArraysCache, KVCache)`, falcon_h1); each attention
  with a position-only rotary embedding (batched steps give rope one offset per row);
- the model object is the verified mlx-lm class, and the head's weights are where that class reads them.

Anything else raises ValueError at load (config.json: `check_config`; the model object: `verify_model`,
called when an engine or a runner is built), naming the model type, layer or head and listing what is
served, so that a server never answers /health for a model it would fail on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx


def linear_head(model) -> Callable[[mx.array], mx.array]:
    """The plain head of `Model.__call__`: the tied embedding's `as_linear` when `args.tie_word_embeddings`,
    else `lm_head`. Raises ValueError when the weights are not there."""
    return _projection(model, getattr(model.args, "tie_word_embeddings", False))


def _projection(model, tied: bool) -> Callable[[mx.array], mx.array]:
    """`model.model.embed_tokens.as_linear` when `tied`, else `model.lm_head`; ValueError when absent."""
    if tied:
        embed = getattr(model.model, "embed_tokens", None)
        if not hasattr(embed, "as_linear"):
            raise ValueError("the output head is tied to embed_tokens, which has no as_linear")
        return embed.as_linear
    if not hasattr(model, "lm_head"):
        raise ValueError("the output head is untied but the model has no lm_head")
    return model.lm_head


def granite_head(model) -> Callable[[mx.array], mx.array]:
    """granite: the plain head divided by `logits_scaling`."""
    base, scale = linear_head(model), model.logits_scaling

    def head(hidden: mx.array) -> mx.array:
        return base(hidden) / scale

    return head


def gemma2_head(model) -> Callable[[mx.array], mx.array]:
    """gemma2: tied embeddings, then tanh soft-capping at `final_logit_softcapping` (always tied in mlx-lm)."""
    embed = getattr(model.model, "embed_tokens", None)
    if not hasattr(embed, "as_linear"):
        raise ValueError("gemma2's output head is tied to embed_tokens, which has no as_linear")
    base, cap = embed.as_linear, model.final_logit_softcapping

    def head(hidden: mx.array) -> mx.array:
        return mx.tanh(base(hidden) / cap) * cap

    return head


def gemma3_head(model) -> Callable[[mx.array], mx.array]:
    """gemma3_text: the tied embedding's `as_linear` when the model's own `tie_word_embeddings` attribute is
    set (its `sanitize` sets it when the checkpoint has no lm_head), else `lm_head`; no soft cap."""
    return _projection(model, getattr(model, "tie_word_embeddings", False))


def attention_cache_dims(config: dict) -> tuple[int, int, Optional[int]]:
    """(KV heads, key width, value width or None for the key's) of one token's cache in a layer of
    multi-head or grouped-query attention, from config.json: num_key_value_heads (else num_attention_heads)
    heads of head_dim (else hidden_size / num_attention_heads)."""
    heads = config["num_attention_heads"]
    return config.get("num_key_value_heads") or heads, config.get("head_dim") or config["hidden_size"] // heads, None


def latent_cache_dims(config: dict) -> tuple[int, int, Optional[int]]:
    """Multi-head latent attention as mlx-lm's deepseek_v3 caches it (`cache.update_and_fetch(kv_latent,
    k_pe)`): one head per token, the normalized latent (kv_lora_rank values) as its key and the rotary key
    (qk_rope_head_dim values) as its value."""
    return 1, config["kv_lora_rank"], config["qk_rope_head_dim"]


def falcon_h1_head(model) -> Callable[[mx.array], mx.array]:
    """falcon_h1: the tied embedding's `as_linear` times lm_head_multiplier / embedding_multiplier (its
    `Model.__call__`), else `lm_head` (whose multiplier `sanitize` folds into the weights)."""
    args = model.args
    if not args.tie_word_embeddings:
        return _projection(model, False)
    base, scale = _projection(model, True), args.lm_head_multiplier / args.embedding_multiplier

    def head(hidden: mx.array) -> mx.array:
        return base(hidden) * scale

    return head


def every_layer(config: dict) -> int:
    """The layers that cache KV: all `num_hidden_layers`."""
    return config["num_hidden_layers"]


def qwen3_next_attention_layers(config: dict) -> int:
    """qwen3_next: layer i is full attention when (i + 1) % full_attention_interval == 0 (its decoder layer's
    `is_linear`), the rest Gated DeltaNet, which caches no KV."""
    interval = config.get("full_attention_interval", 4)
    return sum(1 for i in range(config["num_hidden_layers"]) if (i + 1) % interval == 0)


def _four_d(model) -> int:
    return 4


def _split_heads_when_grouped(model) -> int:
    """5 when the attention reshapes queries to [B, kv_heads, repeats, T, head_dim] (repeats > 1), else 4."""
    return 5 if any(layer.self_attn.repeats > 1 for layer in model.layers) else 4


@dataclass(frozen=True)
class Family:
    """One verified family.

    `module`: the mlx-lm module whose `Model` class is verified (`mlx_lm.models.<module>`).
    `head(model)`: builds the output head, hidden [..., hidden_size] -> logits [..., vocab] in the model's
    dtype, exactly what `Model.__call__` does after the body `model.model`.
    `mask_rank(model)`: the rank of the batched attention mask the attention's scores broadcast against: 4
    for [B, 1, T, L] over scores [B, heads, T, L]; 5 for [B, 1, 1, T, L] over [B, kv_heads, repeats, T, L].
    `reads_quantized_kv`: the attention goes through mlx-lm's `scaled_dot_product_attention`, which reads
    quantized caches (`bits`/`group_size`); when False, quantized KV is dequantized for attention.
    `cache_dims(config)`: (heads, key width, value width or None) of one token's cached K/V in a layer, from
    config.json's fields (`attention_cache_dims`; latent attention: `latent_cache_dims`).
    `sliding_windows`: the model's body asks the cache of a sliding-window layer for its mask with
    `window_size` equal to that layer's `RotatingKVCache.max_size` (read in its `__call__`), so the paged
    cache can serve those layers (cluster/kv/layout.py `windowed_mask`); when False, such a layer is refused.
    `recurrent`: the family's recurrent layers (ArraysCache state) read `lengths` to keep padding out of
    their state (read in their `__call__`: the conv window is taken at each row's end, the state update is
    masked), so batched steps keep each row exact (cluster/kv/recurrent_state.py); when False they are refused.
    `kv_layers(config)`: how many layers cache KV (the pool's layers), from config.json.
    """

    module: str
    head: Callable[[Any], Callable[[mx.array], mx.array]] = linear_head
    mask_rank: Callable[[Any], int] = _four_d
    reads_quantized_kv: bool = True
    sliding_windows: bool = False
    cache_dims: Callable[[dict], tuple[int, int, Optional[int]]] = attention_cache_dims
    recurrent: bool = False
    kv_layers: Callable[[dict], int] = every_layer


FAMILIES: dict[str, Family] = {
    # llama's body masks its "sliding_attention" layers (layer_types) with window_size = sliding_window
    "llama": Family("llama", sliding_windows=True),
    "mistral": Family("llama", sliding_windows=True),  # mlx-lm runs mistral checkpoints with its llama classes
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen3_moe": Family("qwen3_moe"),
    "mixtral": Family("mixtral"),
    "olmo2": Family("olmo2"),
    "phi3": Family("phi3"),
    # gemma2 computes attention itself: scores [B, kv_heads, repeats, T, L] when repeats > 1, float K/V only
    "gemma2": Family("gemma2", head=gemma2_head, mask_rank=_split_heads_when_grouped, reads_quantized_kv=False),
    "granite": Family("granite", head=granite_head),
    # sliding-window layers (every layer but each sliding_window_pattern-th) and global ones
    "gemma3_text": Family("gemma3_text", head=gemma3_head, sliding_windows=True),
    # sliding-window and full layers (layer_types), attention sinks: mlx-lm's quantized attention has no sinks
    "gpt_oss": Family("gpt_oss", reads_quantized_kv=False, sliding_windows=True),
    # multi-head latent attention: the cache holds the latent and the rope key; the attention computes with
    # them itself (expanding the latent for prompts, absorbing the projections for one-token steps)
    "deepseek_v3": Family("deepseek_v3", reads_quantized_kv=False, cache_dims=latent_cache_dims),
    # Gated DeltaNet layers (recurrent state) and every full_attention_interval-th layer full attention
    "qwen3_next": Family("qwen3_next", recurrent=True, kv_layers=qwen3_next_attention_layers),
    # every layer runs Mamba (recurrent state) and attention side by side
    "falcon_h1": Family("falcon_h1", head=falcon_h1_head, recurrent=True),
}

# rotary embeddings that depend on the position only (mx.fast.rope with per-row offsets)
_POSITIONAL_ROPES = {("mlx.nn.layers.positional_encoding", "RoPE"), ("mlx_lm.models.rope_utils", "Llama3RoPE"),
                     ("mlx_lm.models.rope_utils", "SuScaledRoPE"), ("mlx_lm.models.rope_utils", "YarnRoPE")}


def supported() -> str:
    """The verified model types, comma-separated, for error messages."""
    return ", ".join(FAMILIES)


def family_of(model_type: Optional[str]) -> Family:
    """The verified `Family` of `model_type`. Raises ValueError naming it and listing the served types."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not a family this engine serves exactly "
                         f"(served: {supported()})")
    return family


def check_config(config: dict) -> Family:
    """Gate on a config.json dict (before any weights load): its top-level `model_type` must be verified.
    Returns the Family; raises ValueError as `family_of`."""
    return family_of(config.get("model_type"))


@dataclass(frozen=True)
class LayerKind:
    """What one layer caches: `kv` its index among the pool's KV layers (None: no KV), `window` its sliding
    window in positions (None: full attention), `state` its index among the recurrent layers (None: none)."""

    kv: Optional[int] = None
    window: Optional[int] = None
    state: Optional[int] = None

    @property
    def name(self) -> str:
        """What the layer caches in words, as the KV transfer's handshake compares them: "attention",
        "window 4096", "state", "state + attention", "state + window 4096"."""
        kv = None if self.kv is None else "attention" if self.window is None else f"window {self.window}"
        return " + ".join(p for p in ("state" if self.state is not None else None, kv) if p)


@dataclass(frozen=True)
class VerifiedModel:
    """What the runner needs of a model that passed `verify_model`.

    `body(tokens int32 [B, T], cache=[per-layer caches]) -> hidden [B, T, hidden_size]`;
    `head(hidden [..., hidden_size]) -> logits [..., vocab]` (the family's exact head);
    `mask_rank`: 4 or 5 (see `Family.mask_rank`); `reads_quantized_kv` as in `Family`.
    `layer_kinds`: per layer, what it caches (`LayerKind`).
    """

    model_type: str
    body: Callable
    head: Callable[[mx.array], mx.array]
    mask_rank: int
    reads_quantized_kv: bool
    layer_kinds: tuple[LayerKind, ...] = ()

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Per KV layer, None for full attention or the sliding window in positions."""
        return tuple(k.window for k in self.layer_kinds if k.kv is not None)

    @property
    def layer_kind_names(self) -> tuple[str, ...]:
        """`LayerKind.name` of every layer (empty for a model whose layers are all plain full attention)."""
        return tuple(k.name for k in self.layer_kinds)

    @property
    def num_state_layers(self) -> int:
        """How many layers carry recurrent state (0: attention only)."""
        return sum(1 for k in self.layer_kinds if k.state is not None)

    def caches(self, kv_views: list, state_views: list) -> list:
        """The per-layer cache list the body runs over: layer i gets its KV view, its state view, or both as
        (state, kv) when it holds both (mlx-lm's `CacheList(ArraysCache, KVCache)` order)."""
        out = []
        for kind in self.layer_kinds:
            kv = None if kind.kv is None else kv_views[kind.kv]
            state = None if kind.state is None else state_views[kind.state]
            out.append(kv if state is None else state if kv is None else (state, kv))
        return out

    def state_caches(self, caches: list) -> list:
        """The recurrent layers' `ArraysCache`s among mlx-lm's own per-layer caches (`make_cache()`)."""
        return [c if k.kv is None else c[0] for c, k in zip(caches, self.layer_kinds) if k.state is not None]


def verify_model(model) -> VerifiedModel:
    """Gate on a loaded mlx-lm model: verified family, its own mlx-lm class, every layer's caches of a kind
    the family was read for (module docstring), each attention the family's class with a position-only rope,
    each recurrent mixer the family's class, and the family's head buildable.
    Returns the `VerifiedModel`; raises ValueError naming the model type, layer or head at fault and
    listing what is served."""
    args = getattr(model, "args", None)
    model_type = getattr(model, "model_type", None) or getattr(args, "model_type", None)
    family = family_of(model_type)
    cls = type(model)
    module = f"mlx_lm.models.{family.module}"
    if (cls.__module__, cls.__name__) != (module, "Model") or not callable(getattr(model, "model", None)):
        raise ValueError(f"model_type {model_type!r} is served only as {module}.Model, "
                         f"not {cls.__module__}.{cls.__name__}")

    def refuse(what: str) -> ValueError:
        return ValueError(f"{model_type} model: {what}; this engine serves full attention over a plain KV "
                          f"cache (and sliding windows in {_windowed()}, recurrent state in {_recurrent()}) with "
                          f"a position-only rotary embedding, for the families {supported()}")

    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    layers = list(model.layers)
    caches = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    if len(caches) != len(layers):
        raise refuse(f"make_cache gives {len(caches)} caches for {len(layers)} layers")
    kinds: list[LayerKind] = []
    num_kv = num_state = 0
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        state, kv_cache = None, cache
        if family.recurrent and type(cache) is ArraysCache:
            state, kv_cache = cache, None
        elif family.recurrent and type(cache) is CacheList and len(cache.caches) == 2 \
                and type(cache[0]) is ArraysCache:
            state, kv_cache = cache[0], cache[1]
        if state is not None:
            mixer = getattr(layer, "linear_attn", None) or getattr(layer, "mamba", None)
            if mixer is None or type(mixer).__module__ != module or len(state.cache) != 2:
                raise refuse(f"layer {i} keeps recurrent state in {type(mixer).__name__} with "
                             f"{len(state.cache)} arrays (read: {module}'s mixer, conv and SSM state)")
        window = None
        if kv_cache is None:
            pass
        elif type(kv_cache) is RotatingKVCache and family.sliding_windows and kv_cache.keep == 0 \
                and kv_cache.max_size == getattr(args, "sliding_window", None):
            window = kv_cache.max_size
        elif type(kv_cache) is not KVCache:
            raise refuse(f"layer {i} uses {type(kv_cache).__name__}{_cache_detail(kv_cache)} (a sliding window "
                         "or recurrent state this family's code was not read for)")
        kinds.append(LayerKind(kv=None if kv_cache is None else num_kv, window=window,
                               state=None if state is None else num_state))
        num_kv += kv_cache is not None
        num_state += state is not None
        if kv_cache is None:
            continue
        attn = getattr(layer, "self_attn", None)
        if attn is None or type(attn).__module__ != module:
            raise refuse(f"layer {i} has attention {type(attn).__name__} not from {module}")
        rope = getattr(attn, "rope", None)
        if rope is None or (type(rope).__module__, type(rope).__name__) not in _POSITIONAL_ROPES:
            raise refuse(f"layer {i} uses rotary embedding {type(rope).__name__}, which is not position-only")
    try:
        head = family.head(model)
    except (AttributeError, ValueError) as exc:
        raise refuse(f"output head: {exc}") from None
    return VerifiedModel(model_type, model.model, head, family.mask_rank(model), family.reads_quantized_kv,
                         tuple(kinds))


def _windowed() -> str:
    return ", ".join(name for name, f in FAMILIES.items() if f.sliding_windows)


def _recurrent() -> str:
    return ", ".join(name for name, f in FAMILIES.items() if f.recurrent)


def _cache_detail(cache) -> str:
    """` (max_size W, keep K)` for a rotating cache, for the refusal message; else empty."""
    if hasattr(cache, "max_size"):
        return f" (max_size {cache.max_size}, keep {getattr(cache, 'keep', 0)})"
    return ""
