"""The KV cells of the context, on llama.cpp's side: trim a sequence's cells, save a
cached prefix's state to a tier below (:class:`~._tiers.StateTier`: host memory today)
and restore one, give a choice of ``n`` > 1 a copy of its leader's prompt cells, and at
unload spill every id's prefix. Which cells *should* be kept is the cache policy's
decision; this carries it out (and only the scheduler thread calls it)."""

from __future__ import annotations

import bisect
import ctypes
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy

from ..._core._exceptions import BackendError
from .._cache import CachePolicy, DiskEntry, StateBuffer, WindowMark
from ._ring_layout import WindowRing, set_window_state, window_ring, window_state
from ._sequence import Sequence
from ._state_layout import restore
from ._tiers import StateTier

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["KvCells"]

logger = logging.getLogger("trioserve.llama")


class KvCells:
    """The cells of one context (``ctx``, its ``memory``), with the tier evicted
    prefixes go to.

    Over 300 lines for one job: every verb here (trim, save, restore, park, share,
    checkpoint, persist) is a few llama.cpp calls and their failure paths on the same
    id's cells, and they keep that id's facts in step — its window start after a
    restore, its kept logits row, what of it the disk holds. Split across objects, each
    would have to be told of the others' changes to those facts."""

    def __init__(
        self, model: LlamaModel, ctx: Any, memory: Any, *, host: StateTier, policy: CachePolicy
    ) -> None:
        self._model = model
        self.ctx = ctx
        self.memory = memory
        self.host = host
        self.policy = policy
        #: per id, what of its cells was last written to the disk tier while idle
        #: (its salt and every token of the prefix: a length and the last tokens called
        #: two prompts differing at their start the same)
        self._persisted: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.persisted = 0
        #: measured on the first prefix kept (``llama_state_seq_get_size``), for the gauge
        self.kv_bytes_per_token = 0.0
        self.restore_seconds = 0.0
        self.save_seconds = 0.0
        #: preemption: time spent saving paused sequences' states
        self.park_seconds = 0.0
        #: time spent keeping checkpoints of window cells
        self.mark_seconds = 0.0
        #: per id, the last logits of the prompt its cells hold (``CachePolicy.logits_at``
        #: says for which length): a full hit draws its first token from it
        self._rows: dict[int, numpy.ndarray] = {}
        #: full hits: prompts whose first token came from a kept row, with no call
        self.whole_hits = 0
        #: per id whose cells were set from a state with its window cells put in their
        #: places (:mod:`._state_layout`): the first position whose window cells are
        #: real (llama.cpp reports the zero cells below it)
        self._window_starts: dict[int, int] = {}
        #: the window layers kept to their window: their rings laid out as a fresh
        #: evaluation leaves them (:mod:`._ring_layout`), else ``None``
        self.ring: WindowRing | None = None
        if not model.settings.swa_full:
            self.ring = window_ring(model, ctx, memory, window=host.window, n_batch=model.settings.n_batch)

    def keep_row(self, sequence: Sequence, logits: numpy.ndarray) -> None:
        """``sequence``'s prompt is evaluated and ends on a cut (its cells are all kept):
        keep a copy of its last logits for its id (before the draw: a mask changes the
        row in place)."""
        row = self._rows.get(sequence.seq_id)
        if row is None or row.shape != logits.shape:
            row = self._rows[sequence.seq_id] = numpy.empty_like(logits)
        numpy.copyto(row, logits)
        sequence.cache.row_kept = True

    def whole_row(self, sequence: Sequence) -> numpy.ndarray | None:
        """A copy of the kept row a full hit draws from (``None``: its cells did not
        come through — a save before them failed — so it evaluates its last piece)."""
        row = self._rows.get(sequence.seq_id)
        if row is None or sequence.prefilled != len(sequence.asked.prompt):
            return None
        self.whole_hits += 1
        return row.copy()

    @property
    def lib(self) -> Any:
        """The model's bindings, read at each call (tests swap them to inject faults)."""
        return self._model.lib

    def spill(self) -> int:
        """Before the context is freed (the thread has stopped): save every id's cached
        prefix to the host tier, so that a registry entry loaded again restores it
        (docs/models.md). Returns the prefixes saved."""
        if not self.host.keeps:
            return 0
        policy = self.policy
        saved = 0
        # the most recently used last: the host tier keeps the newest when it is full
        for seq_id in policy.spill_order():
            tokens = policy.cached(seq_id)
            if not policy.savable(seq_id):
                continue
            checkpoint = policy.checkpoint(seq_id)
            salt = policy.salt(seq_id)
            try:
                if not policy.host_covers(tokens, salt) and self.save_state(seq_id, tokens, salt):
                    saved += 1
                # (the context is freed next: its cells may go)
                if checkpoint and self.trim(seq_id, checkpoint) == checkpoint:
                    saved += self.save_state(seq_id, tokens[:checkpoint], salt)
            except Exception:  # an optimisation: without it, the prompt is evaluated again
                logger.exception("could not save a cached prefix at unload; it is dropped")
        return saved

    # ------------------------------------------------------- scheduler thread

    def _mark(self, seq_id: int) -> tuple[str, tuple[int, ...]]:
        # every token: two prompts of one length and one ending differ at their start
        # (a length and the last tokens said "written" for the second, never written)
        return (self.policy.salt(seq_id), tuple(self.policy.cached(seq_id)))

    def persist_pending(self, free: list[int]) -> int | None:
        """A free id whose cached prefix the disk tier may not hold yet: while nothing
        runs, the thread writes it (:meth:`persist`), so a crash or a ``kill -9`` loses
        only what was computed since the server was last idle. (Under the lock: cheap.)"""
        if self.host.disk is None:
            return None
        for seq_id in free:
            if self.policy.cached(seq_id) and self._persisted.get(seq_id) != self._mark(seq_id):
                return seq_id
        return None

    def persist(self, seq_id: int) -> bool:
        """Write ``seq_id``'s cached prefix to the disk tier (not to host memory: the cells
        still hold it); whether a write was queued. One ``llama_state_seq_get_data``
        (≈ 14 ms for 7 MB), between requests only."""
        disk = self.host.disk
        self._persisted[seq_id] = mark = self._mark(seq_id)
        tokens = list(self.policy.cached(seq_id))
        salt = mark[0]
        cuts = self.policy.host_cuts(tokens)
        if disk is None or not self.policy.savable(seq_id) or disk.covers(tokens, cuts, salt=salt):
            return False
        state = self.whole_state(seq_id)
        if not state.used:
            return False
        start = self.host.floor(len(tokens), self.window_start(seq_id, len(tokens)))
        if not self.host.serves(start, len(tokens)):
            return False
        queued = disk.put(tokens, cuts, state, start=start, salt=salt)
        self.persisted += queued
        return queued

    @property
    def swa_full(self) -> bool:
        """The window layers keep every cell (``LlamaSettings.swa_full``)."""
        return self._model.settings.swa_full

    def forget(self, seq_id: int) -> None:
        """Drop what a free id caches: its cells, its kept row and its bookkeeping."""
        self.policy.forget(seq_id)
        self._rows.pop(seq_id, None)
        self._window_starts.pop(seq_id, None)
        if not self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1):  # pragma: no cover
            logger.error("llama.cpp could not clear the cells of sequence %d", seq_id)
        elif self.ring is not None:
            self.ring.cleared(seq_id)

    def whole_state(self, seq_id: int) -> StateBuffer:
        """The state of ``seq_id``'s cells (``used``: 0 when llama.cpp wrote none), in a
        mapping of its own, never the heap (_memory.py: given back when evicted)."""
        size = self.lib.llama_state_seq_get_size(self.ctx, seq_id)
        state = StateBuffer(size)
        state.used = self.lib.llama_state_seq_get_data(self.ctx, state.array, size, seq_id)
        return state

    def trim(self, seq_id: int, keep: int, *, lay: bool = True) -> int:
        """Remove ``seq_id``'s cells from position ``keep`` on; the cells kept. Where
        llama.cpp refuses a partial removal (``llama_memory_seq_rm`` returns false:
        recurrent state), every cell goes and 0 is kept. With the window layers kept to
        their window, the ring is laid out again as a fresh evaluation of ``keep``
        tokens leaves it (:mod:`._ring_layout`; ``lay=False``: the caller sets the
        window cells itself next)."""
        lib, ring = self.lib, self.ring
        held = ring.held(seq_id) if ring is not None and keep > 0 else 0
        if keep > 0 and lib.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            start = 0 if ring is None or not lay else ring.trimmed(seq_id, held, keep)
            if start is not None:
                if start:  # (zero cells below it now)
                    self._window_starts[seq_id] = max(start, self._window_starts.get(seq_id, 0))
                return keep
            logger.warning("could not lay the window cells of sequence %d out again: clearing it", seq_id)
        elif keep > 0:
            logger.warning("llama.cpp refused to keep %d cells of sequence %d: clearing it", keep, seq_id)
        self._window_starts.pop(seq_id, None)
        if not lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1):
            raise BackendError(f"llama.cpp could not clear the cells of sequence {seq_id}")
        if ring is not None:
            ring.cleared(seq_id)
        return 0

    def park(self, sequence: Sequence) -> StateBuffer:
        """Preemption: the state of ``sequence``'s cells (in a mapping of its own), then
        its cells cleared; :meth:`unpark` puts it back under any free id."""
        seq_id = sequence.seq_id
        state = self.whole_state(seq_id)
        if not state.used:
            raise BackendError(f"llama.cpp could not save the state of sequence {seq_id}")
        if not self.kv_bytes_per_token and sequence.pos > 0:
            # (the pause budget's estimate for the next pauses)
            self.kv_bytes_per_token = state.used / sequence.pos
        sequence.saved_window = self._window_starts.get(seq_id, 0)
        self.forget(seq_id)
        # (its row, if kept, stays with this id: it resumes under another, which holds
        # another row — it keeps none for a full hit)
        sequence.cache.row_kept = False
        return state

    def unpark(self, sequence: Sequence) -> None:
        """A parked ``sequence`` resumes under its new id: the id's cached prefix saved
        as admission planned, then the sequence's state restored, cell for cell."""
        where = sequence.prefilled, sequence.pos
        self._save_planned(sequence)
        sequence.prefilled, sequence.pos = where  # (the save touches the id's cells only)
        state, sequence.saved = sequence.saved, None
        assert state is not None
        seq_id = sequence.seq_id
        self.trim(seq_id, 0)
        floor, sequence.saved_window = sequence.saved_window, 0
        if self.set_state(state.array, len(state), seq_id, floor=floor, strict=False) is None:
            raise BackendError("llama.cpp could not restore the state of a paused request")

    def _save_planned(self, sequence: Sequence) -> None:
        seq_id = sequence.seq_id
        if sequence.cache.save is not None:
            started = time.perf_counter()
            save, sequence.cache.save = sequence.cache.save, None
            checkpoint, sequence.cache.checkpoint = sequence.cache.checkpoint, 0
            try:
                self.save_state(seq_id, save, sequence.cache.save_salt)
                if checkpoint:
                    # the prompt end too, which the longer state cannot give back
                    # (CachePolicy.checkpoint): its cells alone, then their state
                    if self.trim(seq_id, checkpoint) == checkpoint:
                        self.save_state(seq_id, save[:checkpoint], sequence.cache.save_salt)
                    else:  # pragma: no cover - (partial removal is checked at load)
                        self.reuse(sequence, 0)
            except Exception:
                # the save is an optimisation: without it, a later turn evaluates again
                logger.exception("could not save a cached prefix to host memory; it is dropped")
            self.save_seconds += time.perf_counter() - started

    def prepare(self, sequence: Sequence) -> None:
        """Carry out admission's plan: save the prefix being overwritten to host memory,
        restore the one to reuse from it, drop the cells past the reused prefix."""
        seq_id = sequence.seq_id
        self._save_planned(sequence)
        if sequence.cache.restore is not None:
            started = time.perf_counter()
            state, sequence.cache.restore = sequence.cache.restore, None
            self.trim(seq_id, 0)
            buffer: Any = None
            size = 0
            tier = "host"
            if isinstance(state, DiskEntry):
                tier = "disk"
                disk = self.host.disk
                data = None if disk is None else disk.read(state, cancelled=lambda: sequence.cancelled)
                if data is not None:
                    buffer, size = (ctypes.c_uint8 * len(data)).from_buffer(data), len(data)
            elif isinstance(state, StateBuffer):
                buffer, size = state.array, len(state)
            else:
                buffer, size = (ctypes.c_uint8 * len(state)).from_buffer_copy(state), len(state)
            needed = self.window_floor(sequence.prefilled)
            # (the entry was chosen because its window cells reach down to ``needed``:
            # nothing below it is claimed, whatever zero cells the state carries)
            start = None if buffer is None else self.set_state(buffer, size, seq_id, floor=needed)
            if buffer is None:
                # a miss on disk (gone, failed its check — logged — or the request was
                # cancelled while it was read): evaluate the prompt
                self.reuse(sequence, 0)
            elif start is None:
                # pragma: no cover - llama.cpp refused the state: evaluate it all
                logger.warning("could not restore a cached prefix; evaluating the prompt")
                self.reuse(sequence, 0)
            elif start > needed:
                # pragma: no cover - (planned against: HostCache.usable) the state lacks
                # window cells the rest of the prompt attends to
                logger.warning("a restored prefix lacks sliding-window cells; evaluating the prompt")
                self.reuse(sequence, 0)
            elif tier == "disk":
                sequence.progress.disk_tokens = sequence.prefilled
                if self.host.disk is not None:
                    self.host.disk.restored_tokens += sequence.prefilled
            else:
                self.host.restores += 1
                sequence.progress.host_tokens = sequence.prefilled
            self.restore_seconds += time.perf_counter() - started
        elif sequence.cache.window is not None:
            mark, sequence.cache.window = sequence.cache.window, None
            self._restore_mark(sequence, mark)
        # the cells past the reused prefix go (the rest of the cached prompt)
        kept = self.trim(seq_id, sequence.prefilled)
        if kept != sequence.prefilled:
            self.reuse(sequence, kept)
        elif (
            not self.swa_full
            and kept
            and self.host.window
            and self.window_start(seq_id, kept) > self.window_floor(kept)
        ):
            # window layers kept to their window: the cells the rest attends to are gone
            # (planned against: CachePolicy.serves) — evaluate it all, never a short window
            logger.warning("a cached prefix lacks sliding-window cells; evaluating the prompt")
            sequence.cache.whole = sequence.cache.row_kept = False
            self.reuse(sequence, 0)

    def mark(self, sequence: Sequence) -> None:
        """A prompt piece of ``sequence`` just ended on a cut: keep a checkpoint of its
        window cells there when the policy wants one (``--no-swa-full``:
        :mod:`.._cache._window_marks`). One ``llama_state_seq_get_data_ext`` of the window layers
        (≈ window + batch cells)."""
        marks = self.policy.marks
        end = sequence.prefilled
        cuts = sequence.cache.cuts
        i = bisect.bisect_left(cuts, end)
        if i == len(cuts) or cuts[i] != end:
            return  # (not on a cut: no later prompt's pieces end there)
        turn = self.policy.rule.after_header(sequence.asked.prompt, end)
        if not marks.wants(sequence.seq_id, end, cuts[-1], turn=turn):
            return
        seq_id = sequence.seq_id
        started = time.perf_counter()
        try:
            state = window_state(self.lib, self.ctx, seq_id)
        except Exception:  # an optimisation: without it, a shared head is evaluated again
            logger.exception("could not keep a checkpoint of the window cells; none is kept")
            return
        floor = self.window_start(seq_id, end)
        if state.used and floor < end:
            marks.add(seq_id, WindowMark(end, floor, state, state.used))
        self.mark_seconds += time.perf_counter() - started

    def _restore_mark(self, sequence: Sequence, mark: WindowMark) -> None:
        """Give ``sequence``'s id back its first ``mark.end`` cells: the cells past it go
        and the window layers' cells are set from the checkpoint."""
        seq_id = sequence.seq_id
        state = mark.state
        assert isinstance(state, StateBuffer)
        if self.trim(seq_id, mark.end, lay=False) != mark.end:  # pragma: no cover - (checked at load)
            self.reuse(sequence, 0)
            return
        if self.ring is not None:
            start: int | None = self.ring.restore(state.array, len(state), seq_id, partial=True)
        else:  # (a window this build does not lay out: as saved, not exact)
            start = mark.floor if set_window_state(self.lib, self.ctx, state, seq_id) else None
        if start is None or start < 0:
            # pragma: no cover - llama.cpp refused the state: evaluate it all
            logger.warning("could not restore a checkpoint of the window cells; evaluating the prompt")
            self.reuse(sequence, 0)
            return
        self._window_starts[seq_id] = max(start, mark.floor)
        self.policy.marks.restores += 1

    def save_state(self, seq_id: int, tokens: list[int], salt: str) -> bool:
        """Keep the state of ``seq_id``'s cells (which hold ``tokens``, computed for
        requests of ``salt``) in host memory."""
        lib = self.lib
        size = lib.llama_state_seq_get_size(self.ctx, seq_id)
        if size > self.host.budget and self.host.disk is None:
            return False
        # in a mapping of its own, never the heap (_memory.py: given back when evicted)
        state = StateBuffer(size)
        state.used = written = lib.llama_state_seq_get_data(self.ctx, state.array, size, seq_id)
        if not written:
            return False
        floor = self.window_start(seq_id, len(tokens))
        return self.host.put(tokens, self.policy.host_cuts(tokens), state, floor=floor, salt=salt)

    def window_start(self, seq_id: int, held: int) -> int:
        """The first position whose sliding-window cells ``seq_id`` holds, with ``held``
        cells (0 without a window). Cells set from a sequence state — a restore, a
        choice's copy of its leader's prompt — start where that state's window cells did."""
        if not self.host.window or not held:
            return 0
        start = int(self.lib.llama_memory_seq_pos_min(self.memory, seq_id))
        if start < 0:
            return held  # (no window cells at all: they serve nothing)
        # (cells set from a state with its window cells in place: the zero cells below
        # its first real one count as missing)
        return max(start, self._window_starts.get(seq_id, 0))

    def set_state(
        self, buffer: Any, size: int, seq_id: int, *, floor: int = 0, strict: bool = True
    ) -> int | None:
        """``llama_state_seq_set_data`` of a whole sequence state (``size`` bytes of
        ``buffer``) into ``seq_id``, whose cells it replaces — with the window layers'
        cells where a fresh evaluation put them when the window layers keep every cell
        (:mod:`._state_layout`: else the attention sums round differently and the text
        may change). ``floor``: no window cell below it is claimed (a restored id's zero
        cells may be in a state of it). Returns the first position whose window cells
        the state really holds (0 without a window), or ``None`` when nothing was
        restored: llama.cpp refused, or (``strict``) the state's layout is not one this
        build knows — a restore then evaluates the prompt instead."""
        self._window_starts.pop(seq_id, None)
        lib, window = self.lib, self.host.window
        start = None if self.ring is None else self.ring.restore(buffer, size, seq_id, partial=False)
        if start is None and self.ring is not None and strict:
            logger.warning("a saved state's layout is not the one this build writes; it is not restored")
        elif start is None:
            # (with the window kept to its window: a paused request's state of a layout
            # this build does not lay out goes in as saved; llama.cpp's first position
            # then says it all)
            if self.ring is not None:
                logger.warning("a paused request's state is restored as saved: its text may differ")
            start = restore(
                lib, self.ctx, buffer, size, seq_id, in_place=self.swa_full and bool(window), strict=strict
            )
            if start is not None and window and not self.swa_full:
                start = max(0, int(lib.llama_memory_seq_pos_min(self.memory, seq_id)))
        if start is not None and start < 0:
            return None  # (llama.cpp refused it)
        if start is not None and (start or floor):
            # (zero cells below ``start``: put in place, or laid out in the ring)
            self._window_starts[seq_id] = max(start, floor)
        return start

    def window_floor_of(self, seq_id: int) -> int:
        """The first real window position a restore into ``seq_id`` recorded (0: none)."""
        return self._window_starts.get(seq_id, 0)

    def window_floor(self, reused: int) -> int:
        """The lowest position the tokens after ``reused`` cached ones attend to."""
        window = self.host.window
        return max(0, reused - window + 1) if window else 0

    def reuse(self, sequence: Sequence, tokens: int) -> None:
        """Start ``sequence`` after ``tokens`` cached tokens (fewer than planned: a restore
        or a partial removal failed)."""
        if tokens == 0:
            self.trim(sequence.seq_id, 0)
        sequence.prefilled = sequence.pos = tokens
        sequence.progress.cached_tokens = sequence.progress.prefilled_tokens = tokens

    def keep(self, sequence: Sequence, *, failed: bool, finished: bool) -> None:
        """``sequence`` leaves its id: keep the cells the policy keeps (fast: every cell
        computed, the reply's too; exact: whole prompt pieces), clear the rest."""
        seq_id = sequence.seq_id
        policy = self.policy
        keep = policy.keep(
            cache_prompt=sequence.asked.cache_prompt,
            failed=failed,
            computed=sequence.pos,
            prefilled=sequence.prefilled,
            cuts=sequence.cache.cuts,
        )
        marks = policy.marks.of(seq_id)
        policy.forget(seq_id)  # (until the cells below are known to be kept)
        keep = self.trim(seq_id, keep)
        if keep and not self.kv_bytes_per_token:
            self.kv_bytes_per_token = self.lib.llama_state_seq_get_size(self.ctx, seq_id) / keep
        policy.release(
            seq_id,
            sequence.asked.prompt,
            sequence.out.generated_tokens,
            keep,
            finished=finished,
            floor=self.window_start(seq_id, keep),
            logits=sequence.cache.row_kept,
        )
        policy.marks.set(seq_id, [mark for mark in marks if mark.end <= keep])
