"""The decode role's admission of prefilled requests, and its side of the role seam.

A prefilled request reaches the decode worker twice: the router's `generate` (the request) and the prefill
worker's KV transfer (its prompt's KV and first token), in either order. They are paired by request id:

    request first:  AWAITING (in the engine, with remote prefill; holds no blocks) ──KV arrives──> READY
    KV first:       ORPHAN (the transfer's blocks held under the request id)    ──request arrives──> READY
    READY:          the engine's next step asks `external_prefix`, adopts the holding as the sequence's block
                    table and decodes from the second token

Each waiting state has a deadline, so nothing waits forever: an AWAITING request fails once no transfer for it
has started within `kv_start_deadline_s` (the prefill worker offers when it starts computing, after at most
its queue deadline, then retries "busy" answers up to its reserve deadline); an ORPHAN's blocks are released
after `orphan_timeout_s` (the transfer deadline). The engine frees blocks; this class only says, by request
id, when a holding is no longer needed (`release`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence as Seq

from cluster.connector import ExternalPrefix
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.sequence import Sequence
from kv_transfer.receiver import ReceivedSequence, TransferFailed


class DecodeAdmissions:
    """See the module docstring. `engine` is the worker's `EngineCore`; `transfer_live(request_id)` says
    whether the receiver is still receiving that request's KV. Call everything from the engine's thread."""

    def __init__(self, engine, transfer_live: Callable[[str], bool], kv_start_deadline_s: float,
                 orphan_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.engine, self.transfer_live, self.clock = engine, transfer_live, clock
        self.kv_start_deadline_s, self.orphan_timeout_s = kv_start_deadline_s, orphan_timeout_s
        self.awaiting: dict[str, float] = {}  # request here, KV not yet: the deadline for its transfer to start
        self.orphans: dict[str, float] = {}  # KV here, request not: when its holding is released
        self.arrived: dict[str, ReceivedSequence] = {}  # KV here (held), until the sequence leaves the engine

    # -- from the worker -----------------------------------------------------------------------------------

    def add(self, request: GenerateRequest) -> Optional[RequestOutput]:
        """A prefilled request from the router. Returns its final output at once when it asks for nothing
        more; raises ValueError (nothing kept) when it can never run here."""
        rid = request.request_id
        try:
            out = self.engine.add_request(request, remote_prefill=True)
        except ValueError:
            self._drop_orphan(rid)  # its KV came first: let it go too
            raise
        if out is not None:
            self._drop_orphan(rid)
        elif self.orphans.pop(rid, None) is None:
            self.awaiting[rid] = self.clock() + self.kv_start_deadline_s
        return out

    def _drop_orphan(self, request_id: str) -> None:
        if self.orphans.pop(request_id, None) is not None:
            self.arrived.pop(request_id, None)
            self.engine.release(request_id)

    def on_received(self, got: ReceivedSequence) -> None:
        """A transfer completed: its blocks are held under the request id."""
        self.arrived[got.request_id] = got
        if self.awaiting.pop(got.request_id, None) is None:
            self.orphans[got.request_id] = self.clock() + self.orphan_timeout_s

    def on_failed(self, failed: TransferFailed) -> Optional[RequestOutput]:
        """A transfer ended without the KV (the receiver released its blocks). Returns the error output for a
        request that was waiting for it (None when the prefill worker aborted it: it tells the router why)."""
        if self.awaiting.pop(failed.request_id, None) is None:
            return None
        self.engine.abort(failed.request_id)
        if failed.kind == "aborted":
            return None
        return RequestOutput(failed.request_id, finish_reason=FinishReason.ABORT,  # the cluster's fault: 503
                             error=f"KV transfer from the prefill worker failed ({failed.kind}): {failed.reason}")

    def abort(self, request_id: str) -> None:
        """The router aborted the request (the receiver's live transfer, if any, is aborted first)."""
        self.awaiting.pop(request_id, None)
        self.orphans.pop(request_id, None)
        self.engine.abort(request_id)
        self.arrived.pop(request_id, None)
        self.engine.release(request_id)  # its KV if it arrived and was not adopted (else a no-op)

    def expire(self) -> list[RequestOutput]:
        """Release orphans past their deadline; fail requests whose transfer never started. Returns the
        failed requests' error outputs."""
        now = self.clock()
        for rid in [rid for rid, deadline in self.orphans.items() if deadline < now]:
            self._drop_orphan(rid)
        failed = []
        for rid in [rid for rid, deadline in self.awaiting.items() if deadline < now and not self.transfer_live(rid)]:
            del self.awaiting[rid]
            self.engine.abort(rid)
            failed.append(RequestOutput(rid, finish_reason=FinishReason.ABORT,  # the cluster's fault: 503
                                        error="the KV transfer from the prefill worker never started (waited "
                                              f"{self.kv_start_deadline_s:g} s); retry the request"))
        return failed

    def close(self) -> None:
        """Release every orphan (the worker is stopping)."""
        for rid in list(self.orphans):
            self._drop_orphan(rid)

    # -- the role seam (cluster/connector.py), called from inside the engine's step ------------------------

    def external_prefix(self, seq: Sequence) -> Optional[ExternalPrefix]:
        got = self.arrived.get(seq.request_id)
        return None if got is None else ExternalPrefix(got.first_token, got.block_hashes)

    def on_computed(self, seqs: Seq[Sequence]) -> None:
        return None

    def request_finished(self, seq: Sequence, reason: Optional[FinishReason]) -> bool:
        self.arrived.pop(seq.request_id, None)  # a holding it never adopted is released by whoever ended it
        self.awaiting.pop(seq.request_id, None)
        return False
