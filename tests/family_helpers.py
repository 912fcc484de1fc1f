"""The model-family tests' shared pieces: small random-weight mlx-lm models of each family (2 layers, hidden
size 64, 4 query heads over 2 KV heads, the SmolLM2 tokenizer's vocabulary, float32), mlx-lm's own
generation as the reference, and engines over them."""

from __future__ import annotations

import functools
import importlib
import json

import mlx.core as mx
import numpy as np

from cluster.config import EngineConfig
from cluster.engine import EngineCore
from cluster.model import read_model_spec
from cluster.request import GenerateRequest, SamplingParams

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
    # recurrent layers: layer 0 Gated DeltaNet (a 4-tap conv over 96 channels, a 2 x 16 x 16 delta-rule
    # state), layer 1 full attention with a quarter-width rotary embedding; routed experts
    "qwen3_next": dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                       shared_expert_intermediate_size=32, moe_intermediate_size=32, partial_rotary_factor=0.25,
                       tie_word_embeddings=False),
    # every layer Mamba-2 (4 heads of 16, a 16-wide SSM state) beside attention
    "falcon_h1": dict(mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_state=16,
                      mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=128, tie_word_embeddings=False),
}
# families whose layers are not all plain full attention: sliding windows, attention sinks, latent attention
OTHER_LAYER_KINDS = ["gemma3_text", "gpt_oss", "deepseek_v3"]
RECURRENT = ["qwen3_next", "falcon_h1"]  # families with recurrent-state layers

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


def reference_of(model, prompt: tuple[int, ...], temperature: float = 0.0, seed: int = 0,
                 max_tokens: int = NEW_TOKENS):
    """mlx-lm's own generation (`generate_step` over the model's own `make_cache`): (tokens, logprobs of
    those tokens), `max_tokens` of them."""
    from mlx_lm.generate import generate_step

    sampler = Sampler(temperature, seed) if temperature else None
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler):
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


def expected_kv_bytes_per_token(config: dict, dtype_bytes: int = 4) -> int:
    """K/V bytes one token occupies in the pool, from config.json's fields alone: per layer, latent
    attention caches kv_lora_rank + qk_rope_head_dim values (mlx-lm's deepseek_v3 caches the latent and the
    rope key); every other family num_key_value_heads x head_dim values for K and as many for V."""
    if "kv_lora_rank" in config:
        per_layer = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    else:
        per_layer = 2 * config["num_key_value_heads"] * config["head_dim"]
    layers = config["num_hidden_layers"]
    if "full_attention_interval" in config:  # qwen3_next: only every interval-th layer is attention
        layers //= config["full_attention_interval"]
    return layers * per_layer * dtype_bytes


def expected_state_bytes_per_sequence(config: dict, dtype_bytes: int = 4) -> int:
    """Recurrent state bytes of one sequence from config.json's fields alone: per recurrent layer a conv
    window of (kernel - 1) positions over the conv channels, plus the SSM state (float32 in both families).
    qwen3_next and qwen3_5 (Gated DeltaNet layers, all but every full_attention_interval-th): conv channels 2 x key
    heads x key dim + value heads x value dim; state value heads x value dim x key dim. falcon_h1 (every
    layer): conv channels d_ssm + 2 x groups x d_state; state heads x head dim x d_state."""
    if "linear_num_key_heads" in config:  # qwen3_next, qwen3_5's text model
        layers = config["num_hidden_layers"] - config["num_hidden_layers"] // config["full_attention_interval"]
        key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key + value)
        state = config["linear_num_value_heads"] * config["linear_value_head_dim"] * config["linear_key_head_dim"]
    else:
        layers = config["num_hidden_layers"]
        conv = (config["mamba_d_conv"] - 1) * (config["mamba_d_ssm"] + 2 * config["mamba_n_groups"]
                                               * config["mamba_d_state"])
        state = config["mamba_n_heads"] * config["mamba_d_head"] * config["mamba_d_state"]
    return layers * (conv + state) * dtype_bytes


def minimal_config(model_type: str) -> dict:
    return {"model_type": model_type, **COMMON}


def assert_exact_under_preemption(model_type: str) -> EngineCore:
    """Seven usable 8-token blocks for four 15-token prompts that grow into a third block while decoding:
    asserts that sequences were preempted and that every answer is still mlx-lm's; returns the engine."""
    from tests.engine_helpers import run

    core = make_engine(model_type, num_blocks=8)
    ps = np.random.RandomState(5).randint(100, VOCAB, size=(4, 15)).tolist()
    reqs = [request(f"preempt-{i}", p) for i, p in enumerate(ps)]
    results = run(core, reqs)
    assert core.scheduler.num_preemptions > 0
    for p, r in zip(ps, reqs):
        assert_matches(results[r.request_id], *reference(model_type, tuple(p)), f"{model_type}: {r.request_id}")
    return core
