"""The scheduler thread (:class:`Scheduler`): admits, plans, decodes, samples, removes.

It makes every llama.cpp call on the serving context and, with its
:class:`~._membership.Membership` (the batch's way in and out: admission, removal,
preemption), is the only place that hands a sequence back to its request
(:func:`~._sequence.hand_back`). Each step it describes the running sequences to the
planner (:func:`~._planner.plan_step` → a plan), has the executor run each planned call
(→ an outcome), and acts on the outcome: draws (:class:`~._outputs.Outputs`), rolls back
an aborted call, shares a leader's prompt, releases what ended (:class:`~._kv.KvCells`).
The prompt cache's decisions are :class:`~.._cache._cache_policy.CachePolicy`'s.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..._core._exceptions import BackendError
from .._cache import CachePolicy, WindowMarks, trim_heap
from .._decoding import logits_row
from ._adapters import AdapterSet
from ._admission import Admission
from ._capabilities import measure
from ._choices import share_prompt
from ._context import Context
from ._disk import open_disk_tier
from ._executor import Executor
from ._idle import IdleRecompute
from ._inbox import Inbox
from ._kv import KvCells
from ._membership import Membership, failed
from ._outputs import Outputs
from ._planner import Candidate, Limits, plan_step
from ._sequence import CANCELLED, Sequence, hand_park
from ._tiers import host_tier

if TYPE_CHECKING:
    from .._cache import HostCache
    from ._executor import Turns
    from ._model import LlamaModel

__all__ = ["Scheduler"]

logger = logging.getLogger("trioserve.llama")

#: after setting a sequence aside, how long the loop waits for the request it made
#: room for before the next step (a condition wait: submit wakes it)
_HANDOFF_SECONDS = 0.010


class Scheduler:
    """The thread that owns the context. The Trio side talks to it through
    :attr:`inbox` only."""

    def __init__(self, model: LlamaModel, host_cache: HostCache | None, turns: Turns) -> None:
        settings = model.settings
        lib = model.lib
        self._model = model
        self.context = context = Context(model, sequences=settings.slots)
        try:
            self.capabilities = caps = measure(model, context)
        except BaseException:
            context.free(lib)
            raise
        self.chunk = settings.prefill_chunk  # (the longest piece of the cut's shallow part)
        self.cache_enabled = settings.prompt_cache and caps.partial_removal
        #: ``fast`` mode: keep and reuse every computed cell (the reply too, any matching
        #: length), as llama-server does — not exact (docs/prompt-cache.md)
        self.fast = settings.cache_mode == "fast"
        #: prefixes evicted from KV cells, in host memory (``--cache-ram``), indexed by
        #: the rule's cuts, or (fast) every token
        self.host = host_tier(
            host_cache,
            rule="token" if self.fast else model.piece_rule.key,
            budget=settings.cache_ram_bytes,
            enabled=self.cache_enabled,
            window=max(0, int(lib.llama_model_n_swa(model.model))),
            kv_types=settings.kv_types,
        )
        if self.cache_enabled:
            #: the disk tier under it (``cache_dir``): states that outlive the process
            try:
                self.host.disk, self.host.disk_off = open_disk_tier(
                    model, rule="token" if self.fast else model.piece_rule.key, window=self.host.window
                )
            except BaseException:
                context.free(lib)
                raise
        #: the prompt cache (docs/prompt-cache.md): what each sequence id keeps, and the
        #: decisions made on it, are the policy's; the cells and llama.cpp calls are the
        #: KvCells'. Idle recompute: a finished conversation's pieces past its cached
        #: prompt are evaluated while nothing else runs (the policy remembers them)
        self.policy = CachePolicy(
            settings.slots,
            rule=model.piece_rule,
            host=self.host,
            enabled=self.cache_enabled,
            fast=self.fast,
            idle_recompute=self.cache_enabled and settings.idle_recompute and not self.fast,
            marks=WindowMarks(
                settings.slots,
                # (checkpoints of the window cells: only where they are not all kept)
                keep=settings.ctx_checkpoints
                if self.cache_enabled and self.host.window and not settings.swa_full
                else 0,
                step=max(1024, 2 * self.host.window),
            ),
        )
        self.inbox = Inbox(
            slots=settings.slots, abort_flag=context.abort_flag, partial_removal=caps.partial_removal
        )
        self.inbox.target = self._run
        self.kv = KvCells(model, context.ctx, context.memory, host=self.host, policy=self.policy)
        self.admission = Admission(self.inbox, self.policy, model.piece_rule)
        self.executor = Executor(model, context, turns)
        self.executor.pad_context = caps.pad_context
        self.outputs = Outputs(model, context.ctx, context.memory, caps)
        self.outputs.rewind = self.kv.trim
        self.idle = IdleRecompute(self.inbox, self.policy, self.kv, self.executor)
        self.limits = Limits(
            max_call_width=caps.max_call_width,
            shared_context_limit=caps.shared_context_limit if settings.batch_invariant else None,
            speculate=caps.verify_width > 1,
        )
        #: the batch's way in and out: admission, removal, preemption (its methods
        #: bound here once: the step's calls to them stay direct)
        self.membership = membership = Membership(
            model, self.inbox, self.kv, self.policy, self.admission, self.outputs, caps
        )
        self._remove = membership.remove
        self._park = membership.park
        self.heap_trims = 0
        #: a sequence was set aside this step (the request it made room for is about
        #: to be submitted)
        self._handoff = False
        self.steps = 0
        self.aborted_calls = 0

    # ------------------------------------------------------- scheduler thread

    def _run(self) -> None:
        inbox = self.inbox
        membership = self.membership
        try:
            while True:
                if membership.trim_due and not inbox.active and not inbox.queue:
                    # idle after sequences ended: the freed pages of every malloc arena
                    # go back to the system (_memory.py), never on the per-token path
                    membership.trim_due = False
                    trim_heap()
                    self.heap_trims += 1
                with inbox.condition:
                    while not inbox.stopping and not inbox.runnable():
                        if (
                            not inbox.active
                            and not inbox.queue
                            and (self.policy.pending or self.kv.persist_pending(inbox.cells.free) is not None)
                        ):
                            # no request at all (a paused stream counts: its client
                            # reads on): recompute a finished reply, then write the
                            # cached prefixes to the disk tier
                            break
                        inbox.condition.wait()
                    if inbox.stopping:
                        break
                    if self._handoff and not inbox.queue:
                        # a sequence was just set aside for a better-ranked request:
                        # its submission is a moment away; its first call should not
                        # wait for a whole step of the others (woken by submit)
                        inbox.condition.wait(timeout=_HANDOFF_SECONDS)
                    self._handoff = False
                    idle = not inbox.runnable()
                    # cancelled before it got a sequence id: nothing to clear
                    gone = [s for s in inbox.queue if s.cancelled]
                    for sequence in gone:
                        inbox.queue.remove(sequence)
                        if sequence.group is not None:
                            sequence.group.size -= 1  # the others need not wait for it
                    # asked to pause before they got an id: set aside as they are
                    parking = [s for s in inbox.queue if s.pause_asked and s.group is None]
                    for sequence in parking:
                        inbox.queue.remove(sequence)
                        sequence.pause_asked = False
                        sequence.parked_out = True
                    # Take the admissible sequences out of the queue; their prefix
                    # matching runs after the lock is released (the Trio thread takes
                    # it in submit, cancel, wake and every /health or /metrics read).
                    groups: list[list[Sequence]] = []
                    free = len(inbox.cells)
                    while (members := inbox.next_admission(free)) is not None:
                        for sequence in members:
                            inbox.queue.remove(sequence)
                            inbox.admitting.append(sequence)  # (handed back at exit, if it comes to that)
                        free -= len(members)
                        groups.append(members)
                for sequence in gone:
                    self._remove(sequence, CANCELLED)
                for sequence in parking:
                    hand_park(sequence, "parked")
                membership.admit(groups)
                if idle:
                    if self.policy.pending:
                        self.idle.run_safely()
                    else:
                        self.idle.persist_safely()
                else:
                    self._step()
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("the batch scheduler failed")
            with inbox.condition:
                inbox.failure = exc
        finally:
            self.membership.drain()

    def _step(self) -> None:
        # 1. drop cancelled sequences
        active = self.inbox.active
        for sequence in [s for s in active if s.cancelled]:
            self._remove(sequence, CANCELLED)
        # 1b. set aside those preemption asks to pause
        parking = [s for s in active if s.pause_asked]
        for sequence in parking:
            if self._park(sequence):
                self._handoff = True
        if self._handoff or not active:
            return  # the request it made room for is admitted first (_run)
        # 2. plan the calls of this step (the planner: data in, a plan out)
        sets: dict[AdapterSet, int] = {(): 0}  # (this step's adapter sets, numbered)
        candidates = [
            _candidate(key, s, sets.setdefault(s.adapters, len(sets))) for key, s in enumerate(active)
        ]
        plan = plan_step(candidates, self.limits)
        running = list(active)
        if plan.draft is not None:
            self.outputs.plan_draft_safely(running[plan.draft])
        # 3. run them
        for planned in plan.calls:
            if any(s.pause_asked for s in running):
                # set aside at once (next step); the calls left wait a step, and a
                # guess planned for one of them is planned again then
                if plan.draft is not None:
                    running[plan.draft].spec.draft = []
                break
            call = [(running[key], count) for key, count in planned]
            try:
                self._decode_call(call)
            except Exception as exc:
                # (a bookkeeping error around the call: its sequences fail, not the server)
                logger.exception("a decode call failed in the scheduler; its requests fail, the others go on")
                for sequence, _ in call:
                    if sequence.result is None:
                        self._remove(sequence, failed(sequence, f"inference failed: {exc!r}"))
        self.steps += 1

    def _decode_call(self, call: list[tuple[Sequence, int]]) -> None:
        """One ``llama_decode`` call; its pieces go to their channels, and finished
        sequences back to their requests."""
        inbox = self.inbox
        filled = self.executor.fill(call)
        with inbox.condition:
            if any(s.cancelled for s, _ in call) or inbox.stopping:
                return  # dropped at the next step
            inbox.abort_flag.value = 0
            inbox.in_flight = filled.per_sequence
            inbox.in_flight_tokens = filled.rows
        outcome = self.executor.decode()
        with inbox.condition:
            inbox.in_flight = {}
        ring = self.kv.ring
        if ring is not None and not outcome.ok:
            # (a failed or aborted call's cells are removed by llama.cpp itself: their
            # holes must count with the trim that follows — _ring_layout.py)
            for sequence, count in call:
                start = sequence.prefilled if count else sequence.pos
                ring.note(sequence.seq_id, start + filled.per_sequence.get(sequence, 1))
        if outcome.aborted:
            # Survivors redo the call from the same state. llama.cpp rolls back the
            # ubatch it was computing (a mutation test removing the line below still
            # passed the shared-call abort test), but "processed ubatches remain in
            # the context's memory" (llama.h) when a call was split: remove every cell
            # this call may have written.
            self.aborted_calls += 1
            for sequence, count in call:
                start = sequence.pos if count == 0 else sequence.prefilled
                if self.kv.trim(sequence.seq_id, start) != start and not sequence.cancelled:
                    # (a model without partial removal aborts only all-cancelled calls)
                    self._remove(sequence, BackendError("an aborted decode call could not be rolled back"))
            return
        if not outcome.ok:
            for sequence, _ in call:
                self._remove(sequence, failed(sequence, f"llama_decode failed with code {outcome.code}"))
            return
        outputs = filled.outputs
        now = time.perf_counter()
        prompts_done = False  # (a prompt's last piece ran: its row may be kept)
        marking = self.policy.marks.keep > 0
        for sequence, count in call:
            if count:
                sequence.prefilled += count
                sequence.pos = sequence.prefilled
                sequence.progress.prefilled_tokens = sequence.prefilled
                if marking and sequence.asked.cache_prompt:
                    self.kv.mark(sequence)
                if sequence.decoding:
                    prompts_done = True
                    sequence.progress.prefill_seconds = now - sequence.out.first_chunk_at
                    if sequence.followers:
                        outputs += share_prompt(self.kv, sequence, outputs)
            else:
                sequence.pos += 1
        if filled.padded is not None:
            # its pad row's cell goes, the token's stays (a pad needs partial removal:
            # verify calls need it too, and pads come only with them)
            self.kv.trim(filled.padded.seq_id, filled.padded.pos)
        drafts = filled.drafts
        emit = self.outputs.emit
        # every row kept before any draw: a mask writes into the buffer it draws from, and
        # a choice of n > 1 shares its leader's row (share_prompt)
        for sequence, index in outputs if prompts_done else ():
            if not sequence.out.generated and self.policy.keeps_row(
                sequence.asked.cache_prompt, len(sequence.asked.prompt), sequence.cache.cuts
            ):
                row = logits_row(self._model.lib, self.executor.ctx, index, self._model.n_vocab)
                self.kv.keep_row(sequence, row)
        for sequence, index in outputs:
            if sequence.asked.max_new <= 0:
                self._remove(sequence, "length")  # a prompt to evaluate only: it is cached
                continue
            token, end = emit(sequence, index)
            if end is None and drafts and sequence in drafts:
                end = self.outputs.verify(sequence, index, token, drafts[sequence])
            if end is not None:
                self._remove(sequence, end)


def _candidate(key: int, sequence: Sequence, adapters: int) -> Candidate:
    return Candidate(
        adapters=adapters,
        key=key,
        seq_id=sequence.seq_id,
        pos=sequence.pos,
        decoding=sequence.decoding,
        waiting=sequence.leader is not None,
        room=sequence.channel.room,
        prefilled=sequence.prefilled,
        prompt_length=len(sequence.asked.prompt),
        cuts=sequence.cache.cuts,
        priority=sequence.priority,
    )
