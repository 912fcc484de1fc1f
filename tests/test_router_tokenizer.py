"""RouterTokenizer over the real SmolLM2 tokenizer (falls back to CharTokenizer without the model)."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import APIError
from router.openai.request import ChatCompletionRequest
from router.params import tokenize_chat
from router.tokenizer import ChatTemplateError, RouterTokenizer
from tests.router_fakes import CharTokenizer, load_tokenizer

TEXTS = ["Hello, world!", "naïve café — 東京 😀👍🏽", "  leading spaces\nand\ttabs ", "<|im_end|> literal"]


@pytest.fixture
def tok():
    return load_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(tok, text):
    ids = tok.encode(text)
    joined = b"".join(tok.token_bytes(t) for t in ids)
    assert joined.decode("utf-8") == tok.decode(ids)
    for t in ids:
        raw = tok.token_bytes(t)
        try:
            assert tok.token_text(t) == raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: escaped, as OpenAI shows it
            assert "\\x" in tok.token_text(t) and "\ufffd" not in tok.token_text(t)


def test_special_tokens_and_out_of_range(tok):
    for t in tok.eos_token_ids:
        assert tok.token_text(t) == tok.decode([t]) and tok.token_bytes(t) == tok.decode([t]).encode()
    assert tok.token_bytes(tok.vocab_size + 5) == b"" and tok.token_text(-1) == ""


def test_render_chat_matches_the_model_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text, ids = tok.render_chat(messages)
    assert "Hi there" in text and tok.decode(ids) == text
    native = tok._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(native)


def test_long_prompts_are_tokenized_off_the_event_loop(tok):
    tok = RouterTokenizer(tok._tok)  # a fresh one: no executor yet
    long_text = "word " * 2000
    assert asyncio.run(tok.aencode("short")) == tok.encode("short")
    assert tok._executor is None
    assert asyncio.run(tok.aencode(long_text)) == tok.encode(long_text)
    assert tok._executor is not None
    messages = [{"role": "user", "content": long_text}]
    assert asyncio.run(tok.arender_chat(messages)) == tok.render_chat(messages)
    tok.close()
    assert tok._executor is None


def test_char_tokenizer_fallback_interface():
    tok = RouterTokenizer(CharTokenizer())
    ids = tok.encode("hé")
    assert ids[0] == 0 and tok.decode(ids) == "<bos>hé"
    assert tok.token_text(2) == "<|im_end|>" and tok.eos_token_ids == (1, 2) and tok.vocab_size == 259
    assert tok.render_chat([{"role": "user", "content": "x"}])[0] == "<user>x<|im_end|><assistant>"


def test_template_errors_are_400():
    class Strict(CharTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant")

    class NoTemplate(CharTokenizer):
        has_chat_template = False

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    for wrapper, words in ((Strict(), "alternate"), (NoTemplate(), "/v1/completions")):
        with pytest.raises(APIError) as exc:
            asyncio.run(tokenize_chat(req, RouterTokenizer(wrapper)))
        assert exc.value.status == 400 and words in exc.value.message and exc.value.param == "messages"
    with pytest.raises(ChatTemplateError):
        RouterTokenizer(NoTemplate()).render_chat([{"role": "user", "content": "x"}])
