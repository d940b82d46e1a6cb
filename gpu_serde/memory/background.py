"""A daemon thread that a process starts on first use: the release thread of
:mod:`gpu_serde.memory.lifetime` and the note flusher of :mod:`gpu_serde.memory.broker.client`."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Background:
    """A named daemon thread that runs ``target``: :meth:`start` starts it when it is not running
    (once, when threads race), and again in a forked child after :meth:`forget`; never after
    :meth:`close` (the process exits)."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.name, self.target = name, target
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the thread unless it is running or :meth:`close` was called."""
        if self.running() is None and not self._closed:
            with self._lock:
                if self.running() is None and not self._closed:
                    # noted before it starts: a start that a signal interrupts is not repeated
                    self._thread = threading.Thread(target=self.target, name=self.name, daemon=True)
                    self._thread.start()

    def running(self) -> threading.Thread | None:
        """The thread, while it runs."""
        thread = self._thread
        return thread if thread is not None and thread.is_alive() else None

    def close(self) -> threading.Thread | None:
        """The process exits: the thread is not started again (a daemon thread must not call the
        driver while the interpreter is torn down). Returns the running one, which ends by its
        own rule (a start that raced with this has finished starting it)."""
        with self._lock:
            self._closed = True
            return self.running()

    def forget(self) -> None:
        """In a forked child: its parent's thread did not come along (and its lock may have been
        held by another of the parent's threads at the fork)."""
        self._thread, self._lock, self._closed = None, threading.Lock(), False
