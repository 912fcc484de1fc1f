"""The thinking-model fixtures (tests/thinking_models.py): their markers are single special tokens with logits,
their chat templates render prompts as the real Qwen3 and gpt-oss templates do, and the engine serves the folders
exactly as mlx-lm runs them."""

from __future__ import annotations

import pytest

from tests.engine_helpers import make_engine, run
from tests.family_helpers import reference_of
from tests.thinking_models import (HARMONY_TOKENS, THINK_TOKENS, gpt_oss_dir, load, qwen3_thinking_dir,
                                   token_id)

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


def test_qwen3_fixture_adds_think_markers_as_special_tokens_inside_the_models_vocabulary():
    _, tokenizer, spec = load(qwen3_thinking_dir())
    ids = [token_id(tokenizer, t) for t in THINK_TOKENS]
    assert len(set(ids)) == 2 and all(i < spec.vocab_size for i in ids)
    assert spec.vocab_size == len(tokenizer._tokenizer)
    # skipped like every special token, kept when asked for
    assert tokenizer.decode(ids, skip_special_tokens=True) == ""
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<think></think>"


def test_qwen3_template_lets_the_model_open_its_reasoning_or_closes_an_empty_one_when_thinking_is_off():
    _, tokenizer, _ = load(qwen3_thinking_dir())
    on = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # an earlier answer's reasoning is dropped from the history, as the real template does
    history = CHAT + [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                      {"role": "user", "content": "And 3 + 3?"}]
    rendered = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "add them" not in rendered and "<|im_start|>assistant\n4<|im_end|>" in rendered


def test_gpt_oss_fixture_has_the_harmony_specials_and_ends_its_generation_prompt_at_the_assistant_header():
    _, tokenizer, spec = load(gpt_oss_dir())
    ids = {t: token_id(tokenizer, t) for t in HARMONY_TOKENS}
    assert len(set(ids.values())) == len(HARMONY_TOKENS) and max(ids.values()) < spec.vocab_size
    assert set(spec.eos_token_ids) == {ids["<|return|>"], ids["<|call|>"]}
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|start|>system<|message|>")
    assert prompt.endswith("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")


@pytest.mark.parametrize("folder", [qwen3_thinking_dir, gpt_oss_dir], ids=["qwen3", "gpt_oss"])
def test_the_engine_serves_the_fixture_folder_with_mlx_lms_greedy_tokens(folder):
    from cluster.request import GenerateRequest, SamplingParams

    loaded = load(folder())
    tokenizer = loaded[1]
    prompt = tuple(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    core = make_engine(loaded, dtype="float32", num_blocks=64, block_size=8)
    result = run(core, [GenerateRequest("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))])
    assert result["r"].token_ids == reference_of(loaded[0], prompt)[0]
