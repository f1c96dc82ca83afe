"""The cores' turns: a model's generation scheduler and its embedding context (or a
rerank context) each take a turn for every ``llama_decode`` call, in the order they
asked, so the contexts — each sized to every core — never run at once (llama.cpp's
threads spin while they wait for each other: two contexts on the same cores slow both).
A waiting call leaves when its abort flag is raised (docs/embeddings.md, "Admission,
limits and the cores"). Threads only: no llama.cpp, no Trio."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["CpuTurns"]


class CpuTurns:
    """Turns on the cores, one ``llama_decode`` call at a time, first asked first served.

    A model's generation scheduler and its embedding context are each sized to every
    core; taking a turn per call keeps them from running at once. Fairness comes from
    the queue: a holder that asks again while the other waits goes behind it, so a
    busy scheduler and an embedding request alternate call by call. Thread-safe.
    """

    __slots__ = ("_condition", "_held", "_waiting", "waits")

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._held = False
        self._waiting: deque[object] = deque()
        #: calls that had to wait for another's turn (tests and /health)
        self.waits = 0

    def acquire(self, abort: Callable[[], object] | None = None) -> bool:
        """Wait for the turn (blocking); ``False`` if ``abort()`` turned true first
        (:meth:`wake` makes a waiter look again)."""
        with self._condition:
            if not self._held and not self._waiting:
                self._held = True
                return True
            me = object()
            self._waiting.append(me)
            self.waits += 1
            while True:
                if not self._held and self._waiting[0] is me:
                    self._waiting.popleft()
                    self._held = True
                    return True
                if abort is not None and abort():
                    self._waiting.remove(me)
                    self._condition.notify_all()  # the next in line may go now
                    return False
                self._condition.wait()

    def release(self) -> None:
        with self._condition:
            self._held = False
            self._condition.notify_all()

    def wake(self) -> None:
        """Make the waiters check their ``abort`` again (after raising an abort flag)."""
        with self._condition:
            self._condition.notify_all()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for the block (the generation scheduler's calls: no abort
        while waiting; a cancel raised meanwhile stops its call at once)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()
