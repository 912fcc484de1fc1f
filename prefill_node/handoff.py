"""The prefill role's transfer lifecycle, one state machine per request, and its side of the role seam.

    PENDING ──(the engine computed its first chunk)──> OFFERED ──(first token sampled)──> HANDED_OFF
       │                                                  │                                   │
       └──────── finished here / aborted / the transfer ended ──────────> (gone) <────────────┘

- PENDING: queued on this worker; no transfer yet, so the request holds nothing on the decode worker and
  cannot run into its inactivity deadline while it waits here.
- OFFERED: the engine started computing the prompt; the transfer is open (`KVSender.open`) and every step
  reports how far the prompt is computed (`on_computed`), so full blocks ship while the next chunk computes.
- HANDED_OFF: the first token was sampled and did not end the request: the engine lets the sequence go and
  keeps its blocks as a holding (`request_finished` returns True); the sender finishes the transfer.
- gone: when the transfer ends on any path (`on_release`: the decode worker's ack, a refusal, an abort, a
  deadline) a HANDED_OFF request's holding is released, and an OFFERED one's computation is aborted. A
  request that finishes here (EOS, a stop or max_tokens at the first token, an error) aborts its transfer.

The engine calls `on_computed` and `request_finished` from inside its step; they only touch the sender and
record what the worker must do after the step (`drain`), never call back into the engine.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence as Seq

from cluster.connector import ExternalPrefix
from cluster.request import FinishReason, RequestOutput
from cluster.sequence import Sequence
from cluster.kv.manager import KVManager
from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)


class HandoffState(enum.Enum):
    PENDING = "pending"
    OFFERED = "offered"
    HANDED_OFF = "handed_off"


@dataclass
class _Handoff:
    endpoint: str  # the decode worker's KV socket
    state: HandoffState = HandoffState.PENDING


class PrefillHandoffs:
    """Every request of a prefill worker from admission until its transfer ends (see the module docstring).

    `sender` ships the KV; `release(request_id)` frees a handed-off request's holding and `abort(request_id)`
    stops one still computing (the engine's `release` / `abort`, called outside its step only).
    """

    def __init__(self, sender: KVSender, kv: KVManager, release: Callable[[str], object],
                 abort: Callable[[str], object]):
        self.sender, self.kv, self._release, self._abort = sender, kv, release, abort
        self.requests: dict[str, _Handoff] = {}
        self.ttft_s: deque[float] = deque(maxlen=256)  # arrival to first token out, the last 256 requests
        self._failed: list[RequestOutput] = []  # transfers that could not open, answered after the step

    # -- from the worker -----------------------------------------------------------------------------------

    def add(self, request_id: str, endpoint: str) -> None:
        """A request the engine just queued (with remote decode) whose KV goes to `endpoint`."""
        self.requests[request_id] = _Handoff(endpoint)

    def abort(self, request_id: str) -> None:
        """The router aborted the request: end its transfer (which stops or frees what the engine holds)."""
        h = self.requests.get(request_id)
        if h is None or h.state is HandoffState.PENDING:
            self.requests.pop(request_id, None)
            self._abort(request_id)  # a no-op when the engine does not know it
        else:
            self.sender.abort(request_id, "the request was aborted")  # -> _on_release

    def drain(self) -> list[RequestOutput]:
        """After a step: stop the computations whose transfer could not open; returns their error outputs."""
        failed, self._failed = self._failed, []
        for out in failed:
            self._abort(out.request_id)
        return failed

    def count(self, state: HandoffState) -> int:
        return sum(1 for h in self.requests.values() if h.state is state)

    # -- the role seam (cluster/connector.py), called from inside the engine's step ------------------------

    def external_prefix(self, seq: Sequence) -> Optional[ExternalPrefix]:
        return None  # every prompt is computed here

    def on_computed(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            h = self.requests.get(seq.request_id)
            if h is None:
                continue
            if h.state is HandoffState.PENDING and seq.num_computed_tokens > 0 and not self._open(seq, h):
                continue
            if h.state is HandoffState.OFFERED:  # also a preempted one: an empty table, 0 computed
                self.sender.blocks_ready(seq.request_id, self.kv.tables(seq.request_id), seq.num_computed_tokens)

    def request_finished(self, seq: Sequence, reason: Optional[FinishReason]) -> bool:
        rid = seq.request_id
        h = self.requests.get(rid)
        if h is None:
            return False
        if reason is not None:  # it ended here: no decode worker will continue it
            del self.requests[rid]
            if h.state is HandoffState.OFFERED:
                self.sender.abort(rid, f"the request finished on the prefill worker ({reason.value})")
            return False
        if h.state is HandoffState.PENDING and not self._open(seq, h):
            return False
        h.state = HandoffState.HANDED_OFF
        self.sender.blocks_ready(rid, self.kv.tables(rid), seq.num_computed_tokens)
        self.sender.finish(rid, seq.token_ids[-1], state=self.kv.shipped_state(rid))
        self.ttft_s.append(time.monotonic() - seq.arrival)
        return True  # the blocks stay until the transfer ends (_on_release)

    # -- internals -----------------------------------------------------------------------------------------

    def _open(self, seq: Sequence, h: _Handoff) -> bool:
        """Offer the transfer of `seq`; False (the request answered with an error after the step) if that fails."""
        rid = seq.request_id
        try:
            self.sender.open(rid, h.endpoint, seq.request.prompt_token_ids, seq.request.cache_salt,
                             on_release=lambda: self._on_release(rid), block_hashes=seq.token_block_hashes)
        except Exception as exc:  # must not escape into the engine step or the other sequences' outputs
            logger.exception("opening the KV transfer of %s failed", rid)
            del self.requests[rid]
            self._failed.append(RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                              error=f"could not start the KV transfer: {type(exc).__name__}: {exc}"))
            return False
        h.state = HandoffState.OFFERED
        return True

    def _on_release(self, request_id: str) -> None:
        """The transfer ended on any path (the sender calls this exactly once, never inside the engine's step
        for a request still tracked here)."""
        h = self.requests.pop(request_id, None)
        if h is None:
            return  # it finished here first; nothing is held for it
        if h.state is HandoffState.HANDED_OFF:
            self._release(request_id)
        else:
            self._abort(request_id)
