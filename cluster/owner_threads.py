"""Threads that run MLX work never exit: an engine's loop runs on a pooled thread that is parked, not ended.

A thread that has run MLX work holds MLX thread-local state (its default stream, its `mx.compile` cache),
and that state is torn down by C++ thread-local destructors after the Python thread has finished, which is
after `Thread.join()` has returned. The compile cache's teardown drops Python objects, so it takes the GIL;
when the main thread has meanwhile begun finalizing the interpreter, taking the GIL ends the thread with a
forced unwind through a `noexcept` destructor, and the process aborts with `terminate called without an
active exception` (rc 134), after the work itself succeeded. It happened to `mlx-pd generate` on exit in
3 of 10 runs on a loaded machine (seen in a core dump: `__call_tls_dtors` -> `~CompileCache` ->
`PyGILState_Ensure` -> `pthread_exit`).

So a loop thread is never let end: when its loop returns, the thread parks itself here and the next
`start_owner_thread` reuses it. Parked threads are daemons blocked on a queue without the GIL; at process
exit they are stopped without running their thread-local destructors. The pool holds as many threads as
ever ran at once (one per engine in a process: one in single-node mode, a few in the in-process cluster
tests).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_parked: list["queue.SimpleQueue"] = []  # the job queues of parked threads
_num_threads = 0


class OwnerThread:
    """A handle on one run of `target` on a pooled thread, shaped like the parts of `threading.Thread` a worker
    uses: `join(timeout)`, `is_alive()`, `name`."""

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait (at most `timeout` seconds; None = no limit) for the run to end."""
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        """True while `target` runs."""
        return not self._done.is_set()


def start_owner_thread(target: Callable[[], None], name: str) -> OwnerThread:
    """Run `target()` on a parked pool thread (a new daemon thread when none is parked), renamed `name` for
    the run; returns its handle. An exception from `target` is logged, and the thread parks as after a return."""
    global _num_threads
    handle = OwnerThread(name)
    with _lock:
        if _parked:
            jobs = _parked.pop()
        else:
            jobs = queue.SimpleQueue()
            _num_threads += 1
            threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True).start()
    jobs.put((target, handle))
    return handle


def num_pooled_threads() -> int:
    """How many pool threads exist (running or parked); for tests and diagnostics."""
    return _num_threads


def _serve(jobs: "queue.SimpleQueue") -> None:
    while True:
        target, handle = jobs.get()
        threading.current_thread().name = handle.name
        try:
            target()
        except BaseException:
            logger.exception("%s: the loop raised", handle.name)
        finally:
            threading.current_thread().name = "parked-owner-thread"
            with _lock:
                _parked.append(jobs)
            handle._done.set()
