"""A window layer's ring of cells put back as a fresh evaluation leaves it, with the
window layers kept to their window (``--no-swa-full``; docs/prompt-cache.md, "The
window's ring, exact").

There the window layers have a ring of ``R`` cells (llama.cpp: the window plus a batch,
padded to 256; Gemma 3 with 512-token batches: 1,024). A fresh evaluation of a sequence
from an empty stream, in pieces of at most ``R - window + 1`` tokens, leaves position
*p* in cell ``p mod R`` — each piece starts at the head and the cells it takes hold
positions one lap older, which its first token no longer sees — and the head at
``end mod R``: after ``end`` tokens, cell *i* holds the last position below ``end`` that
is *i* modulo ``R``. Every later call's placement, the count of cells the attention
covers and the order it adds them in follow from that picture alone.

A reused prefix breaks the picture: cells trimmed off leave holes where a fresh
evaluation keeps older (masked) cells, and llama.cpp's search then starts elsewhere
(it goes back to cell 0 when the head is far above the cells in use); a restored state
goes into the first free cells in order. The values are right, the sums are not.

:func:`ring_layout` rewrites a sequence state (whole, or the window layers' part only)
so that ``llama_state_seq_set_data`` restores the fresh picture: its window part becomes
``min(end, R)`` cells in cell order, each holding the position a fresh evaluation keeps
there — the state's own rows for the positions the window still sees, zero rows for the
older ones (masked for every later token: the exact zeros a fresh evaluation's masked
cells add). The caller first puts the stream's search head at cell 0 (llama.cpp sets it
there when a shift finds no cell to move), so the cells land at 0, 1, 2…; the head then
sits after the last one, and where a fresh evaluation's head is inside the ring, the
cell there carries a position past the end (:attr:`Ring.filler`) whose removal puts the
head on it — a free cell where the fresh ring holds a masked one, which the next call
overwrites first either way.

The state format is :mod:`._state_layout`'s; the window part's cells come in cell order,
so after a wrap their positions are not ascending."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy

from .._cache import StateBuffer
from ._state_layout import HEADER, MAGIC, part, rewrite, u32

__all__ = [
    "RING_ARCHITECTURES",
    "Ring",
    "WindowRing",
    "ring_layout",
    "ring_size",
    "set_window_state",
    "window_ring",
    "window_state",
]


@dataclass(frozen=True, slots=True)
class Ring:
    """A state to restore (``buffer``, ``size`` bytes) whose window cells land as a fresh
    evaluation of its ``end`` positions leaves them; ``start``: the first position whose
    window cells are the state's own (zero cells below it); ``filler``: the position to
    remove after the restore (its cell is where the fresh head is), ``None`` when none."""

    buffer: Any
    size: int
    end: int
    start: int
    filler: int | None


def ring_size(n_ctx_seq: int, window: int, n_ubatch: int) -> int:
    """The window layers' cells per sequence (llama.cpp's ``llama_kv_cache_iswa``, one
    stream a sequence): the window and a batch, at most the context, padded to 256."""
    return -(-min(n_ctx_seq, window + n_ubatch) // 256) * 256


def ring_layout(buffer: Any, size: int, *, ring: int, window: int, partial: bool) -> Ring | None:
    """The state in ``buffer`` (``size`` bytes; whole, or the window layers' part only when
    ``partial``) with its window part laid out as a fresh evaluation's ring of ``ring``
    cells (``window``: the model's sliding window). ``None`` when it is not a state of one
    sequence in the format described, or it lacks a cell the next token attends to."""
    view = memoryview(buffer).cast("B")[:size]
    if size < HEADER or u32(view, 0) != MAGIC:
        return None
    at = HEADER
    last = -1
    if not partial:
        base = part(view, at)
        if base is None:
            return None
        at, last = base.end, int(base.positions[-1])
    win = part(view, at, ordered=False)
    if win is None or win.end != size:
        return None
    positions = win.positions
    end = int(positions.max()) + 1
    if not partial and last + 1 != end:
        return None
    count = min(end, ring)
    index = numpy.arange(count, dtype=numpy.int64)
    wanted = index + ring * ((end - 1 - index) // ring)
    order = numpy.argsort(positions, kind="stable")
    ranked = positions[order].astype(numpy.int64)
    if (numpy.diff(ranked) <= 0).any() or ranked[0] < wanted.min():
        return None  # (a position twice, or one older than a lap)
    loc = numpy.minimum(numpy.searchsorted(ranked, wanted), len(ranked) - 1)
    found = ranked[loc] == wanted
    if int(found.sum()) != len(ranked):
        return None
    # every position the next token sees: the last ``window - 1``, all held
    seen = wanted >= end - window + 1
    if not found[seen].all():
        return None
    source = order[loc]
    filler: int | None = None
    final = wanted.astype(numpy.int32)
    if end > ring and end % ring:
        filler = end + ring
        final[end % ring] = filler
    # the cells: (pos, n_seq_id, [ext], seq_id) — the kept cells' own, zero ext for the rest
    words = win.cell // 4
    held = numpy.frombuffer(view, dtype="<i4", count=win.count * words, offset=win.meta).reshape(-1, words)
    meta = numpy.zeros((count, words), dtype="<i4")
    meta[found] = held[source[found]]
    meta[:, 0] = final
    meta[:, 1] = 1
    meta[:, -1] = held[0, -1]
    kept, into = source[found], numpy.flatnonzero(found)

    def place(rows: numpy.ndarray, ring_rows: numpy.ndarray) -> None:
        # (the zero rows: the mapping's pages are zero until written)
        ring_rows[:, into, :] = rows[:, kept, :]

    array, out_size = rewrite(view, size, win, count, meta.view(numpy.uint8).reshape(-1), place)
    return Ring(array, out_size, end, int(ranked[0]), filler)


#: a position no cell holds: a shift of it moves nothing and puts the search head at 0
_FAR = 1 << 30
#: ``llama_state_seq_*_ext``'s flag for the window layers' cells only
_WINDOW_ONLY = 1


class WindowRing:
    """One context's window rings (``ring`` cells a sequence; ``window``: the model's
    sliding window), kept as a fresh evaluation leaves them: a stream emptied starts
    its search at cell 0 (:meth:`cleared`), a trim that leaves another picture is laid
    out again (:meth:`trimmed`), a state restored is laid out as it goes in
    (:meth:`restore`). Only the scheduler thread calls it."""

    def __init__(self, model: Any, ctx: Any, memory: Any, *, ring: int, window: int) -> None:
        self._model = model
        self.ctx = ctx
        self.memory = memory
        self.ring = ring
        self.window = window
        #: trims laid out again, and the time they took
        self.relays = 0
        self.seconds = 0.0
        #: per sequence whose ring has holes no call has filled yet (a trim's): the
        #: position past the highest cell those holes reach
        self._reach: dict[int, int] = {}

    @property
    def lib(self) -> Any:
        """The model's bindings, read at each call (tests swap them to inject faults)."""
        return self._model.lib

    def stats(self) -> dict[str, object]:
        """``/health``'s ``cache.window_ring``."""
        return {"cells": self.ring, "relays": self.relays, "seconds": round(self.seconds, 6)}

    def window_state(self, seq_id: int) -> StateBuffer:
        """The state of ``seq_id``'s window layers' cells (a relay's)."""
        return window_state(self.lib, self.ctx, seq_id)

    def cleared(self, seq_id: int) -> None:
        """``seq_id`` holds no cell: its streams' search heads go to cell 0, where a
        fresh server's are (llama.cpp moves a head down to the first cell it frees, and
        the first cell may have been free already)."""
        self._reach.pop(seq_id, None)
        self.lib.llama_memory_seq_add(self.memory, seq_id, _FAR, _FAR + 1, 1)

    def note(self, seq_id: int, end: int) -> None:
        """A call that failed or was aborted wrote ``seq_id``'s cells up to position
        ``end`` (its last + 1): llama.cpp removed what it placed before the caller's
        trim sees it, so the holes it left count with that trim's. (Only then: a call
        that succeeds leaves its cells, which the trim reads itself — nothing per token.)"""
        reach = self._reach
        if reach.get(seq_id, 0) < end:
            reach[seq_id] = end

    def held(self, seq_id: int) -> int:
        """The positions ``seq_id``'s cells reach (its last one + 1; 0: none)."""
        return int(self.lib.llama_memory_seq_pos_max(self.memory, seq_id)) + 1

    def trimmed(self, seq_id: int, held: int, keep: int) -> int | None:
        """``seq_id`` held ``held`` positions and now keeps ``keep``: lay its ring out
        again where the trim left another picture than a fresh evaluation of ``keep``
        tokens. The removed cells are holes where the fresh ring keeps older, masked
        cells; that changes nothing later while the holes start at the head and stop
        short of the ring's last cell (the next calls fill them in the fresh order,
        and the attention covers as many cells) — measured to the bit
        (``scripts/probes/ring_exact.py``: 2,600 tokens and 471 more trimmed, equal;
        472, the last cell emptied, not). Holes a trim left that no call has filled
        yet count with the next trim's. Returns the first position whose window
        cells are real (0: nothing laid out — nothing needed it, or its window cells
        do not reach back far enough, which a reuse then finds and evaluates the
        prompt); ``None`` when llama.cpp refused the state (its window cells are gone)."""
        reach = max(held, self._reach.get(seq_id, 0))
        if reach <= self.ring or reach <= keep:
            self._reach.pop(seq_id, None)
            return 0  # (never gone round: cell p holds p, the holes past ``keep``; or nothing went)
        if keep % self.ring + (reach - keep) < self.ring:
            self._reach[seq_id] = reach  # (holes up to ``reach`` until calls fill them)
            return 0
        started = time.perf_counter()
        state = self.window_state(seq_id)
        laid = None
        if state.used:
            laid = ring_layout(state.array, state.used, ring=self.ring, window=self.window, partial=True)
        if laid is None:
            self._reach[seq_id] = reach
            return 0
        ok = self._set(laid, seq_id, partial=True)
        self.relays += ok
        self.seconds += time.perf_counter() - started
        return laid.start if ok else None

    def restore(self, buffer: Any, size: int, seq_id: int, *, partial: bool) -> int | None:
        """``llama_state_seq_set_data`` (``partial``: of the window layers only) of the
        state in ``buffer`` into ``seq_id``, its ring laid out first. Returns the first
        position whose window cells are real; ``None``: the state is not one this build
        lays out (nothing changed); -1: llama.cpp refused it."""
        laid = ring_layout(buffer, size, ring=self.ring, window=self.window, partial=partial)
        if laid is None:
            return None
        return laid.start if self._set(laid, seq_id, partial=partial) else -1

    def _set(self, laid: Ring, seq_id: int, *, partial: bool) -> bool:
        lib = self.lib
        self.cleared(seq_id)  # (the restore's cells then go in at 0, 1, 2…)
        if partial:
            ok = lib.llama_state_seq_set_data_ext(self.ctx, laid.buffer, laid.size, seq_id, _WINDOW_ONLY)
        else:
            ok = lib.llama_state_seq_set_data(self.ctx, laid.buffer, laid.size, seq_id)
        if ok and laid.filler is not None:
            lib.llama_memory_seq_rm(self.memory, seq_id, laid.filler, laid.filler + 1)
            # (the cell at the head is a hole where the fresh ring has a masked cell)
            self._reach[seq_id] = laid.end + 1
        return bool(ok)


def window_ring(model: Any, ctx: Any, memory: Any, *, window: int, n_batch: int) -> WindowRing | None:
    """The context's window rings, its window layers kept to their window (``window``:
    the model's sliding window, 0: none) — for the architectures whose window is a
    plain sliding one, where the fresh picture above holds (:data:`RING_ARCHITECTURES`;
    a chunked window saves only its chunk's cells, a hybrid model's state has a
    recurrent part after them, M-RoPE positions are not shifted): others keep
    llama.cpp's own placement, not exact."""
    if not window or model.architecture not in RING_ARCHITECTURES:
        return None
    ring = ring_size(int(model.lib.llama_n_ctx_seq(ctx)), window, n_batch)
    return WindowRing(model, ctx, memory, ring=ring, window=window)


def window_state(lib: Any, ctx: Any, seq_id: int) -> StateBuffer:
    """The state of ``seq_id``'s window layers' cells (``llama_state_seq_get_data_ext``
    of those layers only; ``used`` 0 when llama.cpp wrote none)."""
    size = lib.llama_state_seq_get_size_ext(ctx, seq_id, _WINDOW_ONLY)
    state = StateBuffer(size)
    state.used = lib.llama_state_seq_get_data_ext(ctx, state.array, size, seq_id, _WINDOW_ONLY)
    return state


def set_window_state(lib: Any, ctx: Any, state: StateBuffer, seq_id: int) -> bool:
    """``llama_state_seq_set_data_ext`` of a window-only state, as saved."""
    return bool(lib.llama_state_seq_set_data_ext(ctx, state.array, len(state), seq_id, _WINDOW_ONLY))


#: architectures whose window layers use a plain sliding window (measured: Gemma 3)
RING_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
