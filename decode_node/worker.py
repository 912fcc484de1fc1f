"""DecodeWorker: receives KV blocks into its pool and runs the continuous batch.

A request reaches the decode worker in one of two ways (the router decides):

- prefilled: a prefill worker computes the prompt and ships its KV here; the router's `generate` and the
  transfer arrive in either order and are paired by `decode_node/admission.py` (this role's side of the engine
  seam); the sequence then joins the running batch with the transferred blocks and the first token (already
  streamed by the prefill worker) and continues from the second token.
- local: the prompt's uncached part is short (conditional disaggregation), so the decode worker prefills it
  itself with the ordinary engine path; no KV moves.

A decode worker without a `kv_port` receives no KV and runs every request locally: that is single-node mode
(cluster/launch/single_node.py, over an in-process control channel).

This file is the wiring between the worker loop, the engine, the receiver and the admissions.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from cluster.protocol import Generate
from cluster.request import GenerateRequest
from cluster.worker import Worker
from decode_node.admission import DecodeAdmissions
from decode_node.drafters import build_drafters
from decode_node.speculative import DecodeSpeculator
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
        # here, since transfers carry target KV only: KVFormat.speculative_kv stays False); an engine built
        # with its speculator keeps it. A model with recurrent layers gets none unless configured (then the
        # engine refuses it by name: a recurrent state cannot be rolled back past rejected drafts)
        configured = e.config.speculative_method is not None or e.config.uses_draft_model
        if not e.speculator.methods and (configured or not e.runner.verified.num_state_layers):
            e.speculator = DecodeSpeculator(build_drafters(e, self.topology.model.source), e.config)
        self.receiver: Optional[KVReceiver] = None
        self.admissions: Optional[DecodeAdmissions] = None
        if self.spec.kv_port is None:
            return None  # single-node: nothing arrives from a prefill worker
        fmt = KVFormat.of_engine(e)
        self.receiver = KVReceiver(fmt, e.kv, max_prompt_len=e.max_model_len, config=self.topology.transfer,
                                   host=self.spec.host, port=self.spec.kv_port, keys=self.keys, ctx=self.ctx,
                                   metrics=TransferMetrics("receive", self.registry))
        # a prefilled request waits for its transfer to start as long as the slowest prefill worker's queue
        queue_s = max((w.engine.queue_timeout_s for w in self.topology.workers if w.role == "prefill"),
                      default=self.spec.engine.queue_timeout_s)
        self.admissions = DecodeAdmissions(e, lambda rid: rid in self.receiver.live,
                                           kv_start_deadline_s=self.topology.transfer.kv_start_deadline_s(queue_s),
                                           orphan_timeout_s=self.topology.transfer.timeout_s)
        e.connector = self.admissions
        return self.receiver.endpoint

    def _on_generate(self, request: GenerateRequest, msg: Generate) -> None:
        self._admit(request)
        if not msg.prefilled:
            out = self.engine.add_request(request)
            if out is not None:
                self.emit(out)
            return
        if self.admissions is None:
            raise ValueError("this worker receives no KV (it has no kv_port): send the request without prefilled")
        # The prompt's logprobs were computed and sent by the prefill worker.
        out = self.admissions.add(dataclasses.replace(
            request, sampling=dataclasses.replace(request.sampling, prompt_logprobs=None)))
        if out is not None:
            self.emit(out)

    def _on_abort(self, request_id: str) -> None:
        if self.admissions is None:
            self.engine.abort(request_id)
            return
        self.receiver.abort(request_id, "the request was aborted")  # first: it stops writing into the blocks
        self.admissions.abort(request_id)

    def _transfers_busy(self) -> bool:
        return self.receiver is not None and bool(self.receiver.live or self.admissions.orphans)

    def _poll_transfers(self) -> None:
        if self.receiver is None:
            return
        for ev in self.receiver.poll(0.0):
            if isinstance(ev, ReceivedSequence):
                self.admissions.on_received(ev)
            elif isinstance(ev, TransferFailed):
                if ev.kind == "aborted" and ev.request_id in self.admissions.awaiting:
                    self.routes.pop(ev.request_id, None)  # the prefill worker tells the router why
                out = self.admissions.on_failed(ev)
                if out is not None:
                    self.emit(out)
        for out in self.admissions.expire():
            self.emit(out)

    def _role_stats(self) -> dict:
        s = self.engine.speculator
        drafts = {"num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens}
        if self.receiver is None:
            return drafts
        m = self.receiver.metrics
        return {**drafts, "transfers_inflight": len(self.receiver.live), "awaiting_kv": len(self.admissions.awaiting),
                "orphans": len(self.admissions.orphans), "kv_bytes_received": m.value("bytes_total"),
                "kv_blocks_received": m.value("blocks_total"), "transfer_timeouts": m.value("timeouts_total"),
                "reservations_busy": m.value("reservations_total", outcome="busy")}

    def _transfer_metrics(self):
        return None if self.receiver is None else self.receiver.metrics

    def _teardown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.admissions.close()
