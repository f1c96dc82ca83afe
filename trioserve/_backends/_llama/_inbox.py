"""The state the Trio side and the scheduler thread share, under one lock, and the
Trio side's calls on it: submit a sequence, cancel it, wake the loop, stop it, and ask
what the call in flight does for a generation.

Written by the Trio side: the queue (``submit``), a sequence's ``cancelled`` and
``force_asked`` (``force``), the abort flag (``cancel``, ``wake``). Everything else is
the thread's; the Trio side reads it under the lock."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from ..._core._backend import ControlOutcome, GenerationProgress
from ..._core._exceptions import BackendError
from ._cells import Cells
from ._sequence import Sequence

__all__ = ["Inbox"]


class Inbox:
    """Between ``generate`` (Trio) and the loop (its thread)."""

    def __init__(self, *, slots: int, abort_flag: Any, partial_removal: bool) -> None:
        self.condition = threading.Condition()
        #: submitted, not yet admitted
        self.queue: deque[Sequence] = deque()
        #: admitted: they hold ids and cells
        self.active: list[Sequence] = []
        #: out of the queue, not yet active: being given their ids and cached prefixes
        self.admitting: list[Sequence] = []
        self.cells = Cells(slots)
        self.abort_flag = abort_flag
        self.partial_removal = partial_removal
        #: the sequences of the llama_decode call in flight, with their rows
        self.in_flight: dict[Sequence, int] = {}
        self.in_flight_tokens = 0
        #: the idle recompute's call is in flight, completing these tokens (prefix included)
        self.idle_in_flight = False
        self.idle_tokens: list[int] = []
        self.idle_salt = ""
        self.stopping = False
        #: why the thread stopped serving, if it failed
        self.failure: BaseException | None = None
        #: the loop, run by the thread the first submit starts
        self.target: Callable[[], None] | None = None
        self.thread: threading.Thread | None = None

    def submit(self, sequence: Sequence) -> None:
        with self.condition:  # (the thread sets failure and stopping under this lock)
            if self.failure is not None:
                raise BackendError(f"the batch scheduler has failed: {self.failure}")
            if self.stopping:
                raise BackendError("the backend is closed")
            if self.thread is None:
                self.thread = threading.Thread(target=self.target, name="trioserve-batch", daemon=True)
                self.thread.start()
            self.queue.append(sequence)
            if self.idle_in_flight and not self._continues_idle_work(sequence):
                self.abort_flag.value = 1  # idle work never delays a request
            self.condition.notify()

    def _continues_idle_work(self, sequence: Sequence) -> bool:
        """Whether ``sequence``'s prompt starts with the piece being recomputed (the next
        turn of that conversation, sent at once): that call is the request's own first
        piece, so it goes on instead of being aborted and evaluated again. (Under the
        lock; only while nothing else is queued.)"""
        tokens = self.idle_tokens
        prompt = sequence.asked.prompt
        return (
            len(self.queue) == 1
            and sequence.asked.cache_prompt
            and sequence.asked.salt == self.idle_salt
            and len(prompt) > len(tokens)
            and prompt[: len(tokens)] == tokens
        )

    def cancel(self, sequence: Sequence) -> None:
        """Ask the loop to drop ``sequence``; abort the call in flight if most of its
        work is for cancelled sequences."""
        with self.condition:
            sequence.cancelled = True
            if self.idle_in_flight:
                self.abort_flag.value = 1
            if sequence in self.in_flight:
                wasted = sum(n for s, n in self.in_flight.items() if s.cancelled)
                # (without partial removal, the survivors of an aborted call could not
                # be rolled back: abort only a call that is all waste)
                needed = (
                    self.in_flight_tokens if not self.partial_removal else (self.in_flight_tokens + 1) // 2
                )
                if wasted >= needed:
                    self.abort_flag.value = 1
            self.condition.notify()

    def pause(self, sequence: Sequence) -> None:
        """Ask the loop to set ``sequence`` aside at its next step (preemption): its
        state saved, its id freed; it is handed back with ``park`` set."""
        with self.condition:
            if sequence.result is None:
                # (parked and about to resume: it is set aside again from the queue)
                sequence.pause_asked = True
                if self.idle_in_flight or sequence in self.in_flight:
                    # the better-ranked request should not wait for this call: it is
                    # rolled back and made again by those that stay
                    self.abort_flag.value = 1
                self.condition.notify()

    def force(self, sequence: Sequence) -> ControlOutcome:
        """Ask the loop to end ``sequence``'s reasoning: at its next draw it takes the
        end marker's tokens instead of drawing (``Outputs.emit``). The thread decides
        there, from the text so far, what to write: a marker the model wrote itself in
        the meantime is never followed by a second one."""
        with self.condition:
            if sequence.result is not None:
                return "finished"
            tracker = sequence.reasoning
            if tracker is None:
                return "not_reasoning"
            if sequence.force_asked or sequence.forced:
                return "forced"  # (being written already)
            if tracker.state == "answer":
                return "already_ended"
            sequence.force_asked = True
            return "forced"

    def resume(self, sequence: Sequence) -> None:
        """Give a parked ``sequence`` back to the loop: it is admitted before the queue
        (it held its slot first) and goes on from its saved state."""
        with self.condition:
            if self.failure is not None:
                raise BackendError(f"the batch scheduler has failed: {self.failure}")
            if self.stopping:
                raise BackendError("the backend is closed")
            sequence.parked_out = False
            sequence.park = None
            self.queue.appendleft(sequence)  # (asked to pause meanwhile: set aside again)
            if self.idle_in_flight:
                self.abort_flag.value = 1  # idle work never delays a request
            self.condition.notify()

    def withdraw(self, sequence: Sequence) -> bool:
        """The request of ``sequence`` ends before the scheduler handed it back: if it is
        parked, it is the caller's to free (``True``); otherwise it is cancelled in the
        loop (``False``: wait for it to be handed back)."""
        with self.condition:
            if sequence.parked_out:
                sequence.parked_out = False
                return True
        self.cancel(sequence)
        return False

    def wake(self) -> None:
        with self.condition:
            if self.idle_in_flight:
                self.abort_flag.value = 1  # a paused stream may run again
            self.condition.notify()

    def stop(self) -> threading.Thread | None:
        with self.condition:
            self.stopping = True
            self.abort_flag.value = 1
            self.condition.notify()
        return self.thread

    def in_flight_phase(self, progress: GenerationProgress) -> Literal["prefill", "decode"] | None:
        """What the ``llama_decode`` call running now does for the generation whose
        counters are ``progress``."""
        for sequence in list(self.in_flight):
            if sequence.progress is progress:
                return "decode" if sequence.decoding else "prefill"
        return None

    def rows_in_flight(self, progress: GenerationProgress) -> int:
        """The rows of the call running now that belong to the generation whose counters
        are ``progress`` (a speculative verify call: more than one while decoding); 0 if
        it has none in flight."""
        with self.condition:
            for sequence, rows in self.in_flight.items():
                if sequence.progress is progress:
                    return rows
        return 0

    def runnable(self) -> bool:
        """Whether the loop has work: a cancel to carry out, an admission, a prompt to
        evaluate, a stream with room in its channel. (Called under the lock.)"""
        if any(s.cancelled for s in self.queue) or self.next_admission() is not None:
            return True
        if any(s.pause_asked and s.group is None for s in self.queue):
            return True
        for sequence in self.active:
            if sequence.cancelled or sequence.pause_asked:
                return True
            if not sequence.decoding and sequence.leader is None:
                return True
            if sequence.decoding and sequence.channel.room > 0:
                return True
        return False

    def next_admission(self, free: int | None = None) -> list[Sequence] | None:
        """The sequences admissible now, in order: the queue's head, or — for a group
        (``n`` > 1) — all its choices, once they have all arrived and as many ids are
        free (``free``: the ids not yet promised). (Called under the lock.)"""
        if free is None:
            free = len(self.cells)
        if not self.queue or not free:
            return None
        head = self.queue[0]
        group = head.group
        if group is None:
            return [head]
        members = sorted((s for s in self.queue if s.group is group), key=_choice)
        if len(members) < group.size or len(members) > free:
            return None  # the others are being submitted, or ids are still busy
        return members


def _choice(sequence: Sequence) -> int:
    return sequence.choice
