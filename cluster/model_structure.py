"""What the engine needs to know of a loaded mlx-lm model, read from the model itself (`verify_model`).

The engine runs mlx-lm's own model classes over its paged KV cache (cluster/kv/cache_view.py) and applies the
output head itself, on the rows that need logits only (cluster/runner.py). That reproduces mlx-lm's
generation when:

- the text model is found: the model itself, or a multimodal wrapper's `language_model`; its body (the module
  `Model.__call__` runs before the head: `model`, `backbone` or `transformer`) takes `(tokens, cache=[...])`;
- every slot of the model's own `make_cache()` is a kind the KV wing serves: full attention (`KVCache`), a
  sliding window without kept tokens (`RotatingKVCache(keep=0)`), recurrent state (`ArraysCache`: Gated DeltaNet, Mamba, short convolutions), or state beside attention in
  one layer (`CacheList(ArraysCache, KVCache)`); the slots are what the body iterates, so layers without a
  cache and layers that read another layer's KV (KV sharing) need nothing;
- every rotary embedding gives each row of a batch, at its own offset, what it gives that row alone
  (`row_separable_rope`: a rope whose frequencies depend on the sequence's length is refused, with the reason);
- the output head is what `Model.__call__` does after the body, found by calling it on the body's output
  (`call_head`) — the load check (cluster/load_check.py) compares it with the model's own call.

The cache slots' shapes come from mlx-lm itself: one token through the model over its own `make_cache()`
(`VerifiedModel.kv_shapes`, `state_shapes`), so latent attention, per-layer head widths and recurrent states need
no per-family table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from cluster.kv.recurrent_state import StateShapes
from cluster.model_families import FAMILIES, module_of

# per KV layer: (KV heads, key width, value width) of one token
KVShape = tuple[int, int, int]

BODY_NAMES = ("model", "backbone", "transformer")
LAYER_NAMES = ("layers", "h", "blocks")


@dataclass(frozen=True)
class LayerKind:
    """What one cache slot holds: `kv` its index among the pool's KV layers (None: no KV), `window` its sliding
    window in positions (None: none), `state` its index among the recurrent layers (None: none)."""

    kv: Optional[int] = None
    window: Optional[int] = None
    state: Optional[int] = None

    @property
    def name(self) -> str:
        """What the slot caches in words, as the KV transfer's handshake compares them: "attention",
        "window 4096", "state", "state + attention", "state + window 4096", or "none" (a slot no layer uses)."""
        kv = None if self.kv is None else "attention" if self.window is None else f"window {self.window}"
        return " + ".join(p for p in ("state" if self.state is not None else None, kv) if p) or "none"


@dataclass(frozen=True)
class VerifiedModel:
    """What the runner needs of a model that passed `verify_model`.

    `body(tokens int32 [B, T], cache=[per-slot caches]) -> hidden [B, T, hidden_size]`;
    `head(hidden [N, hidden_size]) -> logits [N, vocab]` (what `Model.__call__` does after the body);
    `mask_rank`: 4 or 5, the rank of the batched attention mask (`cluster.model_families.Family`);
    `reads_quantized_kv` as in `Family`; `tested`: the tests cover the family (`FAMILIES`).
    `layer_kinds`: per cache slot, what it caches (`LayerKind`); `kv_shapes`: per KV layer, (heads, key width,
    value width) of one token; `state_shapes`: per recurrent layer, its state arrays.
    """

    model_type: str
    body: Callable
    head: Callable[[mx.array], mx.array]
    mask_rank: int
    reads_quantized_kv: bool
    layer_kinds: tuple[LayerKind, ...] = ()
    kv_shapes: tuple[KVShape, ...] = ()
    state_shapes: StateShapes = ()
    tested: bool = False

    @property
    def layer_windows(self) -> tuple[Optional[int], ...]:
        """Per KV layer, None for full attention or its sliding window in positions."""
        return tuple(k.window for k in self.layer_kinds if k.kv is not None)

    @property
    def layer_kind_names(self) -> tuple[str, ...]:
        """`LayerKind.name` of every cache slot."""
        return tuple(k.name for k in self.layer_kinds)

    @property
    def num_state_layers(self) -> int:
        """How many slots carry recurrent state (0: attention only)."""
        return sum(1 for k in self.layer_kinds if k.state is not None)

    @property
    def cache_kinds(self) -> tuple[str, ...]:
        """The kinds of cache this model's slots hold, each once, sorted ("attention", "state", "window N"): what
        decides its KV cache groups (pipeline ranks, each planning its own layers, must hold the same)."""
        kinds = {"attention" if k.window is None else f"window {k.window}" for k in self.layer_kinds
                 if k.kv is not None}
        if self.num_state_layers:
            kinds.add("state")
        return tuple(sorted(kinds or {"attention"}))

    def pipeline_refusal(self) -> Optional[str]:
        """Why this model's layers cannot be split into pipeline ranks (each plans the KV cache groups of its own
        layers only, and every rank's groups must be the same): sliding-window layers; None when they can."""
        if any(w is not None for w in self.layer_windows):
            return "a model with sliding-window layers is not served by a pipeline group yet (each rank would plan " \
                   "KV cache groups of its own layers)"
        return None

    def with_mask_rank(self, rank: int) -> "VerifiedModel":
        """The same model with batched masks of rank `rank` (4 or 5)."""
        return dataclasses.replace(self, mask_rank=rank)

    def caches(self, kv_views: list, state_views: list) -> list:
        """The per-slot cache list the body runs over: slot i gets its KV view, its state view, or both as
        (state, kv) when it holds both (mlx-lm's `CacheList(ArraysCache, KVCache)` order)."""
        out = []
        for kind in self.layer_kinds:  # a slot with neither gets None (its layer reads no cache)
            kv = None if kind.kv is None else kv_views[kind.kv]
            state = None if kind.state is None else state_views[kind.state]
            out.append(kv if state is None else state if kv is None else (state, kv))
        return out


def text_model(model):
    """The model that generates text: a multimodal wrapper's `language_model` (on the model or on its `model`,
    when it has a body), else the model itself."""
    for owner in (model, getattr(model, "model", None)):
        inner = getattr(owner, "language_model", None) if owner is not None else None
        if callable(inner):
            try:
                body_of(inner)
                return inner
            except ValueError:
                pass
    return model


def layers_of(body, depth: int = 2) -> list:
    """The body's list of decoder layers (`layers`, `h` or `blocks`, or such a list one module down, as in a
    body whose `layers` is a decoder module); empty when it has none of them. A pipeline rank's body (mlx-lm's
    `PipelineMixin.pipeline`) keeps None in place of the layers other ranks run: its list is the rank's own."""
    for name in LAYER_NAMES:
        layers = getattr(body, name, None)
        if isinstance(layers, (list, tuple)) and layers:
            return [layer for layer in layers if layer is not None]
        if depth > 1 and layers is not None and not isinstance(layers, (list, tuple)):
            inner = layers_of(layers, depth - 1)
            if inner:
                return inner
    return []


def body_of(text) -> tuple[str, Callable]:
    """(attribute name, module) of the text model's body: the first of `BODY_NAMES` that is a module with
    decoder layers (`layers_of`). Raises ValueError when none is found."""
    for name in BODY_NAMES:
        body = getattr(text, name, None)
        if callable(body) and layers_of(body):
            return name, body
    raise ValueError(f"no body with decoder layers ({', '.join(LAYER_NAMES)}) under {', '.join(BODY_NAMES)}")


class _BodyOutput:
    """Stands in for the body inside `Model.__call__`: calling it returns `hidden`; anything else is the body's."""

    def __init__(self, body, hidden: mx.array):
        self._body, self._hidden = body, hidden

    def __call__(self, *args, **kwargs) -> mx.array:
        return self._hidden

    def __getattr__(self, name):
        return getattr(self._body, name)


class _AfterBody:
    """The text model, with its body replaced by `_BodyOutput`, for one call of its `__call__`."""

    def __init__(self, text, body_name: str, hidden: mx.array):
        self._text, self._body_name = text, body_name
        self._stand_in = _BodyOutput(getattr(text, body_name), hidden)

    def __getattr__(self, name):
        return self._stand_in if name == self._body_name else getattr(self._text, name)


def call_head(text, body_name: str) -> Callable[[mx.array], mx.array]:
    """The output head of `text`: what its `Model.__call__` does to the body's output (tied or untied
    projection, soft-capping, logit scaling, multipliers), run by calling `__call__` with the body's output
    standing in for the body. hidden [N, hidden_size] -> logits [N, vocab]."""
    call = type(text).__call__

    def head(hidden: mx.array) -> mx.array:
        tokens = mx.zeros((1, hidden.shape[0]), dtype=mx.int32)
        return call(_AfterBody(text, body_name, hidden[None]), tokens)[0]

    return head


def row_separable_rope(rope) -> Optional[str]:
    """None when `rope(x, offset=offsets)` with one offset per row equals each row alone (`offset=int`), far
    beyond the model's length too; else the reason, in words. A rope that cannot be called as
    `rope(x [B, H, T, D], offset=)` is left to the load check (None)."""
    dims = getattr(rope, "dims", None)
    freqs = getattr(rope, "_freqs", None)
    width = dims if isinstance(dims, int) else (2 * freqs.shape[-1] if isinstance(freqs, mx.array) else None)
    if not width:
        return None
    far = 4 * int(getattr(rope, "max_position_embeddings", 0) or getattr(rope, "original_max_position_embeddings",
                                                                             0) or 32768)
    offsets = (3, far)
    x = mx.random.normal((len(offsets), 1, 2, width), key=mx.random.key(0))
    try:
        rows = [rope(x[b:b + 1], offset=o) for b, o in enumerate(offsets)]
    except TypeError:
        return None
    try:
        batched = rope(x, offset=mx.array(offsets, dtype=mx.int32))
        same = bool(mx.allclose(batched, mx.concatenate(rows, axis=0), atol=1e-4, rtol=1e-4).item())
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"it cannot take one offset per row ({type(exc).__name__}: {exc})"
    return None if same else ("with one offset per row it differs from each row alone: its frequencies depend on "
                              "the sequence's length, not the position alone")


def _ropes(model):
    """(path, module) of every rotary embedding in the model."""
    for path, module in model.named_modules():
        name = type(module).__name__.lower()
        if "rope" in name or "rotary" in name:
            yield path, module


def verify_model(model, mask_rank: Optional[int] = None) -> VerifiedModel:
    """Gate on a loaded mlx-lm model (module docstring). `mask_rank`: the batched mask's rank when the load
    check found it (None: the tested family's, else 4). Returns the `VerifiedModel`; raises ValueError naming
    the model type and the slot, rope or head at fault."""
    from mlx_lm.models.cache import make_prompt_cache

    args = getattr(model, "args", None)
    model_type = getattr(model, "model_type", None) or getattr(args, "model_type", None)
    module = module_of(model_type)
    text = text_model(model)

    def refuse(what: str) -> ValueError:
        return ValueError(f"{model_type} model: {what}; the engine serves full attention, sliding windows and "
                          "recurrent state (alone or beside attention in a layer) with rotary embeddings that "
                          "depend on the position alone")

    try:
        body_name, body = body_of(text)
    except ValueError as exc:
        if layers_of(text):
            exc = ValueError("its text model runs its decoder layers and its output head in one call (no body "
                             "apart from the head, which the engine applies to the rows it samples only)")
        raise refuse(str(exc)) from None
    try:
        kinds = slot_kinds(make_prompt_cache(model))
    except ValueError as exc:
        raise refuse(str(exc)) from None
    for path, rope in _ropes(model):
        reason = row_separable_rope(rope)
        if reason:
            raise refuse(f"rotary embedding {type(rope).__name__} at {path}: {reason}")
    family = FAMILIES.get(module)
    if mask_rank is None:
        rank = family.mask_rank if family is not None else 4
        mask_rank = (5 if any(getattr(getattr(layer, "self_attn", None), "repeats", 1) > 1
                              for layer in layers_of(body)) else 4) if rank == "grouped" else rank
    try:
        kv_shapes, state_shapes, unused = _probe_shapes(model, lambda: make_prompt_cache(model), kinds)
    except Exception as exc:  # e.g. a kernel this backend lacks
        raise refuse(f"one token through the model over its own caches failed ({type(exc).__name__}: {exc})") \
            from None
    if unused:  # slots the body hands a KV cache its layer never writes (a layer without attention)
        kinds = _without(kinds, unused)
    return VerifiedModel(model_type, body, call_head(text, body_name), mask_rank,
                         family.reads_quantized_kv if family is not None else False, tuple(kinds), kv_shapes,
                         state_shapes, family is not None)


def slot_kinds(caches: list) -> list[LayerKind]:
    """What each of a model's own caches (`make_prompt_cache`) holds, as a `LayerKind` per slot, KV layers and
    recurrent layers numbered in slot order. Raises ValueError naming the first slot of a kind the engine does
    not serve."""
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

    kinds: list[LayerKind] = []
    num_kv = num_state = 0
    for i, cache in enumerate(caches):
        state, kv_cache = None, cache
        if type(cache) is ArraysCache:
            state, kv_cache = cache, None
        elif type(cache) is CacheList:
            inner = [type(c) for c in cache.caches]
            if len(inner) != 2 or inner[0] is not ArraysCache or inner[1] not in (KVCache, RotatingKVCache):
                names = ", ".join(c.__name__ for c in inner)
                what = ("keeps two KV caches (as sparse attention keeps its indexer's keys beside the layer's "
                        "KV)" if inner.count(KVCache) == 2 else f"keeps a CacheList of {names}")
                raise ValueError(f"cache slot {i} {what}: served in one layer are recurrent state beside full "
                                 "attention or a sliding window")
            state, kv_cache = cache[0], cache[1]
        window = None
        if type(kv_cache) is RotatingKVCache:
            if kv_cache.keep:
                raise ValueError(f"cache slot {i} is a sliding window of {kv_cache.max_size} that keeps its first "
                                 f"{kv_cache.keep} tokens (attention sinks kept in the cache are not a kind served)")
            window = kv_cache.max_size
        elif type(kv_cache) is ChunkedKVCache:
            raise ValueError(f"cache slot {i} is chunked local attention (ChunkedKVCache of {kv_cache.chunk_size}), "
                             "whose mask the model's body builds from mlx-lm's own trimmed one-sequence cache "
                             "(start_position): not a kind the engine serves yet")
        elif kv_cache is not None and type(kv_cache) is not KVCache:
            raise ValueError(f"cache slot {i} uses {type(kv_cache).__name__}, not a kind of KV the engine serves")
        kinds.append(LayerKind(kv=None if kv_cache is None else num_kv, window=window,
                               state=None if state is None else num_state))
        num_kv += kv_cache is not None
        num_state += state is not None
    return kinds


def _probe_shapes(model, make_cache, kinds: list[LayerKind]):
    """(per KV layer (heads, key width, value width), per recurrent layer its state arrays, the slots whose KV
    cache no layer wrote), read from mlx-lm itself: one token through the model over its own caches. Costs one
    single-token forward."""
    caches = make_cache()
    mx.eval(model(mx.zeros((1, 1), dtype=mx.int32), cache=caches))
    kv: list[KVShape] = []
    states, unused = [], set()
    for i, (cache, kind) in enumerate(zip(caches, kinds)):
        state, kv_cache = (cache, None) if kind.kv is None else (None, cache) if kind.state is None else cache.caches
        if state is not None:
            states.append(tuple((tuple(a.shape[1:]), a.dtype) for a in state.cache))
        if kv_cache is not None:
            keys, values = kv_cache.keys, kv_cache.values
            if keys is None:
                unused.add(i)
                continue
            kv.append((keys.shape[1], keys.shape[-1], values.shape[-1]))
    return tuple(kv), tuple(states), unused


def _without(kinds: list[LayerKind], unused: set) -> list[LayerKind]:
    """`kinds` with the KV of the `unused` slots dropped and the KV layers renumbered."""
    out, num_kv = [], 0
    for i, kind in enumerate(kinds):
        if kind.kv is None or i in unused:
            out.append(dataclasses.replace(kind, kv=None, window=None))
        else:
            out.append(dataclasses.replace(kind, kv=num_kv))
            num_kv += 1
    return out


def kv_spec(spec, verified: VerifiedModel):
    """`spec` (a `cluster.model.ModelSpec` read from config.json) with the KV layers and the shape of the first
    KV layer that the loaded model's own caches hold (unchanged for a model without KV layers)."""
    if not verified.kv_shapes:
        return spec
    return spec.with_kv_shape(len(verified.kv_shapes), verified.kv_shapes[0])
