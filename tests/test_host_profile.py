"""The host-profile benchmark's pure parts: reading py-spy's raw output, sorting sampled stacks into stages,
and the per-token arithmetic of its tables. No server and no py-spy run here."""

import math

import pytest

from benchmarks.host_profile import cpu_delta_s, stage_rows, summarize_profile, tally, thread_role, tokens_in_window
from benchmarks.host_stages import (COMPUTE, DETOK, HANDOFF, IDLE, MESSAGES, OTHER, READBACK, REQUEST, RUNNER, SCHEDULE,
                                    SSE, STAGES, UPDATE, Frame, classify, parse_raw)

ENGINE_ROOT = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982);_serve (cluster/owner_threads.py:76);" \
              "Worker._loop (cluster/worker.py:166)"
LOOP_ROOT = "<module> (cluster/launch/cli.py:377);Server.run (uvicorn/server.py:86);" \
            "BaseEventLoop.run_forever (asyncio/base_events.py:607)"


def stack(text: str) -> list[Frame]:
    return parse_raw(f"thread (1): t;{text} 1")[0].frames


def lines(mapping: dict):
    return lambda file, line: mapping.get((file, line))


def test_raw_lines_give_thread_id_name_frames_and_count():
    text = ("thread (31814): engine@127.0.0.1;Thread.run (threading.py:982);work (spytest.py:6) 118\n"
            "thread (0x1f): MainThread 2\n\nnot a sample line\n")
    samples = parse_raw(text)
    assert [(s.tid, s.thread, s.count) for s in samples] == [(31814, "engine@127.0.0.1", 118), (31, "MainThread", 2)]
    assert samples[0].frames == (Frame("Thread.run", "threading.py", 982), Frame("work", "spytest.py", 6))
    assert samples[1].frames == ()


def test_waiting_leaves_are_idle_whatever_runs_above_them():
    assert classify(stack(LOOP_ROOT + ";BaseEventLoop._run_once (asyncio/base_events.py:1884);"
                                      "EpollSelector.select (selectors.py:468)")) == IDLE
    assert classify(stack(ENGINE_ROOT + ";Worker._poll_control (cluster/worker.py:205);"
                                        "InProcessControl.poll (cluster/control.py:118)")) == IDLE
    assert classify(stack(ENGINE_ROOT + ";Worker._poll_control (cluster/worker.py:205);ZmqControl.poll "
                                        "(cluster/control.py:60);Socket.poll (zmq/sugar/socket.py:1000);"
                                        "Poller.poll (zmq/sugar/poll.py:106)")) == IDLE
    assert classify(stack("Thread.run (threading.py:982);_serve (cluster/owner_threads.py:69)")) == IDLE
    assert classify(stack("_worker (concurrent/futures/thread.py:81)")) == IDLE
    assert classify(stack("Thread._bootstrap (threading.py:1002);GarbageCollectorThread.run "
                          "(zmq/utils/garbage.py:56)")) == IDLE
    assert classify(stack("idle (x.py:10);Queue.get (queue.py:171);Condition.wait (threading.py:327)")) == IDLE


def test_mlx_calls_are_model_compute_and_list_reads_are_readback():
    forward = stack(ENGINE_ROOT + ";EngineCore.step (cluster/engine.py:221);ModelRunner.forward "
                                  "(cluster/runner.py:131);LlamaModel.__call__ (mlx_lm/models/llama.py:195);"
                                  "RMSNorm.__call__ (nn/layers/normalization.py:166)")
    assert classify(forward) == COMPUTE
    evals = stack(ENGINE_ROOT + ";ModelRunner.sample (cluster/runner.py:230);"
                                "ModelRunner._sample_on_device (cluster/runner.py:280)")
    text = lines({("cluster/runner.py", 280): "        mx.async_eval(tokens, *keys)"})
    assert classify(evals, text) == COMPUTE
    assert classify(evals) == RUNNER  # without the source line the runner's own code is all that is known
    resolve = stack(ENGINE_ROOT + ";EngineCore._execute (cluster/engine.py:242);EngineCore._resolve "
                                  "(cluster/engine.py:259)")
    assert classify(resolve, lines({("cluster/engine.py", 259): "tokens = inflight.tokens.tolist()"})) == READBACK
    assert classify(stack(ENGINE_ROOT + ";sample_tokens (cluster/sampling.py:144);"
                                        "adjust_logits (cluster/sampling.py:76)")) == COMPUTE


def test_the_innermost_project_frame_decides_for_helpers_without_a_rule():
    # KV-store work under the scheduler's prefill planning is scheduling ...
    sched = stack(ENGINE_ROOT + ";EngineCore.step (cluster/engine.py:217);Scheduler._schedule_prefill "
                                "(cluster/scheduler.py:345);PrefixMatcher.commit (cluster/prefix_match.py:78);"
                                "KVManager.commit (cluster/kv/manager.py:262)")
    assert classify(sched) == SCHEDULE
    # ... unless its leaf line evaluates arrays
    evaluated = stack(ENGINE_ROOT + ";Scheduler._schedule_prefill (cluster/scheduler.py:345);"
                                    "KVStore._evaluate (cluster/kv/store.py:144)")
    assert classify(evaluated, lines({("cluster/kv/store.py", 144): "        mx.eval(*arrays)"})) == COMPUTE
    # transformers' decode inside the detokenizer is detokenization, inside the scheduler's token append
    detok = stack(ENGINE_ROOT + ";Scheduler.resolve (cluster/scheduler.py:224);Scheduler._append_token "
                                "(cluster/scheduler.py:281);IncrementalDetokenizer._decode (cluster/detokenizer.py:63);"
                                "PreTrainedTokenizerBase.decode (transformers/tokenization_utils_base.py:2936)")
    assert classify(detok) == DETOK
    update = stack(ENGINE_ROOT + ";Scheduler.resolve (cluster/scheduler.py:224);_output (cluster/scheduler.py:398);"
                                 "__create_fn__.<locals>.__init__ (<string>:9)")
    assert classify(update) == UPDATE
    assert classify(stack(ENGINE_ROOT + ";ModelRunner.forward_step (cluster/runner.py:180);"
                                        "plan_row (cluster/runner.py:378)")) == RUNNER


def test_output_delivery_messages_handoff_and_sse():
    handoff = stack(ENGINE_ROOT + ";Worker.emit (cluster/worker.py:266);InProcessControl.send_output "
                                  "(cluster/control.py:129);InProcessControl._deliver (cluster/control.py:134);"
                                  "InProcessEngineClient.generate.<locals>.<lambda> (cluster/launch/single_node.py:46);"
                                  "BaseEventLoop.call_soon_threadsafe (asyncio/base_events.py:812)")
    assert classify(handoff) == HANDOFF
    zmq_out = stack(ENGINE_ROOT + ";Worker.emit (cluster/worker.py:266);ZmqControl.send_output "
                                  "(cluster/control.py:90);ZmqControl.send (cluster/control.py:84);"
                                  "pack (cluster/protocol.py:60);BaseModel.model_dump (pydantic/main.py:400)")
    assert classify(zmq_out) == MESSAGES
    router_in = stack(LOOP_ROOT + ";ClusterEngineClient._reader (router/cluster_client.py:282);"
                                  "unpack (cluster/protocol.py:70);unpackb (msgpack/fallback.py:100)")
    assert classify(router_in) == MESSAGES
    chunk = stack(LOOP_ROOT + ";StreamingResponse.stream_response (starlette/responses.py:255);_events "
                              "(router/serving.py:245);ChatFormatter.delta_chunk (router/openai/format.py:113);"
                              "BaseModel.__init__ (pydantic/main.py:280)")
    assert classify(chunk) == SSE
    waiting = stack(LOOP_ROOT + ";_events (router/serving.py:252);ChoiceStreams.next (router/streams.py:135);"
                                "wait_for (asyncio/tasks.py:466)")
    assert classify(waiting) == HANDOFF
    request = stack(LOOP_ROOT + ";serve (router/serving.py:150);RouterTokenizer.encode (router/tokenizer.py:200)")
    assert classify(request) == REQUEST


def test_stacks_without_project_frames_fall_back_to_their_library():
    assert classify(stack("RequestResponseCycle.send (uvicorn/protocols/http/h11_impl.py:512);"
                          "_SelectorSocketTransport.write (asyncio/selector_events.py:1057)")) == SSE
    through_middleware = stack("StreamingResponse.stream_response (starlette/responses.py:258);MetricsMiddleware."
                               "__call__.<locals>.send_wrapper (router/metrics.py:181);RequestResponseCycle.send "
                               "(uvicorn/protocols/http/h11_impl.py:499);_SelectorSocketTransport.write "
                               "(asyncio/selector_events.py:1057)")
    assert classify(through_middleware) == SSE
    assert classify(stack("SequenceTimer.observe (router/metrics.py:150);Histogram.observe "
                          "(prometheus_client/metrics.py:681)")) == OTHER
    assert classify(stack("H11Protocol.data_received (uvicorn/protocols/http/h11_impl.py:200)")) == REQUEST
    assert classify(stack(LOOP_ROOT + ";BaseEventLoop._run_once (asyncio/base_events.py:1922);"
                                      "Handle._run (asyncio/events.py:80)")) == HANDOFF
    assert classify(stack("<module> (spytest.py:12)")) == OTHER
    assert classify(()) == OTHER


def test_thread_roles_come_from_what_the_thread_runs():
    assert thread_role("engine@127.0.0.1", [stack(ENGINE_ROOT)]) == "engine loop"
    assert thread_role("MainThread", [stack(LOOP_ROOT + ";BaseEventLoop._run_once (asyncio/base_events.py:1)")]) \
        == "event loop"
    assert thread_role("tokenize_0", [stack("_worker (concurrent/futures/thread.py:81)")]) == "tokenizer pool"
    assert thread_role("MainThread", [stack("main (x.py:1)")]) == "MainThread"


RAW = "\n".join([
    f"thread (10): engine@w;{ENGINE_ROOT};ModelRunner.forward (cluster/runner.py:131);"
    "LlamaModel.__call__ (mlx_lm/models/llama.py:195) 300",
    f"thread (10): engine@w;{ENGINE_ROOT};Worker._poll_control (cluster/worker.py:205);"
    "InProcessControl.poll (cluster/control.py:118) 100",
    f"thread (10): engine@w;{ENGINE_ROOT};ModelRunner.forward_step (cluster/runner.py:180) 100",
    f"thread (11): MainThread;{LOOP_ROOT};BaseEventLoop._run_once (asyncio/base_events.py:1884);"
    "EpollSelector.select (selectors.py:468) 400",
    "thread (11): MainThread;RequestResponseCycle.send (uvicorn/protocols/http/h11_impl.py:512) 100",
])


def test_stage_arithmetic_adds_up_per_thread_and_per_token():
    threads = tally(parse_raw(RAW), "single")
    engine, loop = threads[10], threads[11]
    assert engine["role"] == "engine loop" and loop["role"] == "event loop"
    assert engine["stages"] == {COMPUTE: 300, IDLE: 100, RUNNER: 100}
    assert loop["stages"] == {IDLE: 400, SSE: 100}  # the partial stack still counts for its thread
    # 200 samples/s, 1000 tokens: one sample is 5 ms of thread time, 0.005 ms per token
    s = summarize_profile(list(threads.values()), rate=200, tokens=1000, cpu_ms={10: 0.4}, native_cpu_s=1.5,
                          zmq_cpu_s=0.0, floor_ms=1.0)
    assert set(s["stages"]) == set(STAGES)
    assert s["busy_samples"] == 500
    assert s["stages"][COMPUTE]["ms_per_token"] == pytest.approx(1.5)
    assert s["stages"][COMPUTE]["busy_share"] == pytest.approx(0.6)
    assert s["stages"][SSE]["busy_share"] == pytest.approx(0.2)
    assert sum(v["busy_share"] for v in s["stages"].values()) == pytest.approx(1.0)
    assert s["busy_ms_per_token"] == pytest.approx(2.5)
    assert s["busy_less_floor_ms_per_token"] == pytest.approx(1.5)
    assert s["native_cpu_ms_per_token"] == pytest.approx(1.5)
    assert s["waits"] == {"engine": {"single": pytest.approx(0.5)}, "event_loop": {"single": pytest.approx(2.0)}}
    for t in s["threads"]:
        assert t["busy"] + t["idle"] == t["samples"]
    by_tid = {t["tid"]: t for t in s["threads"]}
    assert by_tid[10]["busy_share"] == pytest.approx(0.8) and by_tid[10]["cpu_ms_per_token"] == 0.4
    assert math.isnan(by_tid[11]["cpu_ms_per_token"])
    rows = {r[0]: r for r in stage_rows(s)}
    assert rows[COMPUTE][1:] == ["1.500", "60.0%"]
    assert rows["busy less the floor"][1] == "1.500"
    assert rows["engine waits, single (idle, requests in flight)"][1] == "0.500"


def test_no_tokens_gives_nan_not_a_division_error():
    s = summarize_profile(list(tally(parse_raw(RAW), "p").values()), rate=200, tokens=0)
    assert math.isnan(s["busy_ms_per_token"]) and math.isnan(s["stages"][COMPUTE]["ms_per_token"])
    assert math.isnan(s["floor_ms_per_token"])


def test_tokens_in_the_window_count_chunk_arrivals_weighted_by_usage():
    records = [
        # chunks at 1.0, 1.5, 2.0, 2.5 s; 8 tokens in 4 chunks: 2 tokens a chunk
        {"start_s": 0.5, "ttft_s": 0.5, "itls_s": [0.5, 0.5, 0.5], "output_tokens": 8, "content_chunks": 4},
        # one chunk at 3.0 s, outside a window ending at 3.0
        {"start_s": 2.0, "ttft_s": 1.0, "itls_s": [], "output_tokens": 1, "content_chunks": 1},
        {"start_s": 0.0, "ttft_s": None, "itls_s": [], "output_tokens": 0, "content_chunks": 0, "error": "x"},
    ]
    assert tokens_in_window(records, 1.2, 3.0) == pytest.approx(6.0)
    assert tokens_in_window(records, 0.0, 10.0) == pytest.approx(9.0)


def test_cpu_delta_counts_new_threads_from_zero():
    before = {1: ("python", 100)}
    after = {1: ("python", 150), 2: ("ZMQbg/IO/0", 20)}
    assert cpu_delta_s(before, after, clk_tck=100) == {1: ("python", 0.5), 2: ("ZMQbg/IO/0", 0.2)}


def test_without_py_spy_the_run_stops_naming_the_install_command(monkeypatch, tmp_path):
    import argparse

    from benchmarks import host_profile

    monkeypatch.setattr(host_profile.shutil, "which", lambda name: None)
    monkeypatch.setattr(host_profile.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(RuntimeError, match="pip install py-spy"):
        host_profile.run(argparse.Namespace(layouts="single", concurrency="32"))
