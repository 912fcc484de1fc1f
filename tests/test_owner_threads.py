"""Threads that ran MLX work are parked and reused, never ended, so MLX's thread-local teardown (which takes
the GIL) can never race the interpreter's finalization and abort the process on exit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from cluster.owner_threads import num_pooled_threads, start_owner_thread

# A worker-style run of a compiled MLX function on another thread, then an immediate exit: the shape of
# `mlx-pd generate`, which aborted with "terminate called without an active exception" in about one exit in
# four on a loaded machine while its loop ran on a plain thread.
_EXIT_AFTER_MLX_ON_A_THREAD = """
import mlx.core as mx
import mlx.nn as nn
from cluster.owner_threads import start_owner_thread

@mx.compile
def f(x):
    return nn.silu(x) * 2

def work():
    mx.eval(f(mx.ones((4, 4))))

start_owner_thread(work, "loop").join()
print("done")
"""


def test_a_finished_loop_leaves_its_thread_parked_and_the_next_run_reuses_it():
    idents = []

    def record():
        idents.append((threading.get_ident(), threading.current_thread().name))

    first = start_owner_thread(record, "first-loop")
    first.join(10)
    assert not first.is_alive()
    threads_after_first = num_pooled_threads()
    parked = [t for t in threading.enumerate() if t.ident == idents[0][0]]
    assert parked and parked[0].is_alive()  # the thread did not end with its loop
    second = start_owner_thread(record, "second-loop")
    second.join(10)
    assert num_pooled_threads() == threads_after_first
    assert idents[1] == (idents[0][0], "second-loop")  # the same thread, renamed for its run


def test_concurrent_loops_get_their_own_threads_and_a_raising_loop_parks_too():
    release = threading.Event()
    seen = []

    def wait_then_record():
        release.wait(10)
        seen.append(threading.get_ident())

    def fail():
        seen.append(threading.get_ident())
        raise RuntimeError("a loop that raises")

    a, b = start_owner_thread(wait_then_record, "a"), start_owner_thread(wait_then_record, "b")
    release.set()
    a.join(10), b.join(10)
    assert len(set(seen)) == 2
    c = start_owner_thread(fail, "c")
    c.join(10)
    assert not c.is_alive() and seen[-1] in seen[:2]  # it ran on a parked thread and ended its run
    d = start_owner_thread(lambda: seen.append(threading.get_ident()), "d")
    d.join(10)
    assert seen[-1] in seen[:2]


def test_exiting_right_after_an_mlx_loop_on_another_thread_never_aborts():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for _ in range(10):
        r = subprocess.run([sys.executable, "-c", _EXIT_AFTER_MLX_ON_A_THREAD], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "done", (r.returncode, r.stderr[-2000:])
