"""Small random-weight thinking models as mlx-lm folders, for engine and router tests of reasoning.

- `qwen3_thinking_dir()`: a 2-layer qwen3 (tests/family_helpers.py's qwen3 config) whose tokenizer is SmolLM2's
  with `<think>` and `</think>` added as special tokens and the real Qwen3 chat template
  (tests/fixtures/thinking/qwen3_chat_template.jinja);
- `gpt_oss_dir()`: a 2-layer gpt_oss (family_helpers' gpt_oss config: sliding-window layers, sinks, experts)
  whose tokenizer is SmolLM2's with the harmony specials added (`HARMONY_TOKENS`) and the real gpt-oss chat
  template (tests/fixtures/thinking/gpt_oss_chat_template.jinja); its EOS ids are `<|return|>` and `<|call|>`,
  as gpt-oss's generation config has them.

Each folder holds config.json (vocab_size = the grown tokenizer's length, so the added ids have logits),
model.safetensors (weights from `mx.random.seed`, float32) and the tokenizer files with the template. Built
once per test session into a temporary folder (removed at exit) and returned by path, so router-level tests
can serve it by path too. `load(folder)` gives (model, tokenizer, spec) as the engine takes them.

Random models never close their reasoning on their own: tests drive the markers with budgets (forced end
markers), logit_bias, or prompts that end inside reasoning (`THINK_TOKENS`, `HARMONY_TOKENS` name the ids to
look up with `token_id`).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "thinking"
THINK_TOKENS = ("<think>", "</think>")
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def _smollm2_tokenizer():
    """SmolLM2's Hugging Face tokenizer (the default model's), freshly loaded (callers add tokens to it)."""
    from transformers import AutoTokenizer

    from cluster.gguf_import import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model(progress=False)))


def _build(name: str, model_type: str, specials: tuple[str, ...], template: str, seed: int,
           extra_config: dict) -> Path:
    """Write the folder `name` (see the module docstring) into a session temporary folder; returns it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from tests.family_helpers import COMMON, CONFIGS, build

    tokenizer = _smollm2_tokenizer()
    tokenizer.add_tokens(list(specials), special_tokens=True)
    tokenizer.chat_template = (FIXTURES / template).read_text()
    root = Path(tempfile.mkdtemp(prefix=f"thinking-{name}-"))
    atexit.register(shutil.rmtree, root, True)
    folder = root / name
    config = {"model_type": model_type, **COMMON, **CONFIGS[model_type], "vocab_size": len(tokenizer),
              **extra_config}
    model = build(model_type, config, seed=seed)
    folder.mkdir()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(folder))
    return folder


@functools.lru_cache(maxsize=None)
def qwen3_thinking_dir() -> Path:
    """The qwen3 thinking model's folder (built once per session): `<think>` / `</think>` special tokens, the
    real Qwen3 chat template, EOS `<|im_end|>` (SmolLM2's id 2, as family_helpers' configs have it)."""
    return _build("qwen3-thinking", "qwen3", THINK_TOKENS, "qwen3_chat_template.jinja", seed=11, extra_config={})


@functools.lru_cache(maxsize=None)
def gpt_oss_dir() -> Path:
    """The gpt_oss harmony model's folder (built once per session): the harmony specials, the real gpt-oss chat
    template, EOS ids `<|return|>` and `<|call|>`."""
    tokenizer = _smollm2_tokenizer()
    tokenizer.add_tokens(list(HARMONY_TOKENS), special_tokens=True)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    return _build("gpt-oss-harmony", "gpt_oss", HARMONY_TOKENS, "gpt_oss_chat_template.jinja", seed=12,
                  extra_config={"eos_token_id": eos})


@functools.lru_cache(maxsize=None)
def load(folder: Path):
    """(model, tokenizer, spec) of a folder above, loaded once per session (float32; the spec's model id is the
    folder's name)."""
    from cluster.model import load_model, read_model_spec

    model, tokenizer = load_model(folder, "float32")
    return model, tokenizer, read_model_spec(folder, model_id=folder.name)


def token_id(tokenizer, token: str) -> int:
    """The id of one added special token (`THINK_TOKENS`, `HARMONY_TOKENS`) in a loaded tokenizer."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    assert len(ids) == 1, f"{token!r} is not one token: {ids}"
    return ids[0]
