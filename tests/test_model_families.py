"""Every verified model family, served by the engine, gives exactly mlx-lm's own generation; every other
family is refused at load by name.

Each verified family is a small random-weight model built in code from mlx-lm's own classes (2 layers,
hidden size 64, 4 query heads over 2 KV heads, the SmolLM2 tokenizer's vocabulary), float32. The reference
is `mlx_lm.generate.generate_step` over mlx-lm's own KV cache. The engine runs each prompt alone and in
batches of 2, 3 and 4 prompts of different lengths (batch sizes below, equal to and above the KV head
count), and must give the same tokens and logprobs (within 1e-3).
"""

from __future__ import annotations

import functools
import importlib
import json

import mlx.core as mx
import numpy as np
import pytest

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.kv_store import KVStore
from cluster.model import load_model, read_model_spec
from cluster.model_families import FAMILIES, verify_model
from cluster.request import GenerateRequest, SamplingParams
from cluster.runner import ModelRunner
from tests.engine_helpers import run

VOCAB = 49152  # SmolLM2's tokenizer
NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 19, 11, 26)  # different lengths, across 8-token blocks
TOL = 1e-3
WINDOW = 8  # the sliding window of the sliding-window families' test models, in positions

COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB,
              max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
CONFIGS = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
    "qwen3_moe": dict(MOE, num_experts=4, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                      tie_word_embeddings=False),
    "mixtral": dict(MOE, num_local_experts=4, tie_word_embeddings=False),
    "olmo2": dict(tie_word_embeddings=True),
    "phi3": dict(tie_word_embeddings=False),
    # a low soft cap, so that capping changes the logits of a random model visibly
    "gemma2": dict(query_pre_attn_scalar=16.0, attn_logit_softcapping=50.0, final_logit_softcapping=5.0),
    "granite": dict(logits_scaling=4.0, attention_multiplier=0.25, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_bias=False, mlp_bias=False, tie_word_embeddings=True),
    # sliding-window layers with a window of 8 positions, shorter than three of the four prompts: layer 0
    # slides, layer 1 is global (gemma3's pattern 2; gpt_oss's default layer_types)
    "gemma3_text": dict(sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16.0,
                        rope_local_base_freq=10000.0),
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    # multi-head latent attention (a 32-wide latent and a 16-wide rope key cached per token), a dense first
    # layer and a routed-expert second one with a shared expert
    "deepseek_v3": dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
                        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                        tie_word_embeddings=False),
}
# families whose layers are not all plain full attention: sliding windows, attention sinks, latent attention
OTHER_LAYER_KINDS = ["gemma3_text", "gpt_oss", "deepseek_v3"]
UNVERIFIED = ("qwen3_next", "falcon_h1", "mamba2", "granitemoe", "minicpm", "gemma3", "llava")


def test_every_verified_family_is_covered_here():
    """The verified list is exactly the families this file compares with mlx-lm."""
    assert set(FAMILIES) == set(CONFIGS)


@functools.lru_cache(maxsize=1)
def tokenizer():
    from cluster.gguf_import import ensure_default_model
    from cluster.model import load_tokenizer

    return load_tokenizer(ensure_default_model(progress=False))


def model_class(model_type: str):
    """mlx-lm's own Model and ModelArgs for `model_type` (its remapping included: mistral runs as llama)."""
    from mlx_lm.utils import MODEL_REMAPPING

    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    return module.Model, module.ModelArgs


def build(model_type: str, config: dict, seed: int = 0):
    """A random-weight float32 mlx-lm model of `model_type` from `config`."""
    Model, Args = model_class(model_type)
    mx.random.seed(seed)
    model = Model(Args.from_dict({"model_type": model_type, **config}))
    if model_type == "gpt_oss":  # attention sinks start at zero; random ones make them matter
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model


def write_config(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@functools.lru_cache(maxsize=None)
def family(model_type: str):
    """(model, spec) of the family's test model, built once per module."""
    import tempfile
    from pathlib import Path

    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    model = build(model_type, config, seed=sorted(CONFIGS).index(model_type))
    folder = write_config(Path(tempfile.mkdtemp(prefix=f"family-{model_type}-")), config)
    return model, read_model_spec(folder, model_id=model_type)


def make_engine(model_type: str, **config) -> EngineCore:
    model, spec = family(model_type)
    config = dict(dict(dtype="float32", num_blocks=96, block_size=8, enable_prefix_caching=False), **config)
    return EngineCore(model, tokenizer(), spec, EngineConfig(**config))


@functools.lru_cache(maxsize=None)
def engine(model_type: str) -> EngineCore:
    """One engine per family for the whole module (requests finish and free their blocks)."""
    return make_engine(model_type)


def prompts() -> list[list[int]]:
    rng = np.random.RandomState(7)
    return [rng.randint(100, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


class Sampler:
    """The engine's temperature sampling rule (cluster/sampling.py) as an mlx-lm sampler: split the
    sequence's key, draw from logprobs / temperature."""

    def __init__(self, temperature: float, seed: int):
        self.temperature, self.key = temperature, mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:  # [1, vocab] -> [1]
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs[0] / self.temperature, key=sub)[None]


@functools.lru_cache(maxsize=None)
def reference(model_type: str, prompt: tuple[int, ...], temperature: float = 0.0, seed: int = 0):
    """mlx-lm's own generation of the family's test model: (tokens, logprobs of those tokens)."""
    return reference_of(family(model_type)[0], prompt, temperature, seed)


def reference_of(model, prompt: tuple[int, ...], temperature: float = 0.0, seed: int = 0):
    """mlx-lm's own generation (`generate_step` over the model's own `make_cache`): (tokens, logprobs of
    those tokens), NEW_TOKENS of them."""
    from mlx_lm.generate import generate_step

    sampler = Sampler(temperature, seed) if temperature else None
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=sampler):
        token = int(token.item()) if isinstance(token, mx.array) else int(token)
        tokens.append(token)
        logprobs.append(lp[token].item())
    return tokens, logprobs


def request(rid: str, prompt, temperature: float = 0.0, seed=None, **kw) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingParams(
        max_tokens=NEW_TOKENS, temperature=temperature, seed=seed, logprobs=0, ignore_eos=True, **kw))


def assert_matches(result, ref_tokens, ref_logprobs, what: str):
    assert result.token_ids == ref_tokens, what
    got = [lp.logprob for lp in result.logprobs]
    assert np.allclose(got, ref_logprobs, atol=TOL, rtol=0), f"{what}: {got} vs {ref_logprobs}"


def batches():
    """Each prompt alone, then the first 2, 3 and 4 prompts together."""
    ps = prompts()
    return [[i] for i in range(len(ps))] + [list(range(b)) for b in (2, 3, 4)]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_greedy_generation_matches_mlx_lm_alone_and_in_batches_of_every_size(model_type):
    """Greedy tokens and logprobs equal mlx-lm's own generation for each prompt alone and in batches of 2,
    3 and 4 prompts of different lengths (batched prefill and decode over the decode mirror)."""
    core, ps = engine(model_type), prompts()
    for n, batch in enumerate(batches()):
        reqs = [request(f"{model_type}-{n}-{i}", ps[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i])),
                           f"{model_type}: prompt {i} in a batch of {len(batch)}")


@pytest.mark.parametrize("model_type", ["gemma2", "llama", "qwen3_moe", *OTHER_LAYER_KINDS])
def test_batched_decode_that_gathers_from_the_pool_matches_mlx_lm(model_type):
    """With the decode mirror off, batched decode steps gather their contexts (another mask path) and still
    give mlx-lm's tokens and logprobs."""
    core, ps = make_engine(model_type, decode_mirror_gb=0.0), prompts()
    reqs = [request(f"gather-{i}", p) for i, p in enumerate(ps[:3])]
    results = run(core, reqs)
    for i, r in enumerate(reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i])), f"{model_type}: prompt {i}")


@pytest.mark.parametrize("model_type", ["granite", "gemma2", "llama"])
def test_sampling_at_a_temperature_draws_from_the_models_own_head(model_type):
    """Seeded sampling at temperature 0.7 draws the same tokens as mlx-lm's generation with the engine's
    sampling rule over mlx-lm's own logits (so the temperature acts on the family's real head, scaling or
    soft-capping included), alone and in a batch; the reported logprobs are the model's own (log-softmax
    of the raw logits, temperature aside)."""
    core, ps = engine(model_type), prompts()
    seeds = [11, 12, 13]
    for batch in ([0], [0, 1, 2]):
        reqs = [request(f"temp-{len(batch)}-{i}", ps[i], temperature=0.7, seed=seeds[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference(model_type, tuple(ps[i]), 0.7, seeds[i]),
                           f"{model_type}: sampled prompt {i} in a batch of {len(batch)}")


@pytest.mark.parametrize("model_type", ["granite", "gemma2", "phi3"])
def test_prompt_logprobs_use_the_same_head_on_every_row(model_type):
    """Prompt logprobs (logits on every prompt row, the rows speculative verification also uses) equal the
    log-softmax of mlx-lm's full forward pass over the prompt."""
    model, _ = family(model_type)
    core, ps = engine(model_type), prompts()
    reqs = [request(f"echo-{i}", p, prompt_logprobs=0) for i, p in enumerate(ps[:2])]
    results = run(core, reqs)
    for p, r in zip(ps, reqs):
        logits = model(mx.array([p]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = [lp[t, p[t + 1]].item() for t in range(len(p) - 1)]
        got = [e.logprob for e in results[r.request_id].outputs[0].prompt_logprobs]
        assert np.allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("model_type", ["granite", "gemma2"])
def test_speculative_verification_keeps_mlx_lms_greedy_output(model_type):
    """Prompt-lookup speculation (drafts verified with logits on every fed row) gives mlx-lm's greedy tokens
    and logprobs, alone and batched with a plain request."""
    from decode_node.drafters import PromptLookupDrafter
    from decode_node.speculative import DecodeSpeculator

    core, ps = make_engine(model_type), prompts()
    core.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter()}, core.config)
    looped = ps[0] * 4  # repeats, so prompt lookup proposes drafts
    reqs = [request("spec-0", looped, speculative_method="prompt_lookup", num_draft_tokens=3),
            request("spec-1", ps[1])]
    results = run(core, reqs)
    assert core.speculator.num_draft_tokens > 0
    for p, r in zip((looped, ps[1]), reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(p)), f"{model_type}: {r.request_id}")


class ReferenceDrafter:
    """Drafts mlx-lm's own next tokens for each prompt, with the last draft token of each proposal wrong, so
    that verification accepts some rows and rejects one in every step (prompt lookup drafts nothing on a
    random-weight model whose output never repeats its prompt)."""

    method = "prompt_lookup"
    cost_per_token = 0.0

    def __init__(self, continuations: dict):
        self.continuations = continuations  # prompt tuple -> reference tokens

    def propose(self, seqs, num_tokens):
        from cluster.speculation import Draft

        out = []
        for seq, k in zip(seqs, num_tokens):
            ref = self.continuations[tuple(seq.request.prompt_token_ids)]
            draft = list(ref[seq.num_output_tokens:seq.num_output_tokens + k])
            if draft:
                draft[-1] = (draft[-1] + 1) % VOCAB
            out.append(Draft(tuple(draft)))
        return out

    def release(self, seq) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_draft_verification_over_other_layer_kinds_keeps_mlx_lms_greedy_output(model_type):
    """Draft verification feeds several rows per sequence through the sliding layers' windowed mask, or
    latent attention's prompt path (accepted and rejected drafts alike): tokens and logprobs stay mlx-lm's,
    for a prompt past the window batched with a shorter one."""
    from decode_node.speculative import DecodeSpeculator

    core, ps = make_engine(model_type), prompts()
    chosen = (ps[3], ps[0])
    refs = {tuple(p): reference(model_type, tuple(p)) for p in chosen}
    drafter = ReferenceDrafter({p: r[0] for p, r in refs.items()})
    core.speculator = DecodeSpeculator({"prompt_lookup": drafter}, core.config)
    reqs = [request(f"draft-{i}", p, speculative_method="prompt_lookup", num_draft_tokens=3)
            for i, p in enumerate(chosen)]
    results = run(core, reqs)
    assert core.speculator.num_draft_tokens > 0 and 0 < core.speculator.num_accepted_tokens
    for p, r in zip(chosen, reqs):
        assert_matches(results[r.request_id], *refs[tuple(p)], f"{model_type}: {r.request_id}")


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_after_a_prefix_hit_and_across_chunk_boundaries(model_type):
    """A 45-token prompt (over five windows) prefilled in 7-token chunks, so chunks start mid-block and
    mid-window, then the same prompt again: the second run restores its full blocks from the prefix cache
    (`num_cached_tokens` is the whole-block prefix, so a disabled cache cannot pass) and both equal mlx-lm's
    generation, alone and beside a shorter prompt."""
    core = make_engine(model_type, enable_prefix_caching=True, prefill_chunk_size=7)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    want = reference(model_type, tuple(long))
    first = run(core, [request("cold", long)])["cold"]
    assert_matches(first, *want, f"{model_type}: cold, in 7-token chunks")
    assert first.outputs[-1].num_cached_tokens == 0
    results = run(core, [request("warm", long), request("beside", prompts()[1])])
    assert_matches(results["warm"], *want, f"{model_type}: after a prefix hit")
    assert results["warm"].outputs[-1].num_cached_tokens == (len(long) - 1) // 8 * 8
    assert_matches(results["beside"], *reference(model_type, tuple(prompts()[1])), f"{model_type}: beside it")


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_over_quantized_kv_stay_close_to_mlx_lm(model_type, tmp_path):
    """8-bit KV (group 32): the sliding layers' windowed mask applies over quantized blocks too; gpt_oss's
    attention sinks and latent attention compute over float K/V, so the engine dequantizes for them. The
    output stays within quantization error of mlx-lm's float generation (the first token equal, logprobs
    within 0.05)."""
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type], "head_dim": 32}
    if model_type == "deepseek_v3":  # both cached widths must hold whole quantization groups
        config["qk_rope_head_dim"] = 32
    model = build(model_type, config)
    spec = read_model_spec(write_config(tmp_path, config))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=32, block_size=8,
                                                             kv_bits=8, kv_group_size=32))
    assert core.store.dequantize_for_attention or model_type == "gemma3_text"
    long = prompts()[3]
    got = run(core, [request("q8", long)])["q8"]
    tokens, logprobs = reference_of(model, tuple(long))
    assert got.token_ids[0] == tokens[0]
    assert abs(got.logprobs[0].logprob - logprobs[0]) < 0.05


def expected_kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """K/V bytes one token occupies in the pool, from config.json's fields alone: per layer, latent
    attention caches kv_lora_rank + qk_rope_head_dim values (mlx-lm's deepseek_v3 caches the latent and the
    rope key); every other family num_key_value_heads x head_dim values for K and as many for V."""
    if "kv_lora_rank" in config:
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        per_layer = 2 * config["num_key_value_heads"] * config["head_dim"]
    return config["num_hidden_layers"] * per_layer * dtype_bytes


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_kv_bytes_per_token_measured_from_the_pool_equal_the_configs_formula(model_type):
    """The pool's arrays (what the KV budget and the wire count) hold exactly the bytes per token that the
    family's cache shapes give: measured from the allocated arrays, against a formula from config.json."""
    core = engine(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    measured = core.store.nbytes / (core.store.num_blocks * core.store.block_size)
    assert measured == expected_kv_bytes_per_token(config)
    assert core.spec.kv_bytes_per_token(4) == measured


# -- the gate ------------------------------------------------------------------------------------------


def minimal_config(model_type: str) -> dict:
    return {"model_type": model_type, **COMMON}


@pytest.mark.parametrize("model_type", UNVERIFIED)
def test_unverified_families_are_refused_at_load_by_name(model_type, tmp_path):
    """A config.json of a family outside the verified list is refused when its spec is read and when its
    model is loaded (before any weights), with a message naming it and listing the served families."""
    folder = write_config(tmp_path / model_type, minimal_config(model_type))
    for load in (read_model_spec, load_model):
        with pytest.raises(ValueError, match=rf"'{model_type}'.*served: llama, mistral"):
            load(folder)


def test_an_unverified_model_object_is_refused_when_the_engine_is_built():
    """A gemma (first generation) model handed to the engine directly (its spec read elsewhere) is refused by
    name when the engine is constructed, before any request."""
    model = build("gemma", dict(COMMON))
    _, spec = family("llama")
    with pytest.raises(ValueError, match="'gemma'.*served: llama"):
        EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=8, block_size=8))


def test_a_sliding_window_layer_in_a_family_not_read_for_windows_is_refused():
    """qwen3's body was not read to ask its caches for windowed masks: a qwen3 model whose caches include a
    RotatingKVCache is refused, naming the layer and the cache."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = build("qwen3", dict(COMMON, **CONFIGS["qwen3"]))
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=WINDOW)]
    with pytest.raises(ValueError, match="layer 1 uses RotatingKVCache \\(max_size 8, keep 0\\)"):
        verify_model(model)


def test_a_sliding_window_that_keeps_a_prefix_or_differs_from_the_config_is_refused():
    """A rotating cache that keeps its first tokens (an attention-sink window) or whose size is not the
    model's `sliding_window` is not the window the engine's mask applies: refused by layer."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = build("llama", dict(COMMON, layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW))
    assert verify_model(model).layer_windows == (None, WINDOW)
    for cache in (RotatingKVCache(max_size=WINDOW, keep=4), RotatingKVCache(max_size=2 * WINDOW)):
        model.make_cache = lambda cache=cache: [KVCache(), cache]
        with pytest.raises(ValueError, match="layer 1 uses RotatingKVCache"):
            verify_model(model)


def test_a_llama_with_sliding_window_layers_matches_mlx_lm():
    """llama's `layer_types` with "sliding_attention" layers (mlx-lm gives them a RotatingKVCache): served,
    and every prompt, alone and in a batch of four, equals mlx-lm's generation past the window."""
    import tempfile
    from pathlib import Path

    config = {"model_type": "llama", **COMMON, **CONFIGS["llama"],
              "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
    model = build("llama", config, seed=3)
    spec = read_model_spec(write_config(Path(tempfile.mkdtemp(prefix="family-llama-swa-")), config))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=96, block_size=8,
                                                             enable_prefix_caching=False))
    ps = prompts()
    for batch in ([1], [0, 1, 2, 3]):
        reqs = [request(f"swa-{len(batch)}-{i}", ps[i]) for i in batch]
        results = run(core, reqs)
        for i, r in zip(batch, reqs):
            assert_matches(results[r.request_id], *reference_of(model, tuple(ps[i])),
                           f"llama with a sliding layer: prompt {i} in a batch of {len(batch)}")


def test_a_length_dependent_rotary_embedding_is_refused():
    """Dynamic NTK rope (its base depends on the current length, not the position alone) is refused."""
    model = build("llama", dict(COMMON, rope_scaling={"type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="rotary embedding DynamicNTKScalingRoPE"):
        verify_model(model)


def test_a_verified_type_on_another_family_class_is_refused():
    """A model object claiming a verified type but built from another mlx-lm module is refused (its head
    and attention are not the verified ones)."""
    model = build("qwen2", dict(COMMON))
    model.model_type = "llama"
    with pytest.raises(ValueError, match="served only as mlx_lm.models.llama.Model"):
        verify_model(model)


def test_gemma2_attends_over_float_kv_when_kv_is_quantized(tmp_path):
    """gemma2's attention reads float K/V only: the engine dequantizes quantized KV for it, and a runner
    over a store that would hand it quantized KV is refused."""
    config = dict(COMMON, **CONFIGS["gemma2"], head_dim=32)  # quantization groups are 32 values at least
    model = build("gemma2", config)
    spec = read_model_spec(write_config(tmp_path, {"model_type": "gemma2", **config}))
    core = EngineCore(model, tokenizer(), spec, EngineConfig(dtype="float32", num_blocks=8, block_size=8, kv_bits=8,
                                                             kv_group_size=32))
    assert core.store.dequantize_for_attention
    store = KVStore(spec, 4, 8, kv_bits=8, kv_group_size=32, dequantize_for_attention=False)
    with pytest.raises(ValueError, match="gemma2 attention reads float KV only"):
        ModelRunner(model, store)


def test_serve_reports_a_refused_family_as_an_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    """`mlx-pd serve --model FOLDER` for an unverified family exits 2 with one error line naming it."""
    import cluster.launch.platform
    from cluster.launch import cli

    monkeypatch.setattr(cluster.launch.platform, "reexec_with_openblas", lambda *a, **k: None)
    folder = write_config(tmp_path / "qwen3_next", minimal_config("qwen3_next"))
    assert cli.main(["serve", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "mlx-pd: error: model_type 'qwen3_next'" in err and "Traceback" not in err


# -- through a prefill/decode transfer -----------------------------------------------------------------


@pytest.mark.parametrize("model_type", OTHER_LAYER_KINDS)
def test_other_layer_kinds_through_a_1p1d_transfer_match_mlx_lm(model_type, tmp_path):
    """A 45-token prompt (over five windows) prefilled by a prefill worker in 16-token chunks, its KV shipped
    to a decode worker in 8-token blocks (the prefill worker's sent-block count proves it crossed the wire),
    answers with mlx-lm's tokens and logprobs through the OpenAI completions endpoint."""
    import time

    import httpx

    from cluster.model import DEFAULT_MODEL
    from tests.cluster_helpers import running_cluster

    model, _ = family(model_type)
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type]}
    spec = read_model_spec(write_config(tmp_path, config), model_id=DEFAULT_MODEL)
    long = np.random.RandomState(11).randint(100, VOCAB, size=45).tolist()
    tokens, logprobs = reference(model_type, tuple(long))
    engine = "block_size = 8\nprefill_chunk_size = 16"
    with running_cluster(1, 1, loaded=(model, tokenizer(), spec), engine=engine,
                         routing="local_prefill_max_tokens = 0") as (base, _, workers):
        r = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": long, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == tokenizer().decode(tokens)
        assert np.allclose(choice["logprobs"]["token_logprobs"], logprobs, atol=TOL, rtol=0)
        deadline = time.monotonic() + 60  # stats refresh between steps
        while workers["prefill-0"].stats()["kv_blocks_sent"] < len(long) // 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers["prefill-0"].stats()["kv_blocks_sent"] >= len(long) // 8
