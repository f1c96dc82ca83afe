"""The batch's way in and out (:class:`Membership`, which the scheduler thread owns):
admitted sequences get their id and cached prefix (a full hit's first token drawn at
once); sequences leave removed with their result (cells kept for the cache or cleared,
id and sampler freed, handed back), set aside by preemption, failed alone, or drained
at shutdown. The steps themselves — plan, decode, draw — are :class:`~._loop.Scheduler`'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from ..._core._exceptions import BackendError
from ._sequence import CANCELLED, Sequence, hand_back, hand_park

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._cache import CachePolicy
    from ._admission import Admission
    from ._capabilities import Capabilities
    from ._inbox import Inbox
    from ._kv import KvCells
    from ._model import LlamaModel
    from ._outputs import End, Outputs

__all__ = ["Membership", "failed"]

logger = logging.getLogger("trioserve.llama")


class Membership:
    """Sequences into and out of the batch, on the scheduler thread. Whatever fails
    there fails that sequence alone."""

    def __init__(
        self,
        model: LlamaModel,
        inbox: Inbox,
        kv: KvCells,
        policy: CachePolicy,
        admission: Admission,
        outputs: Outputs,
        capabilities: Capabilities,
    ) -> None:
        self._model = model
        self.inbox = inbox
        self.kv = kv
        self.policy = policy
        self.admission = admission
        self.outputs = outputs
        self.capabilities = capabilities
        #: a sequence ended since the heap was last trimmed (_memory.trim_heap, when idle)
        self.trim_due = False
        #: sequences set aside by preemption
        self.parks = 0
        #: a test seam (``LlamaBackend.inject_fault``): called before a sequence's
        #: cached prefix is prepared; what it raises fails that sequence alone
        self.prepare_fault: Callable[[], None] | None = None

    # ------------------------------------------------------------------- in

    def admit(self, groups: list[list[Sequence]]) -> None:
        """The groups taken out of the queue: each sequence its id, then its cached
        prefix (one that fails fails alone)."""
        admitted = self._assign(groups)
        for sequence in admitted:
            if sequence.result is None:  # (not failed at admission)
                self.contained(self._prepare, sequence, "preparing its cached prefix")

    def _assign(self, groups: list[list[Sequence]]) -> list[Sequence]:
        """Give each admitted sequence its id and cached prefix (the plan is made outside
        the lock: only this thread writes the cache's bookkeeping; the commit is under
        it). A sequence whose admission fails fails alone."""
        inbox = self.inbox
        admitted: list[Sequence] = []
        for members in groups:
            leader = members[0]
            for sequence in members:
                shares = (
                    sequence is not leader and self.capabilities.partial_removal and leader.result is None
                )
                if shares:
                    ok = self.contained(self.admission.assign_follower, sequence, "admission", leader)
                else:
                    ok = self.contained(self.admission.assign, sequence, "admission")
                with inbox.condition:
                    if ok:
                        inbox.active.append(sequence)
                    inbox.admitting.remove(sequence)
                if ok:
                    admitted.append(sequence)
        return admitted

    def _prepare(self, sequence: Sequence) -> None:
        if self.prepare_fault is not None:
            self.prepare_fault()
        if sequence.saved is not None:
            self.kv.unpark(sequence)  # a paused sequence resumes
            return
        self.kv.prepare(sequence)
        if sequence.cache.whole:
            self._whole_hit(sequence)

    def _whole_hit(self, sequence: Sequence) -> None:
        """A full hit: every prompt cell is there, and the logits its last piece gave;
        the first token is drawn from them now, no call (what a fresh evaluation's
        last piece would give: the same piece, the same row — docs/prompt-cache.md)."""
        row = self.kv.whole_row(sequence)
        if row is None:  # pragma: no cover - (a row is kept wherever a full hit is planned)
            # its cells or its row did not come through: it evaluates its last piece
            sequence.cache.whole = sequence.cache.row_kept = False
            if sequence.decoding:
                cut = self.policy.last_cut_before(sequence.cache.cuts, len(sequence.asked.prompt))
                self.kv.reuse(sequence, cut if self.kv.trim(sequence.seq_id, cut) == cut else 0)
            return
        sequence.out.first_chunk_at = time.perf_counter()
        sequence.progress.prefill_seconds = 0.0
        if sequence.asked.max_new <= 0:
            self.remove(sequence, "length")  # a prompt to evaluate only: it is cached
            return
        _, end = self.outputs.emit(sequence, 0, row)
        if end is not None:
            self.remove(sequence, end)

    # ------------------------------------------------------------------ out

    def park(self, sequence: Sequence) -> bool:
        """Preemption: set ``sequence`` aside between steps — its cells' state saved
        (the prompt and the reply so far, as computed), its cells cleared and its id
        freed; its sampler, drafter and pending token stay with it — and hand it back
        parked. A choice of ``n`` > 1 is never set aside (``declined``). True: its state was
        saved (the request it made room for is about to be submitted)."""
        inbox = self.inbox
        if sequence.group is not None or sequence.leader is not None or sequence.followers:
            with inbox.condition:
                sequence.pause_asked = False
            hand_park(sequence, "declined")
            return False
        started = time.perf_counter()
        try:
            state = self.kv.park(sequence) if sequence.pos > 0 else None
        except Exception:
            logger.exception("could not set a request aside; it goes on")
            with inbox.condition:
                sequence.pause_asked = False
            hand_park(sequence, "declined")
            return False
        self.kv.park_seconds += time.perf_counter() - started
        self.parks += 1
        with inbox.condition:
            sequence.pause_asked = False
            inbox.active.remove(sequence)
            inbox.cells.give_back(sequence.seq_id)
            sequence.seq_id = -1
            cancelled = sequence.cancelled
            if not cancelled:
                sequence.saved = state
                sequence.parked_out = True
        if cancelled:
            self.remove(sequence, CANCELLED)  # (its cells are gone already)
        else:
            hand_park(sequence, "parked")
        return True

    def contained(self, step: Any, sequence: Sequence, what: str, *args: Any) -> bool:
        """Run ``step(sequence, *args)``; if it raises, only ``sequence`` fails (its
        cells cleared, its request told why) and the server goes on."""
        try:
            step(sequence, *args)
        except Exception as exc:
            logger.exception("a request failed in the scheduler (%s); the others go on", what)
            if sequence.result is None:
                self.remove(sequence, failed(sequence, f"inference failed while {what}: {exc!r}"))
            return False
        return True

    def _release(self, sequence: Sequence, result: End) -> None:
        """Take ``sequence`` out of the context: keep the cells of its whole prompt
        chunks for the cache and clear the rest (the reply, a partial chunk), free its
        id and sampler. The caller hands it back to Trio."""
        self.trim_due = True
        if sequence in self.inbox.active:
            self.inbox.active.remove(sequence)
        for follower in sequence.followers:
            follower.leader = None  # its leader is gone before sharing: it evaluates the prompt itself
        sequence.followers = []
        if sequence.leader is not None and sequence in sequence.leader.followers:
            sequence.leader.followers.remove(sequence)
        if sequence.seq_id >= 0:
            finished = result == "stop" or result == "length"
            self.kv.keep(sequence, failed=isinstance(result, BaseException), finished=finished)
            self._free_id(sequence)
        if sequence.sampler is not None:
            self._model.lib.llama_sampler_free(sequence.sampler)
            sequence.sampler = None
        sequence.saved = None
        sequence.result = result
        sequence.progress.inference_ended = time.perf_counter()

    def _free_id(self, sequence: Sequence) -> None:
        if sequence.seq_id >= 0:
            with self.inbox.condition:
                self.inbox.cells.give_back(sequence.seq_id)
                sequence.seq_id = -1

    def remove(self, sequence: Sequence, result: End) -> None:
        try:
            self._release(sequence, result)
        except Exception:
            # the cache's bookkeeping failed (e.g. a MemoryError): this sequence's
            # cells are dropped and its id freed; the request still gets its result
            # (its text went out whole: only the cache lost it)
            logger.exception("could not keep a finished sequence's cells; they are dropped")
            if sequence in self.inbox.active:
                self.inbox.active.remove(sequence)
            if sequence.seq_id >= 0:
                try:
                    self.kv.forget(sequence.seq_id)
                finally:
                    self._free_id(sequence)
            if sequence.sampler is not None:
                self._model.lib.llama_sampler_free(sequence.sampler)
                sequence.sampler = None
            if sequence.result is None:
                sequence.result = result
            sequence.progress.inference_ended = time.perf_counter()
        finally:
            hand_back(sequence)  # its request must never wait forever

    def drain(self) -> None:
        """At the thread's exit: every sequence still in (running, queued, being
        admitted) removed with the thread's failure, or told the server is shutting
        down."""
        inbox = self.inbox
        failure = inbox.failure or BackendError("the server is shutting down")
        with inbox.condition:
            inbox.stopping = True  # nothing submitted from now on is left unserved
            leaving = inbox.active + list(inbox.queue)
            leaving += [s for s in inbox.admitting if s not in leaving and s.result is None]
            inbox.active = []
            inbox.queue.clear()
            inbox.admitting = []
        for sequence in leaving:
            try:
                self.remove(sequence, failure)
            except BaseException:  # pragma: no cover - remove hands back in any case
                logger.exception("could not release a sequence at shutdown")


def failed(sequence: Sequence, message: str) -> BackendError | Literal["cancelled"]:
    """The result of a sequence that failed: a cancelled one (its client left, a stop
    sequence matched) is reported cancelled — a cancel is never an error."""
    return CANCELLED if sequence.cancelled else BackendError(message)
