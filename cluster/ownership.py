"""The ownership rule for an engine's MLX state: one thread at a time, checked where the state is touched.

An engine's model calls, its KV arrays (and the NumPy views that read and write them for transfer) and its
block pool belong to one thread, the owner. MLX builds lazy graphs whose nodes are not safe to evaluate or
free from two threads at once, and the KV transfer writes into MLX buffers through NumPy views that are
valid only while no graph of another thread is using those buffers; so a second thread touching an engine is
a fault even when it happens to work. The rule is checked, not trusted: every entry point that touches the
state calls `ThreadOwner.check`, which raises `WrongThreadError` at once on any other thread (a few tens of
nanoseconds per call).

The thread that builds an engine owns it until a loop thread takes it over with `take()` (a worker's or the
single-node engine's loop does so as its first act); from then on the builder must not touch it. Other
threads reach the engine only through its loop (a command queue or a control message), never directly.
"""

from __future__ import annotations

import threading


class WrongThreadError(RuntimeError):
    """Engine state was touched from a thread that does not own it (a programming error, never a request's)."""


class ThreadOwner:
    """Records which thread owns a piece of state; `check()` raises `WrongThreadError` on any other thread."""

    def __init__(self, what: str):
        self.what = what
        self._ident = threading.get_ident()
        self._name = threading.current_thread().name

    def take(self) -> None:
        """Make the calling thread the owner (a loop thread taking over an engine built elsewhere)."""
        self._ident = threading.get_ident()
        self._name = threading.current_thread().name

    def check(self, action: str) -> None:
        """Raise `WrongThreadError` unless the calling thread owns the state; `action` names what was tried."""
        if threading.get_ident() != self._ident:
            raise WrongThreadError(
                f"{action} on thread {threading.current_thread().name!r}, but {self.what} is owned by thread "
                f"{self._name!r}: only the owner may touch it (send the work to its loop instead)")

    @property
    def thread_name(self) -> str:
        """The owner thread's name (for messages and tests)."""
        return self._name
