"""Constrained decoding: every output token of a request with `SamplingParams.grammar` follows that grammar.

The grammar engine is llguidance (its `LLMatcher`: an Earley parser over a lexer, with a token trie that
computes the set of allowed next tokens, the "mask", in tens to hundreds of microseconds). An engine has one `Grammars`:

- the llguidance tokenizer, built once on the first constrained request from the engine's mlx-lm
  `TokenizerWrapper` (~0.3 s), over the model's logits vocabulary (ids the tokenizer lacks are never allowed)
  and with every EOS id the engine knows, so that any of them ends a matched grammar;
- per sequence a `GrammarMatcher` (`Sequence.grammar`), started when the request is added (`start`; a grammar
  that does not compile is a `GrammarError`, which the engine turns into an `error` finish) and advanced by
  every output token the scheduler appends (`GrammarMatcher.consume`: also each accepted draft token, and on
  a decode worker the first token, sampled on the prefill worker, replayed into a fresh matcher);
- the masks of a step: `rule_masks` fills an int32 bitmask [B, ceil(V/32)] for the constrained rows of the batch
  (bit t of word w allows token 32w + t, llguidance's layout; a free row's words stay all ones) and unpacks it
  on the host (NumPy) into bool [B, V], which `cluster.sampling.sample` applies to the batch's logits in one
  `where` (a free row's logits are left as they are);
  a row's `TokenRule` (`token_rule`) joins its grammar and its reasoning (cluster/reasoning.py): no mask while
  inside reasoning, the one forced token of an end marker at the budget, the grammar's mask for the answer;
  `draft_masks` gives a verifying row the masks at each of its k+1 positions by advancing the matcher through
  the drafts and rolling it back; `mask_after` serves a drafter the same way.

Masks are filled one matcher after another: llguidance's `LLExecutor` (`fill_next_token_bitmask_par`) was
measured slower on the 2-core CPU this engine is tested on (SmolLM2's 49,152 tokens, JSON schema grammars:
~0.02-0.06 ms per row in the loop, ~0.04-0.08 ms per row through the executor, whose thread hand-off
dominates).
`mask_seconds` sums the wall time of filling and unpacking, `num_constrained` counts requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence as Seq

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np

_MAX_MESSAGE = 600  # characters of an llguidance error kept in a request's error message


def llguidance_tokenizer(tokenizer, n_vocab: Optional[int] = None, eos_ids: Iterable[int] = ()
                         ) -> "llguidance.LLTokenizer":
    """The llguidance tokenizer of `tokenizer` (mlx-lm's TokenizerWrapper or a Hugging Face fast tokenizer):
    over `n_vocab` ids (None = the tokenizer's own size), with `eos_ids` (empty = the tokenizer's EOS) ending a
    matched grammar. ~0.3 s for a 50k vocabulary: callers keep it. Raises ValueError for a tokenizer that is
    not a fast one (llguidance reads the Rust tokenizer's JSON)."""
    import llguidance.hf  # imports transformers, which mlx-lm has loaded already

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=sorted(set(eos_ids)) or None)


class GrammarError(ValueError):
    """A request's grammar does not compile (the message says where and why, in llguidance's words)."""


def _short(error: str) -> str:
    """llguidance's error without its parser-state dump and grammar echo, at most `_MAX_MESSAGE` characters."""
    error = error.split("\n<state>", 1)[0].strip()
    return error if len(error) <= _MAX_MESSAGE else error[:_MAX_MESSAGE] + " ..."


class GrammarMatcher:
    """One sequence's place in its grammar (`Sequence.grammar`): an llguidance `LLMatcher` that has consumed
    every output token so far. Only the engine's thread uses it."""

    def __init__(self, matcher: "llguidance.LLMatcher", tokenizer: "llguidance.LLTokenizer"):
        self.matcher, self._tokenizer = matcher, tokenizer

    def consume(self, token: int) -> tuple[bool, Optional[str]]:
        """Advance by one appended output token. Returns (complete, error): complete is True once the grammar
        is matched and allows nothing more but EOS (the sequence finishes with `stop`); error is a message
        when the token breaks the grammar or the matcher failed (the sequence finishes with `error`)."""
        if self.matcher.is_error():  # e.g. a parser limit hit while the last mask was computed
            return False, f"the request's grammar failed: {_short(self.matcher.get_error())}"
        if not self.matcher.consume_token(token):
            shown = self._tokenizer.dbg_tokens([token]) if 0 <= token < self._tokenizer.vocab_size else "?"
            return False, (f"output token {token} {shown} does not follow the request's grammar "
                           f"(response_format / tool_choice): {_short(self.matcher.get_error())}")
        return self.matcher.is_stopped(), None

    def valid_prefix(self, tokens: Seq[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the matcher does not move)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0


@dataclass(frozen=True)
class TokenRule:
    """What a row's next token may be: `forced` alone when set (a reasoning end marker at its budget), else what
    `grammar`'s mask allows (None: anything) plus the tokens of `also` (the reasoning start marker's first token
    where the answer may still begin with reasoning)."""

    grammar: Optional[GrammarMatcher] = None
    forced: Optional[int] = None
    also: tuple[int, ...] = ()


def token_rule(grammar: Optional[GrammarMatcher], reasoning=None) -> Optional[TokenRule]:
    """The rule of a sequence's next token from its grammar (`Sequence.grammar`) and reasoning state
    (`Sequence.reasoning`, cluster/reasoning.py): the forced token, or the grammar's mask where the reasoning
    lets it apply (never inside reasoning); None when the next token is free."""
    also: tuple[int, ...] = ()
    if reasoning is not None:
        forced = reasoning.forced_token()
        if forced is not None:
            return TokenRule(forced=forced)
        if not reasoning.grammar_applies():
            return None
        also = reasoning.also_allowed()
    return None if grammar is None else TokenRule(grammar, None, also)


def consume_answer(grammar: Optional[GrammarMatcher], reasoning, token: int) -> tuple[bool, Optional[str]]:
    """Advance a sequence's `grammar` by its next output `token` when the grammar sees it: always without
    `reasoning` (its `Sequence.reasoning`), with it only the answer's tokens, never the reasoning's or a marker's
    (`ReasoningState.grammar_consumes`, asked before the state is fed the token). (complete, error) as
    `GrammarMatcher.consume` says; (False, None) when there is no grammar or it does not see the token."""
    if grammar is None or (reasoning is not None and not reasoning.grammar_consumes(token)):
        return False, None
    return grammar.consume(token)


class Grammars:
    """An engine's constrained decoding (see the module docstring): the llguidance tokenizer, matchers, masks.

    `tokenizer`: the engine's mlx-lm `TokenizerWrapper` (or a Hugging Face fast tokenizer); `vocab_size`:
    the width of the model's logits; `eos_ids`: every EOS id of the model (each one ends a matched grammar).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer_source = tokenizer
        self.vocab_size, self.eos_ids = vocab_size, sorted(set(eos_ids))
        self._tokenizer: Optional[llguidance.LLTokenizer] = None
        self.num_constrained = 0  # requests that started a matcher
        self.mask_seconds = 0.0  # filling and unpacking masks, summed
        self.num_mask_rows = 0  # masks computed (one per constrained row of a sampling step)
        self.num_draft_mask_rows = 0  # of those, the extra ones of verify steps and drafters

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        """The llguidance tokenizer, built on first use (~0.3 s for a 50k vocabulary)."""
        if self._tokenizer is None:
            self._tokenizer = llguidance_tokenizer(self._tokenizer_source, self.vocab_size, self.eos_ids)
        return self._tokenizer

    def start(self, grammar: str, prefix: Seq[int] = ()) -> GrammarMatcher:
        """A fresh matcher for `grammar` (an llguidance grammar string) that has consumed `prefix` (output
        tokens generated before the request came here: `SamplingParams.grammar_prefix`). Raises GrammarError
        when the grammar does not compile or refuses the prefix."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError("the request's grammar (response_format / tool_choice) does not compile: "
                               + _short(matcher.get_error()))
        if prefix and not matcher.consume_tokens(list(prefix)):
            raise GrammarError("the output generated so far does not follow the request's grammar: "
                               + _short(matcher.get_error()))
        self.num_constrained += 1
        return GrammarMatcher(matcher, self.tokenizer)

    def masks(self, grammars: Seq[Optional[GrammarMatcher]]) -> Optional[mx.array]:
        """The next-token masks of a batch's rows (one `Sequence.grammar` or None each) as one bool [B, V]
        array (True = allowed): a constrained row's grammar mask, all True for a free row (so one `where` over
        the batch leaves free rows' logits as they are); None when no row is constrained."""
        return self.rule_masks([None if g is None else TokenRule(g) for g in grammars])

    def rule_masks(self, rules: Seq[Optional[TokenRule]]) -> Optional[mx.array]:
        """`masks` over each row's `TokenRule` (None: free): a forced row allows its one token, a grammar row its
        grammar's mask plus the rule's `also` tokens. bool [B, V]; None when every row is free."""
        rows = [b for b, r in enumerate(rules) if r is not None]
        if not rows:
            return None
        start = time.perf_counter()
        bitmask = llg_numpy.allocate_token_bitmask(len(rules), self.vocab_size)  # all allowed
        words = bitmask.view(np.uint32)
        for b in rows:
            rule = rules[b]
            if rule.forced is not None:
                bitmask[b] = 0
                words[b, rule.forced >> 5] = np.uint32(1 << (rule.forced & 31))
                continue
            if rule.grammar is None:
                continue
            matcher = rule.grammar.matcher
            llg_numpy.fill_next_token_bitmask(matcher, bitmask, b)
            if matcher.is_error():  # allow all: the token sampled is then refused by `consume`, naming the error
                bitmask[b] = -1
            for token in rule.also:
                words[b, token >> 5] |= np.uint32(1 << (token & 31))
        out = self.unpack(bitmask)
        self._count(start, len(rows), draft=False)
        return out

    def draft_masks(self, grammar: Optional[GrammarMatcher], draft: Seq[int]) -> Optional[mx.array]:
        """The masks at the k+1 positions of a verify step (row i: after the first i drafts), bool [k+1, V];
        None for a free row. The matcher advances through the drafts the grammar allows and is rolled back
        (the accepted tokens are consumed again as they are appended); rows after the first refused draft
        allow everything: that draft is rejected by its own row's mask, so they are never used."""
        if grammar is None:
            return None
        start = time.perf_counter()
        m = grammar.matcher
        bitmask = llg_numpy.allocate_token_bitmask(len(draft) + 1, self.vocab_size)  # all allowed
        n, rows = grammar.valid_prefix(draft), 0
        for i in range(n + 1):
            if m.is_stopped():  # past an EOS draft: the sequence finishes there, later rows are never used
                break
            llg_numpy.fill_next_token_bitmask(m, bitmask, i)
            rows += 1
            if i < n:
                m.consume_token(draft[i])
        m.rollback(n)
        mask = self.unpack(bitmask)
        self._count(start, rows, draft=True)
        return mask

    def verify_masks(self, grammar: Optional[GrammarMatcher], reasoning, draft: Seq[int]) -> Optional[mx.array]:
        """The masks at the k+1 positions of a verify step of a sequence with `grammar` and `reasoning` (its
        `Sequence.grammar` and `.reasoning`, either None), bool [k+1, V]; None when every position is free. With
        a grammar, its `draft_masks` (the scheduler drafts such a sequence only once its grammar governs every
        later token); else, with a reasoning budget, the end marker's forced token where a position is forced
        (`ReasoningState.forced_along`)."""
        if grammar is not None:
            rule = token_rule(grammar, reasoning)
            assert rule is not None and rule.forced is None and not rule.also, "drafts before the grammar governs"
            return self.draft_masks(grammar, draft)
        forced = reasoning.forced_along(draft) if reasoning is not None else None
        if forced is None or all(f is None for f in forced):
            return None
        return self.rule_masks([None if f is None else TokenRule(forced=f) for f in forced])

    def mask_after(self, grammar: Optional[GrammarMatcher], tokens: Seq[int]) -> Optional[mx.array]:
        """The mask after `tokens` more (a drafter's own tokens), bool [V]; None for a free row, or when the
        grammar refuses those tokens or is complete after them (nothing a verify step would accept follows)."""
        if grammar is None or grammar.valid_prefix(tokens) < len(tokens):
            return None
        start = time.perf_counter()
        m = grammar.matcher
        if tokens:
            m.consume_tokens(list(tokens))
        mask = None
        if not m.is_stopped():
            bitmask = llg_numpy.allocate_token_bitmask(1, self.vocab_size)
            llg_numpy.fill_next_token_bitmask(m, bitmask, 0)
            mask = self.unpack(bitmask)[0]
        m.rollback(len(tokens))
        self._count(start, 1, draft=True)
        return mask

    def unpack(self, bitmask: np.ndarray) -> mx.array:
        """int32 [R, W] llguidance bitmask -> bool [R, vocab_size] (bit t of word w allows token 32w + t).
        Unpacked on the host with NumPy (the words' little-endian bytes, least significant bit first) and copied
        into an mlx array: nothing is queued on MLX's stream, so the mask never waits behind the step's forward
        pass (an mlx-ops unpack evaluated there would, and was measured 3x slower on the CPU backend; the
        llguidance.mlx kernel is Metal-only)."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return mx.array(bits.view(np.bool_))

    def _count(self, start: float, rows: int, draft: bool) -> None:
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_rows += rows
        if draft:
            self.num_draft_mask_rows += rows

