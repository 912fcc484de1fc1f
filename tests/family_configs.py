"""Tiny random-weight configurations of every model family the installed mlx-lm can load.

One config.json-style dict per `model_type`: every module under `mlx_lm/models` that defines `Model` and
`ModelArgs`, and every key of `mlx_lm.utils.MODEL_REMAPPING` (run as the module it names). Each model is
tiny (2 to 4 layers, hidden size 64, 4 query heads over 2 KV heads of 16, feed-forward width 128, the
SmolLM2 tokenizer's 49152-token vocabulary, 512 positions, MoE layers of 4 experts with 2 per token and
a 32-wide expert feed-forward), yet has every layer kind its family has: an attention layer and a
recurrent (conv / Mamba / linear-attention) one in the hybrids, a sliding-window layer (a window of 8
positions) and a full one in the sliding-window families, a layer that reads another layer's K/V in the
KV-sharing families, dense and routed-expert layers where a family mixes them. Windows, chunks and
compression groups are short so that prompts of a few dozen tokens cross them.

Heads are untied where the family allows it. Greedy generation from mlx's initial weights repeats itself
(a tied head gives back the input token, an untied one falls into short cycles), so `build` scales the
token embedding table (down under a tied head, up under an untied one) and gives the parameters mlx-lm
initialises to all zeros (router gates, attention sinks, some conv and recurrence weights) random values;
with that, mlx-lm's own greedy generation of 32 tokens from a random 20-token prompt gives at least 16
distinct tokens in every family but those in `DEGENERATE`.

Multimodal wrappers get a `text_config` and no vision tower; the text path is `model.language_model`.
phi3small keeps its own 100352-token vocabulary (its head writes -inf at ids above 100255).

`build(model_type, seed)` gives the float32 model with its weights evaluated, `model_types()` every
model_type that can be built, `runnable_model_types()` those whose forward pass runs here (`NEEDS_METAL`
lists the Metal-only ones), `CANNOT_BUILD` the model_types that cannot be built, with the reason.
"""

from __future__ import annotations

import copy
import importlib

import mlx.core as mx

VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary
WINDOW = 8  # sliding windows, attention chunks and the like, in positions

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=VOCAB,
            max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
# routed experts: 4 of them, 2 per token, each a 32-wide feed-forward
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# multi-head latent attention: a 32-wide KV latent, a 24-wide query latent, 8 rope and 16 nope dims
MLA = dict(kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
# DeepSeek-style routing: 4 routed experts, 1 shared, a dense first layer
DEEPSEEK_MOE = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    norm_topk_prob=True, moe_layer_freq=1)
SW_FULL = ["sliding_attention", "full_attention"]
# YaRN rope scaling at factor 1 (the families that require a scaling config)
YARN = dict(type="yarn", factor=1.0, original_max_position_embeddings=512, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=0)
# Mistral 3's query temperature: 1 + beta log(1 + floor(position / 16)), so that it grows within a prompt
MINISTRAL_ROPE = dict(rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1,
                      original_max_position_embeddings=16)


def cfg(model_type: str, *parts: dict, **kw) -> dict:
    out = {"model_type": model_type}
    for p in parts:
        out.update(copy.deepcopy(p))
    out.update(kw)
    return out


def without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def dense(model_type: str, *parts: dict, **kw) -> dict:
    return cfg(model_type, BASE, *parts, **kw)


def moe(model_type: str, *parts: dict, **kw) -> dict:
    return cfg(model_type, BASE, MOE, *parts, **kw)


def deepseek(model_type: str, **kw) -> dict:
    return cfg(model_type, BASE, MLA, DEEPSEEK_MOE, **kw)


def _qwen3_5_text(**kw) -> dict:
    # layer 0 Gated DeltaNet, layer 1 full attention with a quarter-width rotary embedding
    return cfg("qwen3_5_text", BASE, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
               linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
               partial_rotary_factor=0.25,
               rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25), **kw)


def _llama4_text(model_type: str) -> dict:
    # layers 0-2 chunked attention with RoPE, layer 3 global NoPE; layers 1 and 3 routed experts
    return cfg(model_type, BASE, num_hidden_layers=4, attention_chunk_size=WINDOW, intermediate_size_mlp=128,
               num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, use_qk_norm=True,
               attention_bias=False, rope_scaling=None, no_rope_layers=[1, 1, 1, 0], floor_scale=WINDOW,
               attn_temperature_tuning=True)


def _gemma4_text(model_type: str, **kw) -> dict:
    # sliding, full, sliding, full; the last two read the K/V of the first two; a 16-wide per-layer input
    return cfg(model_type, BASE, num_hidden_layers=4, head_dim=16, global_head_dim=32, num_key_value_heads=1,
               num_global_key_value_heads=1, sliding_window=WINDOW, sliding_window_pattern=2,
               layer_types=SW_FULL * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
               vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0,
               rope_parameters={
                   "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                      "rope_type": "proportional"},
                   "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                         "rope_type": "default"}},
               tie_word_embeddings=True, **kw)


def _gemma3_text(model_type: str) -> dict:
    # layer 0 slides over 8 positions, layer 1 is global (pattern 2); the head is untied (mlx-lm ties it
    # only when a checkpoint has no lm_head weight)
    return cfg(model_type, BASE, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16.0,
               rope_local_base_freq=10000.0)


def _lfm2() -> dict:
    # layer 0 a short gated conv (a 3-position window), layer 1 attention
    return cfg("lfm2", BASE, tie_word_embeddings=True, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
               block_dim=64, block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
               block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"])


def _deepseek_v41(model_type: str) -> dict:
    # layer 0 attends to its 8-position window only; layers 1-3 also to 4-token compressed groups: layers 1
    # and 3 compress their own K/V and index them (top 4 groups), layer 2 reads layer 1's; a 2-stream
    # hyper-connection; every layer routed experts
    return cfg(model_type, hidden_size=64, vocab_size=VOCAB, num_hidden_layers=4, num_attention_heads=4,
               head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
               moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
               sliding_window=WINDOW, compress_ratios=[0, 4, 4, 4], kv_source_layer_ids=[1, 3],
               index_source_layer_ids=[1, 3], index_n_heads=2, index_head_dim=16, index_topk=4,
               candidate_topk_blocks=0, max_position_embeddings=512, hc_mult=2, hc_sinkhorn_iters=4)


def _phixtral(model_type: str) -> dict:
    return cfg(model_type, num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8,
               num_experts_per_tok=2, num_local_experts=4)


def _deepseek_v3(model_type: str) -> dict:
    return deepseek(model_type, q_lora_rank=None, topk_method="noaux_tc", scoring_func="sigmoid")


CONFIGS: dict[str, dict] = {
    # ---- dense decoder-only, full attention everywhere
    "llama": dense("llama"),
    # llama's module with sliding-window layers: layer 0 slides, layer 1 is full
    "mistral": dense("mistral", sliding_window=WINDOW, layer_types=SW_FULL),
    "iquestcoder": dense("iquestcoder"),
    "xverse": dense("xverse"),
    "apertus": dense("apertus", mlp_bias=False, attention_bias=False, post_norm=False, qk_norm=True),
    "bitnet": dense("bitnet"),
    "exaone": cfg("exaone", BASE, num_layers=2, layer_norm_epsilon=1e-5),
    "gemma": dense("gemma", tie_word_embeddings=True),
    "gemma2": dense("gemma2", tie_word_embeddings=True, query_pre_attn_scalar=16.0, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0),
    "glm": dense("glm"),
    "glm4": dense("glm4", attention_bias=True, partial_rotary_factor=0.5),
    "granite": dense("granite", logits_scaling=4.0, attention_multiplier=0.25, embedding_multiplier=2.0,
                     residual_multiplier=0.5, attention_bias=False, mlp_bias=False),
    "helium": dense("helium", attention_bias=False, mlp_bias=False),
    "hunyuan_v1_dense": dense("hunyuan_v1_dense", use_qk_norm=True),
    "internlm2": dense("internlm2", bias=False),
    "internlm3": dense("internlm3"),
    "mimo": dense("mimo", num_nextn_predict_layers=1),
    "minicpm": dense("minicpm", dim_model_base=32, scale_depth=1.4, scale_emb=12.0),
    "nanochat": cfg("nanochat", BASE, num_key_value_heads=4),
    "nemotron": dense("nemotron", hidden_act="relu2", norm_eps=1e-5, partial_rotary_factor=0.5),
    "olmo2": dense("olmo2"),
    "phi3": dense("phi3"),
    "qwen2": dense("qwen2"),
    "qwen3": dense("qwen3"),
    "seed_oss": dense("seed_oss", attention_bias=True),
    "stablelm": dense("stablelm", use_qkv_bias=True, partial_rotary_factor=0.25, layer_norm_eps=1e-5,
                      qk_layernorm=True),
    "starcoder2": dense("starcoder2", norm_epsilon=1e-5),
    "telechat3": dense("telechat3"),
    "talkie": cfg("talkie", BASE, num_key_value_heads=4),
    "ernie4_5": dense("ernie4_5", use_bias=False),
    "ministral3": dense("ministral3", sliding_window=WINDOW, layer_types=SW_FULL, rope_parameters=MINISTRAL_ROPE),
    # every fourth layer without RoPE: layers 0-2 rotary, layer 3 NoPE
    "smollm3": dense("smollm3", num_hidden_layers=4, no_rope_layer_interval=4),
    # layer 0 loops over its own K/V with a window of 8 positions
    "iquestloopcoder": dense("iquestloopcoder", loop_num=2, loop_window_size=WINDOW),
    "nanbeige": dense("nanbeige"),
    "plamo": dense("plamo", n_shared_head=2),
    "cohere": cfg("cohere", BASE, tie_word_embeddings=True, layer_norm_eps=1e-5, logit_scale=0.5,
                  use_qk_norm=True),
    "lille-130m": cfg("lille-130m", block_size=512, layer_norm_eps=1e-5, n_embd=64, n_head=4, n_kv_heads=2,
                      n_layer=2, rope_theta=10000.0, vocab_size=VOCAB, tie_word_embeddings=True),
    "openelm": cfg("openelm", head_dim=16, num_transformer_layers=2, model_dim=64, vocab_size=VOCAB,
                   ffn_dim_divisor=16, num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[2.0, 2.0],
                   share_input_output_layers=False, rms_norm_eps=1e-5),
    "qwen": cfg("qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, kv_channels=16,
                max_position_embeddings=512, layer_norm_epsilon=1e-5, intermediate_size=256, vocab_size=VOCAB),
    "phi": cfg("phi", BASE, num_key_value_heads=4, partial_rotary_factor=0.5, layer_norm_eps=1e-5),
    "gpt2": cfg("gpt2", n_ctx=512, n_embd=64, n_head=4, n_layer=2, n_positions=512, layer_norm_epsilon=1e-5,
                vocab_size=VOCAB),
    "gpt_bigcode": cfg("gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4, n_positions=512,
                       layer_norm_epsilon=1e-5, vocab_size=VOCAB, multi_query=True, tie_word_embeddings=False),
    "gpt_neox": cfg("gpt_neox", max_position_embeddings=512, hidden_size=64, num_attention_heads=4,
                    num_hidden_layers=2, layer_norm_eps=1e-5, vocab_size=VOCAB, rotary_emb_base=10000,
                    rotary_pct=0.25),
    "gptj": cfg("gptj", n_embd=64, vocab_size=VOCAB, layer_norm_epsilon=1e-5, n_positions=512, n_head=4,
                rotary_dim=8, n_layer=2),
    # a block-sparse layer (0) and a dense one (1); the head writes -inf into ids 100256-100351 of the logits,
    # so the vocabulary is the family's own 100352
    "phi3small": cfg("phi3small", hidden_size=64, dense_attention_every_n_layers=2, ff_intermediate_size=128,
                     gegelu_limit=20.0, num_hidden_layers=2, num_attention_heads=4, layer_norm_epsilon=1e-5,
                     vocab_size=100352, num_key_value_heads=2, blocksparse_block_size=32,
                     blocksparse_num_local_blocks=1, blocksparse_vert_stride=2, mup_width_multiplier=1.0),
    # layer 0 full attention + FFN, layer 1 no attention, layer 2 a linear map for attention and no FFN,
    # layer 3 full attention + a linear FFN
    "nemotron-nas": cfg("nemotron-nas", BASE, num_hidden_layers=4, hidden_act="silu", block_configs=[
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 2.0}},
        {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}},
        {"attention": {"n_heads_in_group": 2}, "ffn": {"replace_with_linear": True}}]),
    # ---- sliding-window families: a sliding layer and a full one
    "cohere2": cfg("cohere2", BASE, tie_word_embeddings=True, layer_norm_eps=1e-5, logit_scale=0.5,
                   sliding_window=WINDOW, sliding_window_pattern=2),
    "exaone4": dense("exaone4", sliding_window=WINDOW, sliding_window_pattern="LG", rope_scaling=None),
    "gemma3_text": _gemma3_text("gemma3_text"),
    "olmo3": dense("olmo3", sliding_window=WINDOW, layer_types=SW_FULL),
    "plamo3": dense("plamo3", window_size=WINDOW, sliding_window=WINDOW, sliding_window_pattern=2,
                    rope_local_theta=10000.0),
    "spark2_5": dense("spark2_5", sliding_window=WINDOW, layer_types=SW_FULL, rope_parameters={
        "sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 10000.0}},
        tie_word_embeddings=False),
    # layer 0 sliding with RoPE, layer 1 full without (layer_rope_theta 0)
    "muse_glimmer": dense("muse_glimmer", sliding_window=WINDOW, layer_types=SW_FULL,
                          final_logit_softcapping=30.0),
    # every layer: a short conv over K/V; layer 0 also slides
    "baichuan_m1": dense("baichuan_m1", sliding_window=WINDOW, sliding_window_layers=[0], conv_window=2),
    "recurrent_gemma": cfg("recurrent_gemma", BASE, attention_bias=False, conv1d_width=4, logits_soft_cap=30.0,
                           num_key_value_heads=1, attention_window_size=WINDOW,
                           block_types=["recurrent", "attention"]),
    # ---- mixtures of experts, full attention
    "mixtral": cfg("mixtral", BASE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": moe("qwen2_moe", shared_expert_intermediate_size=32),
    "qwen3_moe": moe("qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True),
    "olmoe": moe("olmoe"),
    "granitemoe": cfg("granitemoe", BASE, logits_scaling=4.0, attention_multiplier=0.25,
                      embedding_multiplier=2.0, residual_multiplier=0.5, attention_bias=False,
                      num_local_experts=4, num_experts_per_tok=2),
    "phimoe": cfg("phimoe", BASE, num_local_experts=4, num_experts_per_tok=2),
    "phixtral": _phixtral("phixtral"),
    "phi-msft": _phixtral("phi-msft"),
    "Klear": moe("Klear", attention_bias=False, mlp_only_layers=[0], decoder_sparse_step=1, n_shared_experts=1,
                 norm_topk_prob=True),
    "dbrx": cfg("dbrx", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
                attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}),
    "dots1": cfg("dots1", BASE, DEEPSEEK_MOE, scoring_func="noaux_tc"),
    "ernie4_5_moe": dense("ernie4_5_moe", use_bias=False, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                          moe_layer_start_index=1, moe_num_shared_experts=1),
    "glm4_moe": cfg("glm4_moe", BASE, DEEPSEEK_MOE, use_qk_norm=True, attention_bias=True,
                    partial_rotary_factor=0.5, rope_scaling=None),
    "solar_open": cfg("solar_open", BASE, DEEPSEEK_MOE, partial_rotary_factor=1.0),
    # cross-layer attention: layer 1 reuses layer 0's K/V projections
    "hunyuan": dense("hunyuan", tie_word_embeddings=True, attention_bias=False, moe_topk=2, num_experts=4,
                     num_shared_expert=1, moe_intermediate_size=32, use_mixed_mlp_moe=True, use_qk_norm=True,
                     use_cla=True, cla_share_factor=2,
                     rope_scaling={"type": "dynamic", "factor": 1.0, "alpha": 1.0}),
    "bailing_moe": moe("bailing_moe", num_shared_experts=1, norm_topk_prob=True, first_k_dense_replace=1,
                       use_qk_norm=True),
    "mellum": moe("mellum", norm_topk_prob=True, sliding_window=WINDOW, layer_types=SW_FULL,
                  rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                   "full_attention": {"rope_theta": 10000.0}}),
    "minimax": cfg("minimax", BASE, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=0,
                   rotary_dim=8, intermediate_size=32),
    "minimax_m2": cfg("minimax_m2", BASE, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=0,
                      rotary_dim=8, intermediate_size=32),
    # ---- sliding window + experts
    "gpt_oss": cfg("gpt_oss", BASE, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                   layer_types=SW_FULL),
    "afmoe": moe("afmoe", layer_types=SW_FULL, num_dense_layers=1, num_shared_experts=1, sliding_window=WINDOW,
                 n_group=1, topk_group=1, route_scale=1.0),
    "exaone_moe": moe("exaone_moe", num_shared_experts=1, sliding_window=WINDOW, layer_types=SW_FULL,
                      is_moe_layer=[False, True]),
    "laguna": moe("laguna", sliding_window=WINDOW, layer_types=SW_FULL, shared_expert_intermediate_size=32,
                  mlp_layer_types=["dense", "sparse"]),
    "step3p5": dense("step3p5", num_attention_groups=2, sliding_window=WINDOW, layer_types=SW_FULL,
                     moe_num_experts=4, moe_top_k=2, moe_intermediate_size=32, share_expert_dim=32,
                     moe_layers_enum="1"),
    "mimo_v2_flash": cfg("mimo_v2_flash", BASE, num_experts_per_tok=2, hybrid_layer_pattern=[1, 0],
                         moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
                         add_full_attention_sink_bias=False,
                         sliding_window_size=WINDOW, moe_intermediate_size=32, n_shared_experts=None,
                         n_routed_experts=4, routed_scaling_factor=1.0, topk_method="noaux_tc",
                         scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
                         layernorm_epsilon=1e-5, swa_rope_theta=10000.0, swa_num_attention_heads=4,
                         swa_num_key_value_heads=2, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
                         partial_rotary_factor=0.5),
    # ---- latent attention
    "deepseek": cfg("deepseek", BASE, DEEPSEEK_MOE),
    "deepseek_v2": deepseek("deepseek_v2", topk_method="greedy", rope_scaling=YARN),
    "deepseek_v3": _deepseek_v3("deepseek_v3"),
    "kimi_k2": _deepseek_v3("kimi_k2"),
    "joyai_llm_flash": _deepseek_v3("joyai_llm_flash"),
    # sparse attention: an indexer picks the top 4 positions
    "deepseek_v32": deepseek("deepseek_v32", index_head_dim=16, index_n_heads=2, index_topk=4),
    "glm_moe_dsa": deepseek("glm_moe_dsa", index_head_dim=16, index_n_heads=2, index_topk=4,
                            topk_method="noaux_tc", scoring_func="sigmoid", attention_bias=False,
                            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "glm4_moe_lite": deepseek("glm4_moe_lite", num_nextn_predict_layers=0),
    "mistral4": deepseek("mistral4", rope_parameters=MINISTRAL_ROPE),
    "minicpm3": cfg("minicpm3", BASE, without(MLA, "v_head_dim"), dim_model_base=32, scale_depth=1.4,
                    scale_emb=12.0, rope_scaling={"original_max_position_embeddings": 512, "short_factor": 1.0,
                                                  "long_factor": 1.0}),
    "youtu_llm": cfg("youtu_llm", BASE, MLA, tie_word_embeddings=False),
    # two attention sublayers per layer, routed experts plus zero (identity) experts
    "longcat_flash": cfg("longcat_flash", MLA, attention_method="MLA", zero_expert_type="identity",
                         hidden_size=64,
                         ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=32, n_routed_experts=4,
                         zero_expert_num=2, num_layers=2, vocab_size=VOCAB, max_position_embeddings=512,
                         num_attention_heads=4, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
                         rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
                         attention_bias=False),
    "longcat_flash_ngram": cfg("longcat_flash_ngram", MLA, hidden_size=64, ffn_hidden_size=128, moe_topk=2,
                               expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, num_layers=2,
                               vocab_size=VOCAB, max_position_embeddings=512, num_attention_heads=4,
                               routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=10000.0,
                               mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2,
                               emb_neighbor_num=2, emb_split_num=2),
    "deepseek_v41": _deepseek_v41("deepseek_v41"),
    "deepseek_v41_text": _deepseek_v41("deepseek_v41_text"),
    # ---- KV reuse / sharing
    # layer 0 has its own K/V, the kv-reuse layer 1 reads them
    "afm7": cfg("afm7", vocab_size=VOCAB, hidden_dim=64, num_layers=2, num_kv_reuse_layers=1, num_heads=4,
                num_kv_heads=2, hidden_dim_scale_factor=2.0, rope_theta=10000.0),
    # ---- recurrent / hybrid
    "mamba": cfg("mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, state_size=16,
                 num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
                 tie_word_embeddings=False),
    "falcon_mamba": cfg("falcon_mamba", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, state_size=16,
                        num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4,
                        use_bcdt_rms=True, tie_word_embeddings=False),
    "mamba2": cfg("mamba2", num_heads=8, head_dim=16, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                  use_bias=False, use_conv_bias=True, tie_word_embeddings=False, time_step_limit=[0.0, 1e9],
                  time_step_rank=4),
    "rwkv7": cfg("rwkv7", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, norm_eps=1e-5, head_dim=16,
                 num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
                 decay_low_rank_dim=8),
    "falcon_h1": dense("falcon_h1", mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_n_heads=4,
                       mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=128),
    "jamba": moe("jamba", attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                 mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, intermediate_size=128,
                 tie_word_embeddings=False),
    "nemotron_h": dense("nemotron_h", attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                        mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
                        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                        hybrid_override_pattern=["M", "*", "-", "E"], n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1,
                        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, n_shared_experts=1,
                        time_step_limit=[0.0, 1e9], num_hidden_layers=4),
    "granitemoehybrid": dense("granitemoehybrid", attention_bias=False, embedding_multiplier=2.0,
                              attention_multiplier=0.25, logits_scaling=4.0, residual_multiplier=0.5,
                              layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16,
                              mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
                              mamba_conv_bias=True, tie_word_embeddings=False),
    "lfm2": _lfm2(),
    # conv, attention, conv; the first layer dense, the others routed experts
    "lfm2_moe": moe("lfm2_moe", tie_word_embeddings=True, norm_topk_prob=True, use_expert_bias=True,
                    num_dense_layers=1, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, num_hidden_layers=3,
                    layer_types=["conv", "full_attention", "conv"]),
    "qwen3_next": moe("qwen3_next", linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                      decoder_sparse_step=1, mlp_only_layers=[], shared_expert_intermediate_size=32,
                      partial_rotary_factor=0.25),
    "olmo_hybrid": dense("olmo_hybrid", linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                         attention_bias=False, layer_types=["linear_attention", "full_attention"]),
    "plamo2": cfg("plamo2", BASE, hidden_size_per_head=16, attention_window_size=WINDOW, mamba_d_state=16,
                  mamba_d_conv=4, mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16,
                  tie_word_embeddings=False),
    "gear": dense("gear", layer_types=["conv_mixer", "sliding_attention", "full_attention"], num_hidden_layers=3,
                  sliding_window=WINDOW, conv_L_cache=3, query_pre_attn_scalar=16.0, tie_word_embeddings=False),
    "kimi_linear": moe("kimi_linear", without(MLA, "q_lora_rank"), qk_rope_head_dim=8, mla_use_nope=False,
                       model_max_length=512,
                       num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
                       linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16,
                                           "short_conv_kernel_size": 4}),
    "bailing_hybrid": moe("bailing_hybrid", MLA, num_shared_experts=1, n_group=1, topk_group=1,
                          first_k_dense_replace=1, layer_group_size=2, group_norm_size=1,
                          routed_scaling_factor=1.0, partial_rotary_factor=0.5),
    "bailing_moe_linear": moe("bailing_moe_linear", num_shared_experts=1, norm_topk_prob=True,
                              first_k_dense_replace=1, layer_group_size=2, group_norm_size=1),
    "bailing_moe_v3": moe("bailing_moe_v3", MLA, moe_shared_expert_intermediate_size=32, num_shared_experts=1,
                          first_k_dense_replace=1, n_group=1, topk_group=1, layer_group_size=2,
                          short_conv_kernel_size=4),
    # ---- multimodal wrappers: the text model under language_model
    "gemma3": cfg("gemma3", text_config=_gemma3_text("gemma3_text"), vocab_size=VOCAB),
    # gemma4's text model with its routed-expert block beside the MLP and K = V in the full layers
    # sliding, full, sliding, full; layers 2-3 read the K/V of layers 0-1; activation sparsity in layers 0-1,
    # 4 AltUp streams, a rank-8 LAuReL block, a 16-wide per-layer input; the text model is
    # model.model.language_model
    "gemma3n": cfg("gemma3n", text_config=cfg(
        "gemma3n_text", BASE, num_hidden_layers=4, tie_word_embeddings=True, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW, rope_local_base_freq=10000.0,
        final_logit_softcapping=30.0, layer_types=SW_FULL * 2,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], hidden_size_per_layer_input=16, altup_num_inputs=4,
        altup_coef_clip=120.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=8)),
    "gemma4_text": _gemma4_text("gemma4_text", enable_moe_block=True, num_experts=4, top_k_experts=2,
                                moe_intermediate_size=32, attention_k_eq_v=True),
    "gemma4": cfg("gemma4", text_config=_gemma4_text("gemma4_text"), vocab_size=VOCAB),
    "gemma4_unified": cfg("gemma4_unified", text_config=_gemma4_text("gemma4_text"), vocab_size=VOCAB),
    "mistral3": cfg("mistral3", text_config=dense("ministral3", sliding_window=WINDOW, layer_types=SW_FULL,
                                                  rope_parameters=MINISTRAL_ROPE)),
    "llava": cfg("llava", text_config=dense("llama")),
    "pixtral": cfg("pixtral", text_config=dense("llama")),
    "qwen2_vl": cfg("qwen2_vl", text_config=dense("qwen2")),
    "qwen2_5_vl": cfg("qwen2_5_vl", text_config=dense("qwen2")),
    "qwen3_vl": cfg("qwen3_vl", text_config=dense("qwen3")),
    "qwen3_vl_moe": cfg("qwen3_vl_moe", text_config=moe("qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[0],
                                                       norm_topk_prob=True)),
    "qwen3_5": cfg("qwen3_5", text_config=_qwen3_5_text()),
    "qwen3_5_moe": cfg("qwen3_5_moe", text_config=_qwen3_5_text(**MOE, shared_expert_intermediate_size=32,
                                                               decoder_sparse_step=1)),
    "lfm2-vl": cfg("lfm2-vl", text_config=_lfm2()),
    "llama4": cfg("llama4", text_config=_llama4_text("llama4_text")),
    "llama4_text": dense("llama4_text", intermediate_size_mlp=128, no_rope_layers=[1, 0], use_qk_norm=True),
    "kimi_vl": cfg("kimi_vl", text_config=_deepseek_v3("deepseek_v3")),
    "kimi_k25": cfg("kimi_k25", text_config=_deepseek_v3("deepseek_v3")),
    "kimi_k3": cfg("kimi_k3", text_config=cfg(
        "kimi_linear", BASE, MLA, qk_rope_head_dim=8, mla_use_nope=True, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1,
        linear_attn_config={"kda_layers": [1], "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4})),
    "minimax_m3_vl": cfg("minimax_m3_vl", text_config=cfg(
        "minimax_m3", BASE, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, partial_rotary_factor=0.5, routed_scaling_factor=1.0,
        mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sparse_attention"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1)),
    "muse_spark": cfg("muse_spark", text_config=dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
        vocab_size=VOCAB, rms_norm_eps=1e-5, post_norm_eps=1e-8, rope_parameters={"rope_theta": 10000.0},
        layer_rope_theta=[10000.0, 0], layer_types=SW_FULL, sliding_window=WINDOW, final_logit_softcapping=30.0,
        output_multiplier=1.0, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=64,
        moe_intermediate_size=32)),
}

CANNOT_BUILD: dict[str, str] = {
    "olmo": "mlx-lm's olmo module imports the ai2-olmo package (hf_olmo) and exits the interpreter "
            "(sys.exit) when it is missing",
    "prism_hadamard_qwen35": "a Hadamard-rotated 2-bit quantized weight pack: the class needs a packed-module "
                             "manifest and replaces the layers by frozen 2-bit quantized ones whose weights come "
                             "from the pack, so there is no float32 random-weight form",
}

# Families that build but whose forward pass calls Metal kernels (mx.fast.metal_kernel) with no fallback, so
# they run on Apple silicon only.
NEEDS_METAL: dict[str, str] = {
    "bitnet": "BitLinear layers run a Metal kernel (bitlinear_layers.py)",
    "muse_spark": "attention runs the Metal kernel qk_norm_rope (mlx_lm/kernels)",
}

# Families whose head is the token embedding (tied, whatever tie_word_embeddings says).
TIED_HEAD = frozenset({"afm7", "cohere", "cohere2", "gemma", "gemma2", "gemma3n", "gemma4", "gemma4_text",
                       "gemma4_unified", "gpt2", "hunyuan", "lfm2", "lfm2-vl", "lfm2_moe", "lille-130m",
                       "phi3small"})
# Random weights with mlx's initialisation make greedy generation repeat itself: a tied head gives back the
# input token (the residual stream is mostly its embedding), an untied one falls into short cycles (the
# layers' output, not the token, decides the next token). `build` therefore scales the token embedding
# table: down for tied heads, up for untied ones, by these factors unless EMBED_SCALE says otherwise.
TIED_EMBED_SCALE = 0.03
UNTIED_EMBED_SCALE = 4.0
EMBED_SCALE: dict[str, float] = {
    "glm4": 32.0,  # post-norms after attention and MLP: each layer adds unit-RMS outputs
    "granitemoe": 1.0,  # already scaled by embedding_multiplier
    "minicpm3": 1.0,  # already scaled by scale_emb
}

# Other tables scaled at build time: gpt2's learned position embeddings, so that its tied head does not
# give back the input token (with them at mlx's initial scale, 14 distinct tokens of 32 at best).
PARAMETER_SCALE: dict[str, dict[str, float]] = {"gpt2": {"model.wpe.weight": 10.0}}

# Families whose greedy generation of 32 tokens (mlx-lm's generate_step, a random 20-token prompt, seed 0)
# gives fewer than 16 distinct tokens, whatever embedding scale: both have tied heads.
DEGENERATE: dict[str, str] = {
    "lille-130m": "a tied head with no output scaling; 3 to 8 distinct tokens of 32 at every embedding scale "
                  "tried (1e-4 to 1)",
    "phi3small": "a tied head divided by mup_width_multiplier; 1 to 5 distinct tokens of 32 at every embedding "
                 "scale tried (1e-4 to 1)",
}


def module_name(model_type: str) -> str:
    """The mlx-lm module that runs `model_type` (mlx_lm.utils.MODEL_REMAPPING applied)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def model_class(model_type: str):
    """mlx-lm's own Model and ModelArgs for `model_type`, looked up as mlx_lm.utils does."""
    module = importlib.import_module(f"mlx_lm.models.{module_name(model_type)}")
    return module.Model, module.ModelArgs


def model_types() -> list[str]:
    """Every model_type that `build` can make, sorted."""
    return sorted(CONFIGS)


def runnable_model_types() -> list[str]:
    """The model_types whose forward pass runs on this machine (Metal-only families left out without Metal)."""
    metal = mx.metal.is_available()
    return [t for t in model_types() if metal or t not in NEEDS_METAL]


def config(model_type: str) -> dict:
    """A deep copy of the family's config (ModelArgs may edit the dicts it is given)."""
    return copy.deepcopy(CONFIGS[model_type])


def vocab_size(model_type: str) -> int:
    c = CONFIGS[model_type]
    return c.get("text_config", c).get("vocab_size") or c.get("num_vocab") or c.get("vocab_size")


def embed_scale(model_type: str) -> float:
    if model_type in EMBED_SCALE:
        return EMBED_SCALE[model_type]
    return TIED_EMBED_SCALE if model_type in TIED_HEAD else UNTIED_EMBED_SCALE


def build(model_type: str, seed: int = 0):
    """A random-weight float32 mlx-lm model of `model_type`, its token embeddings scaled by
    `embed_scale(model_type)`, its weights evaluated."""
    import mlx.nn as nn

    if model_type in CANNOT_BUILD:
        raise ValueError(f"{model_type}: {CANNOT_BUILD[model_type]}")
    Model, Args = model_class(model_type)
    mx.random.seed(seed)
    model = Model(Args.from_dict(config(model_type)))
    model.set_dtype(mx.float32)
    scale, vocab = embed_scale(model_type), vocab_size(model_type)
    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight.shape[0] == vocab:
            module.weight = module.weight * scale
    if model_type in PARAMETER_SCALE:
        from mlx.utils import tree_flatten, tree_unflatten

        params = dict(tree_flatten(model.parameters()))
        model.update(tree_unflatten([(p, params[p] * f) for p, f in PARAMETER_SCALE[model_type].items()]))
    _fill_zero_parameters(model)
    mx.eval(model.parameters())
    return model


def _fill_zero_parameters(model) -> None:
    """Give the floating-point parameters that mlx-lm initialises to all zeros (router gates, attention sinks,
    talkie's head, recurrent_gemma's conv and recurrence weights, rwkv7's token-shift mixes, norms stored as
    an offset from 1, ...) random values, so that every path changes the output: normal with standard
    deviation 1/sqrt(fan-in) for matrices, 0.1 for vectors. Biases stay zero."""
    from mlx.utils import tree_flatten, tree_unflatten

    candidates = [(path, value) for path, value in tree_flatten(model.parameters())
                  if value.size > 1 and mx.issubdtype(value.dtype, mx.floating) and not path.endswith("bias")]
    nonzero = [mx.any(value) for _, value in candidates]
    mx.eval(nonzero)
    filled = []
    for (path, value), any_set in zip(candidates, nonzero):
        if not any_set.item():
            std = value.shape[-1] ** -0.5 if value.ndim >= 2 else 0.1
            filled.append((path, (mx.random.normal(value.shape) * std).astype(value.dtype)))
    if filled:
        model.update(tree_unflatten(filled))
