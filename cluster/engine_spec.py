"""The engine's speculative-decoding steps: choosing, proposing and accepting drafts.

Speculation is "schedule k+1": the scheduler reserves blocks for a decoding sequence's draft length, the step
asks the sequence's drafter for up to k tokens, the runner feeds them after the last token with logits at
every position and verifies them, and the accepted tokens are appended one by one through the engine's
`_append_token` (so EOS, stop strings, max_tokens and logprobs end a sequence exactly where plain decoding
would; the rest of the accepted block is dropped). Rejected positions are rolled back by the counters alone:
`num_computed_tokens` ends at the accepted length (their KV slots are overwritten by later tokens, never
hashed or cached before that) and so does `num_draft_computed` (the draft model's KV). Blocks allocated for
rejected positions stay with the sequence and are freed with it.

`SpeculativeSteps` is mixed into EngineCore; it uses the engine's `config`, `drafters`, `scheduler`, the
counters `num_draft_tokens` / `num_accepted_tokens` and `_append_token`. The rules themselves (verification,
rejection sampling, draft lengths) are in cluster/speculation.py; the drafters in decode_node/speculative.py.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cluster.request import GenerateRequest, RequestOutput
from cluster.scheduler import ScheduledBatch
from cluster.sequence import Sequence
from cluster.speculation import Draft, SpecState, Verified


class SpeculativeSteps:
    """Choosing, proposing and accepting drafts for EngineCore (see cluster/engine.py's docstring)."""

    def _spec_state(self, request: GenerateRequest) -> Optional[SpecState]:
        """The request's speculation (its own choice, else the engine's default); None when it is off."""
        sp = request.sampling
        method = sp.speculative_method or self.config.speculative_method
        k = self.config.num_draft_tokens if sp.num_draft_tokens is None else sp.num_draft_tokens
        if method is None or k == 0 or method not in self.drafters:
            return None
        return SpecState(method, k)

    def _lookahead(self, seq: Sequence) -> int:
        """Draft tokens to reserve blocks for in this decode step (the scheduler asks once per step)."""
        drafter = self.drafters.get(seq.spec.method) if seq.spec is not None else None
        if drafter is None:
            return 0
        left = seq.max_tokens - seq.num_output_tokens - 1  # the corrected or bonus token comes on top
        return max(0, min(seq.spec.num_draft_tokens(drafter.cost_per_token), left))

    def _propose(self, batch: ScheduledBatch) -> dict[str, Draft]:
        """Drafts of the batch's speculating sequences (request id -> Draft), each drafter called once for its
        sequences."""
        by_method: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, n in batch.items:
            if n > 1 and seq.spec is not None:
                by_method.setdefault(seq.spec.method, []).append((seq, n))
        drafts = {}
        for method, items in by_method.items():
            proposed = self.drafters[method].propose([seq for seq, _ in items], [n - 1 for _, n in items])
            for (seq, n), draft in zip(items, proposed):
                assert len(draft.tokens) < n, "a drafter proposed more tokens than asked"
                if draft.tokens:
                    drafts[seq.request_id] = draft
        return drafts

    def _accept(self, seq: Sequence, draft: Draft, result: Verified) -> RequestOutput:
        """Append the verified tokens one by one, as plain decoding would (stopping at the first stop), and
        roll the counters back to what was accepted; returns one delta with all of them."""
        self.num_draft_tokens += len(draft.tokens)
        self.num_accepted_tokens += result.num_accepted
        seq.spec.update(len(draft.tokens), result.num_accepted)
        outs = []
        for token, logprob in zip(result.tokens, result.logprobs):
            seq.num_computed_tokens = len(seq.token_ids)  # every token before this one is in the KV now
            self.scheduler.cache_computed_blocks(seq)
            outs.append(self._append_token(seq, token, logprob))
            if outs[-1].finished:
                break
        seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        if len(outs) == 1:
            return outs[0]
        logprobs = None if outs[0].logprobs is None else tuple(lp for o in outs for lp in o.logprobs)
        return dataclasses.replace(outs[-1], token_ids=tuple(t for o in outs for t in o.token_ids),
                                   text="".join(o.text for o in outs), logprobs=logprobs,
                                   prompt_logprobs=outs[0].prompt_logprobs)
