"""Helpers for speculative-decoding tests on the real SmolLM2 model (float32): engines with both drafters,
plain references, and a step loop that checks the KV counters after every step."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from cluster.request import GenerateRequest
from decode_node.drafters import DraftModelDrafter, PromptLookupDrafter
from decode_node.speculative import DecodeSpeculator
from tests.engine_helpers import Result, chat_prompt, greedy, make_engine, run

DRAFTERS = ("prompt_lookup", "draft_model")
# Prompts whose answers repeat their text (prompt lookup's strength) and ordinary ones.
REWRITE = ("Rewrite in plain English: The meeting has been postponed until next Tuesday at noon because "
           "the manager is travelling.")
REPEAT = "Repeat exactly: The cat sat on the mat."
TEXTS = (REWRITE, "Write a haiku about the sea.",
         "Copy this sentence exactly: I love green apples and red cherries.", "Name three colors.")


@functools.lru_cache(maxsize=1)
def draft_parts():
    """(model, tokenizer, spec) of the test draft model: the default model with its weights rounded through
    4-bit quantization (group 64) but kept float32 (`keep_float`): a draft that disagrees with the target
    now and then, at float speed (MLX's CPU backend runs real 4-bit matmuls slower)."""
    from cluster.gguf_import import ensure_default_model
    from cluster.model import load_draft_model

    return load_draft_model(str(ensure_default_model(progress=False)), "float32", 4, keep_float=True)


def speculative_engine(**config):
    """A fresh engine over the real model with both drafters. The draft model's cost is set low (0.05) so
    that its adaptive draft length stays above 0 here (its real CPU cost would turn it off)."""
    engine = make_engine(**config)
    engine.speculator = DecodeSpeculator({"prompt_lookup": PromptLookupDrafter(),
                                          "draft_model": DraftModelDrafter(*draft_parts(), engine, cost_per_token=0.05)},
                                         engine.config)
    return engine


@functools.lru_cache(maxsize=64)
def _plain(prompts: tuple, max_tokens: int, kwargs: tuple, config: tuple) -> tuple:
    reqs = [greedy(f"p{i}", p, max_tokens, **dict(kwargs)) for i, p in enumerate(prompts)]
    out = run(make_engine(**dict(config)), reqs)
    return tuple(out[f"p{i}"] for i in range(len(prompts)))


def plain(prompts, max_tokens: int, config: dict | None = None, **kwargs) -> list[Result]:
    """Plain greedy decoding of `prompts` in one batch (cached), one Result each."""
    return list(_plain(tuple(tuple(p) for p in prompts), max_tokens, tuple(sorted(kwargs.items())),
                       tuple(sorted((config or {}).items()))))


def speculative_greedy(rid: str, prompt, max_tokens: int, method: str, k: int, **kw) -> GenerateRequest:
    return greedy(rid, prompt, max_tokens, speculative_method=method, num_draft_tokens=k, **kw)


@dataclass
class SpeculativeResult(Result):
    """A Result plus, per delta, (tokens in it, drafts accepted in its step) and the sequence itself."""

    steps: list = field(default_factory=list)
    seq: object = None


def run_checked(engine, requests: list[GenerateRequest]) -> dict[str, SpeculativeResult]:
    """Add all requests, step until done, and after every step check each live decoding sequence's KV:

    - target: `num_computed_tokens == len(token_ids) - 1` (prompt + generated, less the newest token, which the
      next step feeds), i.e. rejected drafts were rolled back;
    - draft model, after a step that verified its draft: `num_draft_computed` equals that too, or is one less
      when every draft was accepted (the last draft token is fed to the draft model in the next step)."""
    results = {r.request_id: SpeculativeResult() for r in requests}
    for r in requests:
        out = engine.add_request(r)
        results[r.request_id].seq = engine.sequences.get(r.request_id)
        if out is not None:
            results[r.request_id].outputs.append(out)
    while engine.has_work():
        before = {rid: (res.seq.speculation.proposed_total, res.seq.speculation.accepted_total)
                  for rid, res in results.items() if res.seq is not None and res.seq.speculation is not None}
        for out in engine.step():
            res = results[out.request_id]
            res.add(out)
            accepted = res.seq.speculation.accepted_total - before[out.request_id][1] if out.request_id in before else 0
            res.steps.append((len(out.token_ids), accepted))
        for rid, (proposed, accepted) in before.items():
            seq = results[rid].seq
            if seq.finished or seq.is_prefilling:
                continue
            assert seq.num_computed_tokens == len(seq.token_ids) - 1, rid
            state = seq.speculation
            new_proposed, new_accepted = state.proposed_total - proposed, state.accepted_total - accepted
            if state.method == "draft_model" and new_proposed:
                full = new_accepted == new_proposed
                assert seq.num_draft_computed == seq.num_computed_tokens - (1 if full else 0), rid
    return results


def prompts(n: int = 4) -> list[list[int]]:
    return [chat_prompt(t) for t in TEXTS[:n]]
