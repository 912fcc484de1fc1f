"""PrefillWorker: chunked prefill with its own prefix cache, shipping KV blocks while it computes.

For each request the router names a decode worker (`decode_endpoint`, its KV socket). The engine runs the
prompt in `prefill_chunk_size` chunks with remote decode: the step that computes the last chunk samples the
first token (with the request's own sampling parameters, stops and logprobs), which this worker streams to
the router (that is the TTFT), and the decode worker continues from the second token. The transfer's whole
lifecycle, and this role's side of the engine seam, is `prefill_node/handoff.py`; this file is the wiring
between the worker loop, the engine and the sender.
"""

from __future__ import annotations

import logging
from typing import Optional

from cluster.protocol import Generate
from cluster.request import FinishReason, GenerateRequest, RequestOutput
from cluster.transport import check_endpoint
from cluster.worker import Worker
from kv_transfer.handshake import KVFormat
from kv_transfer.metrics import TransferMetrics
from kv_transfer.sender import KVSender
from prefill_node.handoff import HandoffState, PrefillHandoffs

logger = logging.getLogger(__name__)


class PrefillWorker(Worker):
    """See the module docstring."""

    role = "prefill"

    def _setup(self) -> Optional[str]:
        fmt = KVFormat.of_engine(self.engine)
        transfer = self.topology.transfer.for_prefill_worker(self.spec.engine.queue_timeout_s)
        self.sender = KVSender(fmt, self.engine.kv, config=transfer, keys=self.keys, ctx=self.ctx,
                               metrics=TransferMetrics("send", self.registry))
        self.handoffs = PrefillHandoffs(self.sender, self.engine.kv, release=self.engine.release,
                                        abort=self.engine.abort)
        self.engine.connector = self.handoffs
        return None

    def _on_generate(self, request: GenerateRequest, msg: Generate) -> None:
        if not msg.decode_endpoint:
            raise ValueError("a prefill worker needs decode_endpoint (the decode worker's KV socket)")
        check_endpoint(msg.decode_endpoint)  # ValueError (400) now, not when the transfer opens
        self._admit(request, remote_decode=True)
        out = self.engine.add_request(request, remote_decode=True)
        if out is not None:  # nothing to generate: no transfer either
            self.emit(out)
            return
        self.handoffs.add(request.request_id, msg.decode_endpoint)

    def _on_abort(self, request_id: str) -> None:
        self.handoffs.abort(request_id)

    def _transfers_busy(self) -> bool:
        return bool(self.sender.transfers)

    def _poll_transfers(self) -> None:
        for res in self.sender.poll(0.0):
            if not res.ok and res.request_id in self.routes:
                self.emit(RequestOutput(res.request_id, finish_reason=FinishReason.ABORT,  # the cluster's fault
                                        error=f"KV transfer to the decode worker failed ({res.kind}): {res.reason}"))

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        for out in self.handoffs.drain() + outputs:  # a failed transfer's error first: nothing after it goes out
            self.emit(out)
        self._poll_transfers()  # ship what this step made ready while the next one computes

    def _role_stats(self) -> dict:
        m = self.sender.metrics
        recent = sorted(self.handoffs.ttft_s)
        return {"transfers_inflight": len(self.sender.transfers),
                "handed_off": self.handoffs.count(HandoffState.HANDED_OFF),
                "transfers_pending": self.handoffs.count(HandoffState.PENDING),
                "kv_bytes_sent": m.value("bytes_total"), "kv_blocks_sent": m.value("blocks_total"),
                "transfer_timeouts": m.value("timeouts_total"),
                "ttft_p50_s": recent[len(recent) // 2] if recent else None}

    def _transfer_metrics(self):
        return self.sender.metrics

    def _teardown(self) -> None:
        self.sender.close()
