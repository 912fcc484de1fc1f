"""The verdict logic of the lab's fault table (benchmarks/lab/faults.py), on hand-made request records: what counts
as a complete answer, and which errors a client may see (the lab itself runs in `python -m benchmarks.lab.faults`,
not here)."""

from __future__ import annotations

from benchmarks.lab.fault_client import complete, new_record
from benchmarks.lab.faults import errors_row, render_markdown


def _rec(**kw) -> dict:
    rec = new_record("t", 16, True, 0.0)
    rec.update(kw)
    return rec


def test_complete_needs_every_token_and_no_error():
    assert complete(_rec(status=200, tokens=16, finish="length"))
    assert not complete(_rec(status=200, tokens=15, finish="length"))  # a token lost
    assert not complete(_rec(status=200, tokens=16, finish="length", errors=[{"code": "engine_overloaded"}]))
    assert not complete(_rec(status=503, retry_after="5"))


def test_errors_row_accepts_503_with_retry_after_and_sse_error_events_only():
    fine = [_rec(status=200, tokens=16, finish="length"), _rec(status=503, retry_after="3"),
            _rec(status=200, chunks=4, errors=[{"code": "engine_overloaded", "message": "aborted"}])]
    row = errors_row(fine)
    assert row["verdict"] == "pass" and "1 got 503 with Retry-After, 1 streams ended with an SSE error" in row["happened"]
    for bad in (_rec(status=500), _rec(status=503), _rec(exception="RemoteProtocolError: closed"),
                _rec(status=200, errors=[{"code": "engine_error", "message": "boom"}]),
                _rec(exception="no end within 26 s (hang)")):
        assert errors_row(fine + [bad])["verdict"] == "FAIL", bad


def test_markdown_table_escapes_pipes():
    result = {"command": "python -m benchmarks.lab.faults", "machine": "m", "date": "d", "wall_s": 90.0,
              "lab_up_s": 30.0, "rows": [{"row": "a", "fault": "x | y", "must": "m", "happened": "h",
                                          "verdict": "pass"}]}
    text = render_markdown(result)
    assert "1.5 min" in text and "| a | x \\| y | m | h | **pass** |" in text
