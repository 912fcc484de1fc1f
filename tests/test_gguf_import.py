"""GGUF import: a tiny synthetic GGUF checks layout and atomicity exactly; the packaged SmolLM2 checks
that the real model loads, tokenizes like SmolLM2 and answers."""

import json

import gguf
import numpy as np
import pytest

from cluster import gguf_import
from cluster.gguf_import import MARKER, ensure_default_model, import_gguf, unpermute_qk

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def llama_cpp_permute(weights, n_head, n_head_kv):
    """Verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8, 3 input features
    permuted = llama_cpp_permute(w, 2, None)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, 2), w)
    # k with fewer kv heads: llama.cpp permutes by n_head_kv
    k = np.arange(1 * 8 * 3).reshape(8, 3)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(k, 4, 1), 1), k)
    # one head of head_dim 4: HF rows [0, 1, 2, 3] are stored as [0, 2, 1, 3]
    assert llama_cpp_permute(np.arange(4), 1, None).tolist() == [0, 2, 1, 3]
    assert unpermute_qk(np.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]


# ---- a tiny synthetic GGUF: 2 layers, hidden 16, 4 heads, 2 kv heads, untied lm_head ----

TINY = dict(hidden=16, layers=2, ffn=24, heads=4, kv_heads=2)


def _tiny_hf_weights(rng):
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    w = {"model.embed_tokens.weight": (300, h), "model.norm.weight": (h,), "lm_head.weight": (300, h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (TINY["heads"] * hd, h),
              p + "self_attn.k_proj.weight": (TINY["kv_heads"] * hd, h),
              p + "self_attn.v_proj.weight": (TINY["kv_heads"] * hd, h),
              p + "self_attn.o_proj.weight": (h, TINY["heads"] * hd),
              p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
              p + "mlp.down_proj.weight": (h, f)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """Write HF-layout weights the way llama.cpp does (renamed, q/k permuted) into a GGUF file."""
    from tokenizers import pre_tokenizers

    hf = _tiny_hf_weights(np.random.default_rng(0))
    gguf_names = {v: k for k, v in gguf_import._TOP_NAMES.items()}
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(128)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he"]
    tokens += [f"<unused{i}>" for i in range(300 - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, w in hf.items():
        if name in gguf_names:
            gname = gguf_names[name]
        else:
            _, _, i, *rest = name.split(".")
            short = {v: k for k, v in gguf_import._LAYER_NAMES.items()}[".".join(rest[:-1])]
            gname = f"blk.{i}.{short}.weight"
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, TINY["heads"], TINY["heads"])
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, TINY["heads"], TINY["kv_heads"])
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf


def test_tiny_import_restores_hf_layout(tiny_gguf, tmp_path):
    import mlx.core as mx

    path, hf = tiny_gguf
    out = import_gguf(path, tmp_path / "tiny")
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["tie_word_embeddings"]) == (2, 4, 2, 4, False)
    loaded = mx.load(str(out / "model.safetensors"))
    assert sorted(loaded) == sorted(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(np.array(loaded[name]), w, err_msg=name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_tiny_import_replaces_stale_folder_and_dtype(tiny_gguf, tmp_path):
    import mlx.core as mx

    path, hf = tiny_gguf
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text("{half written")  # a crashed earlier import, no marker
    import_gguf(path, out, dtype="bfloat16")
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"
    assert mx.load(str(out / "model.safetensors"))["model.norm.weight"].dtype == mx.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp or stale dirs left
    with pytest.raises(ValueError, match="int8"):
        import_gguf(path, tmp_path / "x", dtype="int8")


# ---- the real packaged SmolLM2-135M-Instruct ----

@pytest.fixture(scope="session")
def smollm_dir():
    try:
        return ensure_default_model(progress=False)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm(smollm_dir):
    from mlx_lm import load

    return load(str(smollm_dir))


def test_config_matches_smollm2_135m(smollm_dir):
    c = json.loads((smollm_dir / "config.json").read_text())
    assert c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["hidden_size"]) == (30, 9, 3, 64, 576)
    assert (c["vocab_size"], c["max_position_embeddings"], c["tie_word_embeddings"]) == (49152, 8192, True)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_digits_tokenize_individually(smollm):
    _, tok = smollm
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize("text", ["Hello world", "naïve café — 東京 🙂", "  two spaces\n\ttab"])
def test_decode_encode_roundtrip(smollm, text):
    _, tok = smollm
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens_are_single_ids(smollm):
    _, tok = smollm
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]  # as HF SmolLM2


def test_chat_template_renders(smollm):
    _, tok = smollm
    text = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_answer_mentions_paris(smollm):
    from mlx_lm import generate

    model, tok = smollm
    prompt = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert "Paris" in generate(model, tok, prompt, max_tokens=20)


def test_second_ensure_does_not_rewrite(smollm_dir):
    before = {p.name: p.stat().st_mtime_ns for p in smollm_dir.iterdir()}
    assert ensure_default_model(progress=False) == smollm_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm_dir.iterdir()} == before
