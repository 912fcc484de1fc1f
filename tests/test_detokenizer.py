"""Output text: incremental detokenization (real SmolLM2 tokenizer and a tiny byte-level BPE trained
here, so the tests never depend on the model alone) and stop strings (plain strings, then tokens)."""

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cluster.detokenizer import IncrementalDetokenizer, OutputText, StopStringMatcher

FFFD = "\ufffd"

# ---- tokenizers ----


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from mlx_lm.utils import load_tokenizer

    from cluster.gguf_import import ensure_default_model

    try:
        return load_tokenizer(ensure_default_model(progress=False))
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 400-token byte-level BPE; its merges cross character boundaries (e.g. 'ĸçķ' = end of 世 +
    start of 界), the hard case for holding back partial characters."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["Hello world, café naïve 世界你好 🎉👍🏽 alpha beta gamma"] * 5 + ["中文中文中文 日本語のテキスト"]
    tok.train_from_iterator(corpus, trainer)
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>"))


@pytest.fixture(scope="session", params=["smollm", "tiny"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids, skip=True):
    return tokenizer.decode(ids, skip_special_tokens=skip)


def stream(tokenizer, ids, prompt=(), skip=True):
    """Feed ids one by one; check the per-add invariant; return (deltas, flushed)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = []
    for i, token_id in enumerate(ids):
        deltas.append(detok.add(token_id))
        # everything but the one character that may still be incomplete is out already
        assert detok.text == decode(tokenizer, ids[:i + 1], skip).removesuffix(FFFD)
    return deltas, detok.flush()


# ---- the docstring story, exactly ----


def test_docstring_example_smollm(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt, ids = encode(tok, "Say hi"), encode(tok, "世界!")
    assert tok.convert_ids_to_tokens(ids) == ["ä¸", "ĸ", "ç", "ķ", "Į", "!"]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, windows = [], []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        windows.append(len(detok._ids))  # a few tokens, never the whole output
    assert deltas == ["", "世", "", "", "界", "!"]
    assert windows == [3, 2, 3, 4, 3, 1]
    assert detok.flush() == "" and detok.text == "世界!"


def test_token_crossing_characters_tiny(tiny_tokenizer):
    ids = encode(tiny_tokenizer, "世界!")
    assert tiny_tokenizer.convert_ids_to_tokens(ids)[:3] == ["ä¸", "ĸçķ", "Į"]
    assert stream(tiny_tokenizer, ids) == (["", "世", "界", "!"], "")


# ---- properties: deltas + flush == decode(ids), no partial characters ----

PIECES = ["é", "e\u0301", "n\u0303\u0323", "\u0301", "ü", "ß", "Ω", "世界", "你好", "日本語", "한국어",
          "🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "😀", " ", "  ", "\n", "\t", "A", "hello", " world", "123",
          "<|endoftext|>"]
texts = st.lists(st.sampled_from(PIECES) | st.text(st.characters(exclude_categories=("Cs",), exclude_characters=FFFD), max_size=3),
                 max_size=25).map("".join)


@settings(max_examples=150, deadline=None)
@given(prompt=texts, text=texts)
def test_valid_text_never_splits_a_character(tokenizer, prompt, text):
    ids = encode(tokenizer, text)
    # SmolLM2's vocab lacks some bytes (0xF1, 0xF2, a few controls): encode drops them silently
    assume(FFFD not in decode(tokenizer, ids))
    deltas, flushed = stream(tokenizer, ids, encode(tokenizer, prompt))
    assert not any(FFFD in d for d in deltas) and flushed == ""
    assert "".join(deltas) == decode(tokenizer, ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_decode(tokenizer, data, skip):
    """Any id sequence (invalid UTF-8, special tokens): the streamed text is decode's, and a U+FFFD
    is emitted only once later bytes make it final (`stream` checks that after every add)."""
    ids = st.lists(st.integers(0, len(tokenizer.get_vocab()) - 1), max_size=30)
    prompt, out = data.draw(ids), data.draw(ids)
    deltas, flushed = stream(tokenizer, out, prompt, skip)
    assert "".join(deltas) + flushed == decode(tokenizer, out, skip)


def test_invalid_byte_emitted_once_clear(tokenizer):
    x80, e4, a = tokenizer.convert_tokens_to_ids(["Ģ", "ä", "A"])  # bytes 0x80, 0xE4, "A"
    assert stream(tokenizer, [a, x80, a]) == (["A", "", FFFD + "A"], "")  # a lone continuation byte
    assert stream(tokenizer, [a, e4, a]) == (["A", "", FFFD + "A"], "")  # a lead byte cut short
    assert stream(tokenizer, [a, e4]) == (["A", ""], FFFD)  # ends inside a character: flush


def test_prompt_gives_left_context(tokenizer):
    prompt = encode(tokenizer, "Hello")
    ids = encode(tokenizer, " world, café")
    deltas, _ = stream(tokenizer, ids, prompt)
    assert "".join(deltas) == " world, café"
    # a prompt ending inside a character is not used as context (its bytes would join ours)
    cut = encode(tokenizer, "世")[:1]
    assert decode(tokenizer, cut) == FFFD
    assert "".join(stream(tokenizer, ids, cut)[0]) == " world, café"


def test_window_stays_small(tokenizer):
    text = ("The quick brown fox jumps over the lazy dog. 世界你好, café naïve 🎉👍🏽. " * 40)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Write:"))
    biggest = 0
    for token_id in encode(tokenizer, text):
        detok.add(token_id)
        biggest = max(biggest, len(detok._ids))
    assert detok.flush() == "" and detok.text == text
    assert biggest <= 8


# ---- stop strings: plain text ----


def feed_all(matcher, chunks):
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return out, True
    return out, False


def test_stop_spanning_feeds_docstring():
    m = StopStringMatcher(["DEFGHIJ"])
    assert [m.feed(c) for c in ["ABC", "DE", "FG", "HIJK"]] == [
        ("ABC", False), ("", False), ("", False), ("", True)]
    assert m.feed("more") == ("", True) and m.flush() == ""
    m = StopStringMatcher(["DEX"])
    assert [m.feed(c) for c in ["ABC", "DE", "FG"]] == [("ABC", False), ("", False), ("DEFG", False)]


def test_stop_inside_repeated_phrase():
    chunks = ["alpha", " beta", " gamma", " alpha", " beta", " gamma"]
    m = StopStringMatcher(["beta gamma"])
    # " beta": " " is safe, "beta" could start the stop; " gamma" completes it
    assert feed_all(m, chunks) == (["alpha", " ", ""], True)
    m = StopStringMatcher(["beta gamma"])
    out, stopped = feed_all(m, "alpha beta gamma alpha beta gamma")  # one character per feed
    assert "".join(out) == "alpha " and stopped


def test_overlapping_stop_prefixes():
    m = StopStringMatcher(["abcd", "bce", "abx"])
    assert m.feed("zab") == ("z", False)  # "ab" starts "abcd" and "abx" (and "b" starts "bce")
    assert m.feed("c") == ("", False)  # "abc" starts "abcd"
    assert m.feed("e") == ("a", True)  # "bce" completes at 1 of "abce"
    # first to complete wins, whatever the feeds: "cd" ends before "abcdef" does
    for chunks in (["abcdef"], ["ab", "cdef"], list("abcdef")):
        m = StopStringMatcher(["abcdef", "cd"])
        assert "".join(feed_all(m, chunks)[0]) == "ab"
    m = StopStringMatcher(["b", "ab"])  # same end: the longer one
    assert m.feed("xab") == ("x", True)


def test_stop_at_very_start():
    m = StopStringMatcher(["Hello"])
    assert m.feed("Hello world") == ("", True)


def test_stop_never_completes_flush_releases():
    m = StopStringMatcher(["DEFX"])
    assert feed_all(m, ["ABC", "DE", "F"]) == (["ABC", "", ""], False)
    assert m.flush() == "DEF" and m.flush() == ""


def test_no_stops_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""


@pytest.mark.parametrize("bad", ["stop", [""], ["ok", 3]])
def test_bad_stop_raises(bad):
    with pytest.raises(ValueError, match="stop="):
        StopStringMatcher(bad)


def chunked(text, cuts):
    cuts = sorted(set(c % (len(text) + 1) for c in cuts))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


@settings(max_examples=300, deadline=None)
@given(text=st.text(min_size=1), data=st.data())
def test_stop_substring_any_chunking(text, data):
    i = data.draw(st.integers(0, len(text) - 1))
    stop = text[i:data.draw(st.integers(i + 1, len(text)))]
    m = StopStringMatcher([stop])
    out, stopped = feed_all(m, chunked(text, data.draw(st.lists(st.integers(0, 10**6)))))
    assert stopped and "".join(out) == text[:text.find(stop)]


def reference_cut(text, stops):
    """Check after every character: the first stop to complete (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [end - len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            return text[:min(hits)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=20), stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 100)))
def test_several_stops_match_reference(text, stops, cuts):
    m = StopStringMatcher(stops)
    out, stopped = feed_all(m, chunked(text, cuts))
    emitted = "".join(out) + ("" if stopped else m.flush())
    assert (emitted, stopped) == reference_cut(text, stops)


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=20), stops=st.lists(st.text("abc", min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 100)))
def test_the_matcher_names_the_stop_string_that_cut_the_text(text, stops, cuts):
    m = StopStringMatcher(stops)
    out, stopped = feed_all(m, chunked(text, cuts))
    if not stopped:
        assert m.matched is None
        return
    emitted = "".join(out)
    end = len(emitted) + len(m.matched)
    assert m.matched in stops and text[len(emitted):end] == m.matched
    assert not any(s in text[:end - 1] for s in stops)  # none completed earlier
    assert all(len(s) <= len(m.matched) for s in stops if text[:end].endswith(s))  # the longest on a tie


# ---- stop strings over tokens: OutputText ----


def run_output(tokenizer, prompt, text, stop):
    out = OutputText(tokenizer, encode(tokenizer, prompt), stop=stop)
    deltas = []
    for token_id in encode(tokenizer, text):
        delta, stopped, _ = out.add(token_id)
        deltas.append(delta)
        if stopped:
            return deltas, True, out
    deltas.append(out.finish().text)
    return deltas, False, out


def test_stop_across_smollm_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    assert tok.convert_ids_to_tokens(encode(tok, "DEFGHIJK")) == ["DEF", "GH", "I", "J", "K"]
    deltas, stopped, out = run_output(tok, "ABC", "DEFGHIJK", ["DEFGHIJ"])
    assert deltas == ["", "", "", ""] and stopped and out.stopped and out.text == ""
    deltas, stopped, out = run_output(tok, "Say", "alpha beta gamma alpha beta gamma", ["beta gamma"])
    assert deltas == ["alpha", " ", ""] and stopped and out.text == "alpha "


@settings(max_examples=100, deadline=None)
@given(text=texts, data=st.data())
def test_output_text_property(tokenizer, text, data):
    """Token by token, with a stop string taken from the decoded text: the result is the decoded
    text up to the stop, and no delta holds a partial character."""
    full = decode(tokenizer, encode(tokenizer, text))
    assume(FFFD not in full)
    stop = []
    if full and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(full) - 1))
        stop = [full[i:data.draw(st.integers(i + 1, min(len(full), i + 8)))]]
    deltas, stopped, out = run_output(tokenizer, "Go:", text, stop)
    assert not any(FFFD in d for d in deltas)
    assert out.text == "".join(deltas)
    if stop:
        # the stop is found no later than the text's own first occurrence
        assert stopped and out.text == full[:full.find(stop[0])]
    else:
        assert not stopped and out.text == full


def test_finish_after_length(tiny_tokenizer):
    out = OutputText(tiny_tokenizer, stop=["gamma!"])
    ids = encode(tiny_tokenizer, "alpha 世界 gamma")
    sent = "".join(out.add(t)[0] for t in ids)
    assert sent == "alpha 世界 "  # "gamma" may start "gamma!": held
    assert out.finish().text == "gamma" and out.text == "alpha 世界 gamma" and not out.stopped


def test_output_text_names_the_stop_string_that_ended_it(smollm_tokenizer):
    deltas, stopped, out = run_output(smollm_tokenizer, "Hello", " ABC DEFGHIJK", ("XYZ", "GHI"))
    assert stopped and "".join(deltas) == " ABC DEF" and out.stop_string == "GHI"
    deltas, stopped, out = run_output(smollm_tokenizer, "Hello", " ABC", ("XYZ",))
    assert not stopped and out.stop_string is None
