"""PrefillWorker: chunked prefill with its own prefix cache, shipping KV blocks while it computes.

For each request the router names a decode worker (`decode_endpoint`, its KV socket). The worker offers the
transfer once the engine starts computing the prompt (its first chunk, or the step that hands it over): a
request queued here holds no blocks on the decode worker and cannot run into the receiver's inactivity
deadline while it waits (the handshake still overlaps the rest of the computation). It runs the prompt
through the shared engine in `prefill_chunk_size` chunks, and after every step tells the sender how far each
prompt is computed, so the blocks that filled up go out while the next chunk computes. The step that computes the last chunk samples
the first token (with the request's own sampling parameters, stops and logprobs); the engine then hands the
sequence over (`EngineCore.handoff`): the worker streams that first token to the router (that is the TTFT)
and `finish`es the transfer; the decode worker continues from the second token. If the first token already
ends the request (EOS, a stop, max_tokens 1), the request finishes here and the transfer is aborted.

Blocks are freed exactly once, when the transfer ends on any path (`KVSender`'s `on_release`): after the
decode worker's ack, or on refusal, abort or deadline; full blocks stay in the prefix cache.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from cluster.engine_client import EngineError
from cluster.protocol import Generate
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.sequence import Sequence
from cluster.transport import check_endpoint
from cluster.worker import Worker
from kv_transfer.handshake import KVFormat
from kv_transfer.metrics import TransferMetrics
from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)


class PrefillWorker(Worker):
    """See the module docstring."""

    role = "prefill"

    def _setup(self) -> Optional[str]:
        self.engine.handoff = self._handoff
        fmt = KVFormat.of(self.engine.spec, self.spec.engine)
        transfer = self.topology.transfer.for_prefill_worker(self.spec.engine.queue_timeout_s)
        self.sender = KVSender(fmt, self.engine.store, config=transfer, keys=self.keys, ctx=self.ctx,
                               metrics=TransferMetrics("send", self.registry))
        self.handed_off: dict[str, Sequence] = {}
        self.pending: dict[str, str] = {}  # request id -> decode KV endpoint, until its computation starts
        self.ttft: list[float] = []
        return None

    def _on_generate(self, request: GenerateRequest, msg: Generate) -> None:
        if not msg.decode_endpoint:
            raise ValueError("a prefill worker needs decode_endpoint (the decode worker's KV socket)")
        check_endpoint(msg.decode_endpoint)  # ValueError (400) now, not when the transfer opens
        if self.engine.scheduler.queue_full():
            raise EngineError(f"the prefill queue is full ({self.spec.engine.max_waiting} requests)", retry_after=1.0)
        out = self.engine.add_request(request)
        if out is not None:  # nothing to generate: no transfer either
            self.emit(out)
            return
        self.pending[request.request_id] = msg.decode_endpoint

    def _open(self, seq: Sequence) -> bool:
        """Offer `seq`'s transfer if it is still pending (its computation has started). False when it has no
        transfer: opening failed (the request got an error output; the caller lets go of the sequence)."""
        rid = seq.request_id
        endpoint = self.pending.pop(rid, None)
        if endpoint is None:
            return rid in self.sender.transfers
        try:
            self.sender.open(rid, endpoint, seq.request.prompt_token_ids, seq.request.cache_salt,
                             on_release=lambda: self._release(rid))
        except Exception as exc:  # must not escape into the engine step or the other sequences' outputs
            logger.exception("%s: opening the KV transfer of %s failed", self.spec.actor_name, rid)
            self.emit(RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                    error=f"could not start the KV transfer: {type(exc).__name__}: {exc}"))
            return False
        return True

    def _on_abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        if not self.sender.abort(request_id, "the request was aborted"):
            self.engine.abort(request_id)

    def _handoff(self, seq: Sequence) -> None:
        if not self._open(seq):  # no transfer will ever release the blocks: the engine has let go, so do it here
            self.engine.pool.free(seq.block_table)
            seq.block_table = []
            return
        self.handed_off[seq.request_id] = seq
        self.sender.blocks_ready(seq.request_id, seq.block_table, seq.num_computed_tokens)
        self.sender.finish(seq.request_id, seq.token_ids[-1])
        self.ttft.append(time.monotonic() - seq.arrival)

    def _release(self, request_id: str) -> None:
        """The transfer ended: free the blocks (handed-off sequence) or stop the prefill still running."""
        seq = self.handed_off.pop(request_id, None)
        if seq is not None:
            self.engine.pool.free(seq.block_table)
            seq.block_table = []
        else:
            self.engine.abort(request_id)

    def _transfers_busy(self) -> bool:
        return bool(self.sender.transfers)

    def _poll_transfers(self) -> None:
        for res in self.sender.poll(0.0):
            if not res.ok and res.request_id in self.routes:
                self.emit(RequestOutput(res.request_id, finish_reason=FinishReason.ERROR,
                                        error=f"KV transfer to the decode worker failed ({res.kind}): {res.reason}"))

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        failed = []
        for seq in self.engine.sequences.values():  # progress, also of sequences preempted this step (0)
            if seq.num_computed_tokens > 0 and seq.request_id in self.pending and not self._open(seq):
                failed.append(seq.request_id)
            self.sender.blocks_ready(seq.request_id, seq.block_table, seq.num_computed_tokens)
        for rid in failed:
            self.engine.abort(rid)
        for out in outputs:
            self.emit(out)
            if out.finished:  # ended here (first token was the last, or an error): no transfer needed
                self.pending.pop(out.request_id, None)
                self.sender.abort(out.request_id, f"the request finished on the prefill worker ({out.finish_reason.value})")
        self._poll_transfers()  # ship what this step made ready while the next one computes

    def _role_stats(self) -> dict:
        m = self.sender.metrics
        recent = self.ttft[-256:]
        return {"transfers_inflight": len(self.sender.transfers), "handed_off": len(self.handed_off),
                "transfers_pending": len(self.pending),
                "kv_bytes_sent": m.value("bytes_total"), "kv_blocks_sent": m.value("blocks_total"),
                "transfer_timeouts": m.value("timeouts_total"),
                "ttft_p50_s": sorted(recent)[len(recent) // 2] if recent else None}

    def _teardown(self) -> None:
        self.sender.close()
