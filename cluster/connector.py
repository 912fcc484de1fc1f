"""The role seam: what the engine asks of, and tells, the role of the worker it runs in.

The engine is the same on every worker; a role (prefill_node/, decode_node/) differs in where a request's KV
comes from and where it goes. The seam is three calls, modelled on the scheduler side of vLLM v1's
`KVConnectorBase_V1` (`get_num_new_matched_tokens`; `request_finished`, "called exactly once when a request
has finished, before its blocks are freed", whose True return delays the free):

- `external_prefix(seq)`: for a sequence added with `remote_prefill`, is its prompt KV here yet? The role
  answers with the first token sampled where the prompt was computed; the KV itself is the holding of the
  request id in the engine's `KVManager` (reserved when the transfer was accepted). None: not yet, keep waiting.
- `on_computed(seqs)`: after each step, the sequences whose computed KV changed in it (their
  `num_computed_tokens` grew, or they were preempted: blocks freed, counters at 0). The role ships blocks that
  filled up.
- `request_finished(seq, reason)`: a sequence leaves the engine, finished for `reason`, or handed on after its
  first token (`reason` None) when it was added with `remote_decode`. True: the role still needs its blocks, which become a
  holding under its request id until the role calls `EngineCore.release`. False: they are freed now.

Per-request state that has to follow a request between roles and per-layer-kind state beside the KV blocks (e.g.
recurrent state) travel through the same calls: the role owns it, keyed by request id, and the engine never names
a role. A grammar's matcher does not travel: the request carries the grammar, and the engine replays the first
token into a fresh matcher as it adopts the prefix. Every call comes from the engine's owner thread, inside
`EngineCore.step` or `abort`, so a role must not call back into the engine from them; it records what to do and
acts after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence as Seq

from cluster.request import FinishReason
from cluster.sequence import Sequence


@dataclass(frozen=True)
class ExternalPrefix:
    """A prompt computed elsewhere: its KV (blocks and any state after the prompt) is the request's holding;
    `first_token` was sampled there; `block_hashes`: the chained hashes of the prompt's full blocks in this
    engine's format, under which the holding's blocks are registered in the prefix cache already."""

    first_token: int
    block_hashes: tuple[int, ...] = ()


class Connector(Protocol):
    """See the module docstring."""

    def external_prefix(self, seq: Sequence) -> Optional[ExternalPrefix]: ...

    def on_computed(self, seqs: Seq[Sequence]) -> None: ...

    def request_finished(self, seq: Sequence, reason: Optional[FinishReason]) -> bool: ...


class NoConnector:
    """The colocated engine's role: nothing comes from or goes to another worker."""

    def external_prefix(self, seq: Sequence) -> Optional[ExternalPrefix]:
        return None

    def on_computed(self, seqs: Seq[Sequence]) -> None:
        return None

    def request_finished(self, seq: Sequence, reason: Optional[FinishReason]) -> bool:
        return False
