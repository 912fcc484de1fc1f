"""DecodeWorker: receives KV blocks into its pool and runs the continuous batch.

A request reaches the decode worker in one of two ways (the router decides):

- `prefilled`: a prefill worker computes the prompt and ships its KV here. The router's `generate` and the
  transfer arrive in either order; the worker pairs them by request id. Once both are in, the sequence joins
  the running batch with the transferred blocks and the first token (already streamed by the prefill worker)
  and continues from the second token (`EngineCore.add_prefilled`).
- local: the prompt's uncached part is short (conditional disaggregation), so the decode worker prefills it
  itself with the ordinary engine path; no KV moves.

Pairing state is bounded: a request waiting for its KV holds no blocks, and fails once no transfer for it
has started within `TransferConfig.kv_start_deadline_s` (the prefill worker offers when it starts computing,
after at most its queue deadline, then retries "busy" answers up to its reserve deadline); a completed
transfer whose request has not arrived (or was aborted) holds its blocks for at most the transfer deadline,
then frees them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

from cluster.engine_client import EngineError
from cluster.protocol import Generate
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.worker import Worker
from decode_node.speculative import build_drafters
from kv_transfer.handshake import KVFormat
from kv_transfer.metrics import TransferMetrics
from kv_transfer.receiver import KVReceiver, ReceivedSequence, TransferFailed

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    """See the module docstring."""

    role = "decode"

    def _setup(self) -> Optional[str]:
        e = self.engine
        # speculative decoding: prompt lookup, plus a draft model when configured (its prompt KV is computed
        # here, since transfers carry target KV only: KVFormat.speculative_kv stays False)
        e.drafters.update(build_drafters(e, self.topology.model.source))
        fmt = KVFormat.of(e.spec, self.spec.engine)
        self.receiver = KVReceiver(fmt, e.pool, e.store, max_prompt_len=e.max_model_len, config=self.topology.transfer,
                                   host=self.spec.host, port=self.spec.kv_port, keys=self.keys, ctx=self.ctx,
                                   metrics=TransferMetrics("receive", self.registry))
        self.awaiting: dict[str, tuple[GenerateRequest, float]] = {}  # prefilled requests whose KV has not
        # arrived, with the deadline for their transfer to start (the slowest prefill worker's queue)
        queue_s = max((w.engine.queue_timeout_s for w in self.topology.workers if w.role == "prefill"),
                      default=self.spec.engine.queue_timeout_s)
        self.kv_start_deadline_s = self.topology.transfer.kv_start_deadline_s(queue_s)
        self.orphans: dict[str, tuple[ReceivedSequence, float]] = {}  # KV whose request has not arrived
        return self.receiver.endpoint

    def _on_generate(self, request: GenerateRequest, msg: Generate) -> None:
        if self.engine.scheduler.queue_full(pending=len(self.awaiting)):
            raise EngineError(f"the decode queue is full ({self.spec.engine.max_waiting} requests)", retry_after=1.0)
        if not msg.prefilled:
            out = self.engine.add_request(request)
            if out is not None:
                self.emit(out)
            return
        self.engine.check_request(request)  # a request that can never run here fails before any transfer
        # The prompt's logprobs were computed and sent by the prefill worker.
        request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, prompt_logprobs=None))
        orphan = self.orphans.pop(request.request_id, None)
        if orphan is not None:
            self._admit(request, orphan[0])
        else:
            self.awaiting[request.request_id] = (request, time.monotonic() + self.kv_start_deadline_s)

    def _on_abort(self, request_id: str) -> None:
        self.awaiting.pop(request_id, None)
        orphan = self.orphans.pop(request_id, None)
        if orphan is not None:
            self.engine.pool.free(orphan[0].block_table)
        self.receiver.abort(request_id, "the request was aborted")
        self.engine.abort(request_id)

    def _admit(self, request: GenerateRequest, got: ReceivedSequence) -> None:
        try:
            out = self.engine.add_prefilled(request, got.block_table, got.num_cached_tokens, got.first_token)
        except ValueError as exc:  # add_prefilled freed the blocks
            self.emit(RequestOutput(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc)))
            return
        if out is not None:
            self.emit(out)

    def _transfers_busy(self) -> bool:
        return bool(self.receiver.live or self.orphans)

    def _poll_transfers(self) -> None:
        for ev in self.receiver.poll(0.0):
            if isinstance(ev, ReceivedSequence):
                entry = self.awaiting.pop(ev.request_id, None)
                if entry is not None:
                    self._admit(entry[0], ev)
                else:
                    self.orphans[ev.request_id] = (ev, time.monotonic() + self.topology.transfer.timeout_s)
            elif isinstance(ev, TransferFailed) and ev.request_id in self.awaiting:
                del self.awaiting[ev.request_id]
                if ev.kind == "aborted":  # by the prefill worker, which tells the router why
                    self.routes.pop(ev.request_id, None)
                    continue
                self.emit(RequestOutput(ev.request_id, finish_reason=FinishReason.ERROR,
                                        error=f"KV transfer from the prefill worker failed ({ev.kind}): {ev.reason}"))
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self.orphans.items() if deadline < now]:
            self.engine.pool.free(self.orphans.pop(rid)[0].block_table)
        for rid in [rid for rid, (_, deadline) in self.awaiting.items()
                    if deadline < now and rid not in self.receiver.live]:
            del self.awaiting[rid]
            self.emit(RequestOutput(rid, finish_reason=FinishReason.ERROR,
                                    error="the KV transfer from the prefill worker never started (waited "
                                          f"{self.kv_start_deadline_s:g} s); retry the request"))

    def _role_stats(self) -> dict:
        m = self.receiver.metrics
        return {"transfers_inflight": len(self.receiver.live), "awaiting_kv": len(self.awaiting),
                "orphans": len(self.orphans), "kv_bytes_received": m.value("bytes_total"),
                "kv_blocks_received": m.value("blocks_total"), "transfer_timeouts": m.value("timeouts_total"),
                "reservations_busy": m.value("reservations_total", outcome="busy"),
                "spec_draft_tokens": self.engine.num_draft_tokens,
                "spec_accepted_tokens": self.engine.num_accepted_tokens}

    def _teardown(self) -> None:
        for got, _ in self.orphans.values():
            self.engine.pool.free(got.block_table)
        self.orphans.clear()
        self.receiver.close()
