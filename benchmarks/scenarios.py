"""The named workloads of `mlx-pd bench --workload`: what each measured request asks (no model, no network).

| name | each request | meant to hit the prefix cache? |
| --- | --- | --- |
| `chat` | one short user prompt from prompts.jsonl (~10-30 tokens), unique per request | no |
| `shared-prefix` | a tenant's system prompt (`system_tokens`, one of `tenants`, round robin) + a unique question | yes: the system prompts |
| `long-prompt` | a RAG-like document of `long_tokens` tokens (uniform in the range) + a question | no |
| `mixed` | each request drawn from the three above with weights `mix` (default 0.6 / 0.3 / 0.1) | the shared-prefix share |

**Uniqueness.** Every request carries its own ``[req xxxxxx]`` tag (6 random hex digits from the seed,
never repeated within a run) at the *start* of the part that is meant to be new: the user prompt (chat),
the question after the shared system prompt (shared-prefix), the document's first line (long-prompt). So
repeated base texts never turn the run into a cache benchmark, and shared-prefix shares exactly its system
prompts. ``shared_prefix=True`` (``--shared-prefix``) drops the tags on purpose.

Token counts here are estimates (:func:`benchmarks.workloads.approx_tokens`, ~1.3 per word) unless a
tokenizer's `count` is passed; the servers' `usage.prompt_tokens` says what was actually sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from benchmarks.loadgen import Prompt, load_prompts, make_prompts
from benchmarks.workloads import approx_tokens, system_prompt

WORKLOADS = ("chat", "shared-prefix", "long-prompt", "mixed")


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload and its sizes (see the module doc). Token sizes are estimates (see there)."""

    name: str = "chat"
    tenants: int = 4
    system_tokens: int = 512
    long_tokens: tuple[int, int] = (2048, 8192)
    mix: tuple[float, float, float] = (0.6, 0.3, 0.1)  # chat, shared-prefix, long-prompt

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is unknown; choose one of {', '.join(WORKLOADS)}")
        if self.tenants < 1 or self.system_tokens < 1:
            raise ValueError(f"tenants and system_tokens must be >= 1, got {self.tenants}, {self.system_tokens}")
        lo, hi = self.long_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"long_tokens must be a range 1 <= lo <= hi, got {self.long_tokens}")
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"mix must be three weights >= 0 (chat, shared-prefix, long-prompt), got {self.mix}")

    @property
    def hits_cache_by_design(self) -> bool:
        """True for the workloads whose requests share a prefix on purpose."""
        return self.name == "shared-prefix" or (self.name == "mixed" and self.mix[1] > 0)


def document(target_tokens: int, rng: random.Random, count_tokens: Callable[[str], int] = approx_tokens,
             base: Sequence[str] = ()) -> str:
    """A RAG-like context of about `target_tokens` tokens: numbered passages built from the prompt set."""
    pool = list(base or load_prompts())
    parts, n = [], 0
    words = 0
    while True:
        text = pool[rng.randrange(len(pool))]
        parts.append(f"Passage {n + 1} (source {rng.randint(100, 999)}): {text} The notes on this add "
                     f"{rng.randint(2, 40)} points, {rng.choice(['all', 'most', 'some'])} of them cited.\n")
        n += 1
        words += len(parts[-1].split())
        if words * 1.3 >= target_tokens and count_tokens("".join(parts)) >= target_tokens:
            return "".join(parts)


def build_workload(spec: WorkloadSpec, n: int, seed: int = 0, *, shared_prefix: bool = False, tag: str = "req",
                   count_tokens: Callable[[str], int] = approx_tokens) -> list[Prompt]:
    """`n` requests of `spec` (deterministic in spec, n, seed, tag); see the module doc."""
    rng = random.Random(f"{seed}:{spec.name}:{tag}")
    questions = make_prompts(n, seed, shared_prefix=shared_prefix, tag=tag)  # unique unless shared_prefix
    kinds = {"chat": ["chat"] * n, "shared-prefix": ["shared-prefix"] * n, "long-prompt": ["long-prompt"] * n}.get(
        spec.name) or rng.choices(["chat", "shared-prefix", "long-prompt"], weights=spec.mix, k=n)
    systems: dict[int, str] = {}
    out: list[Prompt] = []
    for i, (kind, question) in enumerate(zip(kinds, questions)):
        if kind == "chat":
            out.append(question)
        elif kind == "shared-prefix":
            t = i % spec.tenants
            if t not in systems:
                systems[t] = system_prompt(t, spec.system_tokens, count_tokens, tag=f"tenant {t}", seed=seed)
            out.append(({"role": "system", "content": systems[t]}, {"role": "user", "content": question}))
        else:
            target = rng.randint(*spec.long_tokens)
            head = question.split("] ", 1)[0] + "] " if question.startswith("[") else ""
            doc = document(target, rng, count_tokens)
            out.append(f"{head}Read the passages below, then answer.\n\n{doc}\nQuestion: "
                       f"{question[len(head):]}")
    return out

