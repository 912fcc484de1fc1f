"""The role seam (cluster/connector.py) from both sides: the engine's calls into a role, and the decode role's
pairing of requests with their KV (decode_node/admission.py) in every order, with its deadlines."""

from __future__ import annotations

from cluster.connector import NoConnector
from cluster.request import FinishReason
from decode_node.admission import DecodeAdmissions
from kv_transfer.receiver import ReceivedSequence, TransferFailed
from tests.engine_helpers import chat_prompt, greedy, make_engine


class KeepsBlocksForTransfer(NoConnector):
    """A prefill-like role: every sequence handed on after its first token keeps its blocks."""

    def __init__(self):
        self.finished: list[tuple[str, object]] = []
        self.computed: list[tuple[str, int]] = []

    def on_computed(self, seqs):
        self.computed += [(s.request_id, s.num_computed_tokens) for s in seqs]

    def request_finished(self, seq, reason):
        self.finished.append((seq.request_id, reason))
        return reason is None


def test_remote_decode_hands_a_sequence_on_after_its_first_token_and_keeps_its_blocks_until_released():
    engine = make_engine(prefill_chunk_size=8)
    role = KeepsBlocksForTransfer()
    engine.connector = role
    free0 = engine.pool.num_free_blocks
    prompt = chat_prompt("Name a colour.")
    assert engine.add_request(greedy("p", prompt, 8), remote_decode=True) is None
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert [len(o.token_ids) for o in outputs if o.token_ids] == [1]  # only the first token is computed here
    assert outputs[-1].finish_reason is None  # it goes on elsewhere
    assert role.finished == [("p", None)]  # exactly once, as it left
    # every chunk before the last was reported as computed, in order; the last one came with request_finished
    assert [n for _, n in role.computed] == list(range(8, len(prompt), 8))
    held = engine.kv.held("p")
    assert held is not None and len(held.block_table) == -(-len(prompt) // engine.block_size)
    assert engine.pool.num_free_blocks == free0 - len(held.block_table) and "p" not in engine.sequences
    assert engine.release("p") and engine.pool.num_free_blocks == free0 and not engine.release("p")


def test_a_sequence_that_finishes_at_its_first_token_is_freed_at_once():
    engine = make_engine()
    role = KeepsBlocksForTransfer()
    engine.connector = role
    free0 = engine.pool.num_free_blocks
    engine.add_request(greedy("p", chat_prompt("Say yes."), 1), remote_decode=True)
    while engine.has_work():
        engine.step()
    assert role.finished == [("p", FinishReason.LENGTH)] and engine.kv.held("p") is None
    assert engine.pool.num_free_blocks == free0


class FakeEngine:
    """What DecodeAdmissions calls: add_request, abort, release (recorded)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.refuse = False

    def add_request(self, request, remote_prefill=False):
        self.calls.append(("add", request.request_id, remote_prefill))
        if self.refuse:
            raise ValueError("too long")
        return None

    def abort(self, rid):
        self.calls.append(("abort", rid))

    def release(self, rid):
        self.calls.append(("release", rid))
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def admissions(live=()):
    engine, clock = FakeEngine(), Clock()
    return DecodeAdmissions(engine, lambda rid: rid in live, kv_start_deadline_s=10, orphan_timeout_s=5,
                            clock=clock), engine, clock


def received(rid, first=42):
    return ReceivedSequence(rid, [1, 2, 3], [1], 0, first, None, None)


class Seq:
    def __init__(self, rid):
        self.request_id, self.block_table = rid, []


def request(rid):
    return greedy(rid, [1, 2, 3], 4)


def test_request_first_then_its_kv_is_ready_with_the_first_token():
    a, engine, _ = admissions()
    a.add(request("r"))
    assert engine.calls == [("add", "r", True)] and a.external_prefix(Seq("r")) is None and "r" in a.awaiting
    a.on_received(received("r", first=7))
    assert a.external_prefix(Seq("r")).first_token == 7 and not a.awaiting and not a.orphans


def test_kv_first_waits_as_an_orphan_until_its_request_arrives():
    a, engine, _ = admissions()
    a.on_received(received("r", first=9))
    assert "r" in a.orphans
    a.add(request("r"))
    assert not a.orphans and not a.awaiting and a.external_prefix(Seq("r")).first_token == 9


def test_an_orphan_past_its_deadline_is_released():
    a, engine, clock = admissions()
    a.on_received(received("r"))
    clock.now += 4
    assert a.expire() == [] and engine.calls == []
    clock.now += 2
    assert a.expire() == [] and engine.calls == [("release", "r")] and not a.orphans
    assert a.external_prefix(Seq("r")) is None


def test_a_request_whose_transfer_never_starts_fails_after_its_deadline_unless_one_is_live():
    a, engine, clock = admissions(live={"busy"})
    a.add(request("r"))
    a.add(request("busy"))
    clock.now += 11
    failed = a.expire()
    # the cluster's fault, not the request's: `abort`, which the router answers with a 503 and Retry-After
    assert [o.request_id for o in failed] == ["r"] and failed[0].finish_reason is FinishReason.ABORT
    assert "never started" in failed[0].error and ("abort", "r") in engine.calls
    assert "busy" in a.awaiting  # its transfer is under way: the receiver's own deadline governs it


def test_a_failed_transfer_fails_its_request_unless_the_sender_aborted_it():
    a, engine, _ = admissions()
    a.add(request("r"))
    a.add(request("s"))
    out = a.on_failed(TransferFailed("r", "timeout", "no message for 20 s"))
    assert out.finish_reason is FinishReason.ABORT and "timeout" in out.error and ("abort", "r") in engine.calls
    assert a.on_failed(TransferFailed("s", "aborted", "the sender aborted")) is None and not a.awaiting
    assert a.on_failed(TransferFailed("unknown", "timeout", "")) is None


def test_a_refused_request_lets_its_orphaned_kv_go():
    a, engine, _ = admissions()
    a.on_received(received("r"))
    engine.refuse = True
    try:
        a.add(request("r"))
    except ValueError:
        pass
    else:
        raise AssertionError("the engine's refusal must reach the caller")
    assert ("release", "r") in engine.calls and not a.orphans and a.external_prefix(Seq("r")) is None


def test_abort_stops_the_request_and_releases_kv_it_never_adopted():
    a, engine, _ = admissions()
    a.add(request("r"))
    a.on_received(received("r"))
    a.abort("r")
    assert engine.calls[-2:] == [("abort", "r"), ("release", "r")] and not a.awaiting
    assert a.external_prefix(Seq("r")) is None
