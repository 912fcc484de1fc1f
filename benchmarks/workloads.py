"""Prefix-cache workloads and hit-rate arithmetic (no model, no network), for benchmarks/prefix_bench.py and
benchmarks/chat_prefix_bench.py.

The *ideal* hit is what a perfect cache could have served: for each request, the longest common token
prefix with what some other request had computed by the time this one was sent, capped at prompt - 1
(one prompt token is always computed); "block ideal" rounds that down to whole blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from benchmarks.loadgen import load_prompts, make_prompts



def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate (~1.3 tokens per English word), for tests and dry runs."""
    return max(1, round(len(text.split()) * 1.3))


def system_prompt(index: int, target_tokens: int, count_tokens: Callable[[str], int] = approx_tokens, *,
                  tag: str = "sys", seed: int = 0, base: Optional[Sequence[str]] = None) -> str:
    """A tenant's system prompt of at least `target_tokens` tokens (by `count_tokens`): a ``[tag]`` line,
    then numbered house rules built from the benchmark prompts. Deterministic in (index, tag, seed);
    two different tags differ from their first characters on."""
    rng = random.Random(f"{seed}:system:{index}")
    pool = list(base if base is not None else load_prompts())
    rng.shuffle(pool)
    parts = [f"[{tag}] You are the assistant of tenant {index}. Follow every house rule below.\n"]
    k = 0
    while count_tokens("".join(parts)) < target_tokens:
        parts.append(f"Rule {k + 1}: when a user asks \"{pool[k % len(pool)]}\", answer in at most "
                     f"{rng.randint(2, 9)} sentences and cite section {rng.randint(10, 99)}.{rng.randint(1, 9)}.\n")
        k += 1
    return "".join(parts)


@dataclass(frozen=True)
class Conversation:
    """One user's chat with one tenant: a system prompt and one question per turn."""

    user: int
    tenant: int
    system: str
    questions: tuple[str, ...]

    def key(self, turn: int) -> str:
        """The request key of `turn` (0-based), e.g. ``u3/t2`` for the second turn of user 3."""
        return f"u{self.user}/t{turn + 1}"

    def messages(self, turn: int, replies: Sequence[str] = ()) -> list[dict]:
        """Messages of `turn` (0-based): the system prompt, each earlier question with its reply, then this
        turn's question. `replies` holds the assistant's answers to the earlier turns."""
        if len(replies) < turn:
            raise ValueError(f"turn {turn + 1} needs the replies of the {turn} turns before it, got {len(replies)}")
        msgs = [{"role": "system", "content": self.system}]
        for t in range(turn):
            msgs += [{"role": "user", "content": self.questions[t]}, {"role": "assistant", "content": replies[t]}]
        msgs.append({"role": "user", "content": self.questions[turn]})
        return msgs


def build_conversations(num_users: int, systems: Sequence[str], turns: int = 2, seed: int = 0) -> list[Conversation]:
    """`num_users` conversations; user u talks to tenant u mod len(systems) with unique questions per turn
    (``[t1 xxxxxx] ...``, ``[t2 xxxxxx] ...``)."""
    if num_users < 1 or not systems or turns < 1:
        raise ValueError(f"need users >= 1, system prompts >= 1, turns >= 1; got {num_users}, {len(systems)}, {turns}")
    questions = [make_prompts(num_users, seed, tag=f"t{t + 1}") for t in range(turns)]
    return [Conversation(u, u % len(systems), systems[u % len(systems)], tuple(q[u] for q in questions))
            for u in range(num_users)]


# --- hit-rate arithmetic --------------------------------------------------------------------------------


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n


@dataclass
class Served:
    """What one request asked for and what its server computed, on the client's clock (seconds)."""

    start_s: float
    end_s: Optional[float]  # None: failed (computed nothing a cache may count on)
    prompt_ids: Sequence[int]
    computed_ids: Sequence[int]  # prompt + output tokens whose KV the server computed
    first_token_s: Optional[float] = None  # the whole prompt was computed by then

    def known_at(self, t: float) -> Sequence[int]:
        """The tokens whose KV this request had computed by time `t` (as far as the client can tell)."""
        if self.end_s is None:
            return ()
        if self.end_s <= t:
            return self.computed_ids
        if self.first_token_s is not None and self.first_token_s <= t:
            return self.prompt_ids
        return ()


def computed_ids(prompt_ids: Sequence[int], with_reply_ids: Sequence[int], output_tokens: int) -> list[int]:
    """Tokens whose KV a server computed for a request: the prompt and all but the last output token.
    `with_reply_ids` is the conversation rendered with the reply (as the next turn sends it)."""
    return list(with_reply_ids[:len(prompt_ids) + max(0, output_tokens - 1)])


def ideal_cached_tokens(served: Sequence[Served], block_size: int = 1) -> list[int]:
    """Per request: the prompt tokens a perfect cache could have served (see the module doc), rounded
    down to multiples of `block_size`: what other requests had computed when this one was sent."""
    out = []
    for r in served:
        best = 0
        for q in served:
            if q is not r:
                best = max(best, common_prefix_len(r.prompt_ids, q.known_at(r.start_s)))
        best = max(0, min(best, len(r.prompt_ids) - 1))
        out.append(best // block_size * block_size)
    return out


def hit_rates(prompt_tokens: Sequence[int], cached: Sequence[int], ideal: Sequence[int]) -> dict:
    """Sums and ratios: hit_rate = cached / prompt, ideal_rate = ideal / prompt, of_ideal = cached / ideal."""
    p, c, i = sum(prompt_tokens), sum(cached), sum(ideal)
    nan = float("nan")
    return {"prompt_tokens": p, "cached_tokens": c, "ideal_tokens": i, "hit_rate": c / p if p else nan,
            "ideal_rate": i / p if p else nan, "of_ideal": c / i if i else nan}


class ChatTokens:
    """Token ids of chat messages as the servers render them: the chat template, then encoded without
    special tokens (what router/tokenizer.py does; mlx_lm.server gives the same counts, checked per run)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ChatTokens":
        from cluster.model import load_tokenizer

        return cls(load_tokenizer(Path(model_dir)))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def render(self, messages: Sequence[dict], generation_prompt: bool = True) -> list[int]:
        text = self.tok.apply_chat_template(list(messages), add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))


