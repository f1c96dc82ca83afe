"""The prompt cache's policy (docs/prompt-cache.md): what each sequence id's cells
hold, which free id a new prompt takes and how much of it that id (or the host-memory
tier) already holds, what a finished sequence keeps, and which finished conversation
the idle recompute evaluates next, piece by piece.

Pure Python, with no lock of its own: the scheduler thread owns it, makes the llama.cpp
calls its plans ask for (``llama_memory_seq_rm``, the state saves and restores,
``llama_decode``), and calls the methods whose results ``/health`` reads
(:meth:`CachePolicy.take`) under the scheduler's lock. Which id a prompt takes:
:mod:`._placement`; matching and the host tier: :mod:`._prompt_cache`; the cut:
:mod:`._pieces`.

Salts: each id's cells carry the ``cache_salt`` of the request that computed them
(``GenerationRequest.cache_salt``), and a prompt reuses cells — or host-memory states —
of its own salt only: ids of other salts share nothing with it, whatever their tokens
(docs/operations.md, "What one key can learn")."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ._pieces import PieceRule, image_runs
from ._placement import SHORT_TAIL, Placement, Placer, last_cut, short_tail
from ._prompt_cache import HostCache
from ._window_marks import WindowMark, WindowMarks

__all__ = ["SHORT_TAIL", "CachePolicy", "Placement", "WindowMark", "WindowMarks", "next_cut", "short_tail"]


def next_cut(cuts: list[int], after: int, default: int) -> int:
    """The first of ``cuts`` (ascending) past ``after``, at most ``default`` when
    ``default`` is given (the prompt's end: its last call ends there, cut or not)."""
    i = bisect.bisect_right(cuts, after)
    if i < len(cuts) and (not default or cuts[i] <= default):
        return cuts[i]
    return default


@dataclass(frozen=True, slots=True)
class Recompute:
    """The idle recompute's next call: ``history[start:end]`` (one piece) into
    ``seq_id``, whose cells hold ``history[:start]`` (``cuts``: the history's)."""

    seq_id: int
    history: list[int]
    cuts: list[int]
    start: int
    end: int


class CachePolicy:
    """What each of ``slots`` sequence ids caches, and the decisions made on it.

    ``enabled``: the prompt cache is on (and the model allows partial removal);
    ``fast``: keep and reuse every computed cell, any matching length (not exact);
    ``idle_recompute``: remember finished conversations for the idle recompute;
    ``host``: the host-memory tier (a budget of 0: off)."""

    def __init__(
        self,
        slots: int,
        *,
        rule: PieceRule,
        host: HostCache,
        enabled: bool,
        fast: bool,
        idle_recompute: bool,
        marks: WindowMarks | None = None,
    ) -> None:
        self.rule = rule
        #: checkpoints of the ids' window cells (none unless the window layers are kept
        #: to their window)
        self.marks = marks if marks is not None else WindowMarks(slots, keep=0, step=0)
        self.host = host
        self.enabled = enabled
        self.fast = fast
        self.idle_recompute = idle_recompute
        #: the prompt tokens whose KV cells each sequence id keeps — whole pieces of the
        #: canonical cut, computed exactly as a fresh server computes them
        self._cached: list[list[int]] = [[] for _ in range(slots)]
        #: the first position whose sliding-window cells each id holds: cells set from a
        #: sequence state (a restore, an ``n`` > 1 choice's copy of its leader's prompt)
        #: lack the window cells below that state's start, so they serve only the
        #: prefixes whose following tokens attend to none of those (``HostCache.serves``)
        self._floor = [0] * slots
        #: where the prompt of each id's last request ended (its whole pieces): the idle
        #: recompute extends the cells past it with the reply, and a sliding-window
        #: model's state of the longer prefix cannot give it back (:meth:`checkpoint`)
        self._prompt_end = [0] * slots
        #: the salt of the request whose cells each id keeps: only a prompt of the same
        #: salt reuses them (nor are they saved to host memory under another)
        self._salt = [""] * slots
        #: when each id was last released (the LRU clock)
        self._used_at = [0] * slots
        self._uses = 0
        #: idle recompute: the whole conversation (prompt + reply + the likely start of
        #: the next turn) of a finished request, per id, with its cuts: its pieces past
        #: the cached prompt are evaluated while nothing else runs — in the canonical
        #: pieces, so the next turn reuses its reply exactly
        self._history: dict[int, tuple[list[int], list[int]]] = {}
        #: per id: the length of the prompt whose last token's logits the id keeps
        #: beside its cells (0: none) — the prompt ended on a cut, so its cells are all
        #: kept, and the same prompt again draws its first token from that row with no
        #: call at all (a full hit, docs/prompt-cache.md)
        self._logits_at = [0] * slots
        #: which free id a new prompt takes (it asks this policy what the ids hold)
        placer = Placer(self)
        #: the free id a new prompt takes and how much of it is reused, or restored from
        #: the host tier (:meth:`Placer.place`); :meth:`take` commits
        self.place = placer.place
        #: a later choice of an ``n`` > 1 request: the least recently used free id
        #: (:meth:`Placer.place_follower`)
        self.place_follower = placer.place_follower

    # ------------------------------------------------------------ reading

    def cached(self, seq_id: int) -> list[int]:
        """The prompt tokens whose cells ``seq_id`` keeps."""
        return self._cached[seq_id]

    def keeps_row(self, cache_prompt: bool, length: int, cuts: Sequence[int]) -> bool:
        """Whether a prompt of ``length`` tokens (``cuts``: its cuts) just evaluated should
        keep its last logits for a full hit: exact mode, its cells all kept — it ends on
        a cut."""
        return self.enabled and cache_prompt and not self.fast and bool(cuts) and cuts[-1] == length

    @staticmethod
    def last_cut_before(cuts: list[int], length: int) -> int:
        """The last of ``cuts`` before ``length`` (0: none): where a prompt of ``length``
        tokens must start evaluating to compute its last piece."""
        return last_cut(cuts, length - 1)

    def logits_at(self, seq_id: int) -> int:
        """The prompt length whose last logits ``seq_id`` keeps (0: none)."""
        return self._logits_at[seq_id]

    def salt(self, seq_id: int) -> str:
        """The salt of the cells ``seq_id`` keeps (its last request's)."""
        return self._salt[seq_id]

    def used_at(self, seq_id: int) -> int:
        """When ``seq_id`` was last released (the LRU clock: larger is more recent)."""
        return self._used_at[seq_id]

    def held(self, free_ids: Sequence[int]) -> list[int | None]:
        """Per id: the tokens it keeps if free (``None``: running a request)."""
        free = set(free_ids)
        return [len(tokens) if i in free else None for i, tokens in enumerate(self._cached)]

    @property
    def pending(self) -> int:
        """The finished conversations the idle recompute has pieces left of."""
        return len(self._history)

    def host_cuts(self, tokens: list[int]) -> Sequence[int]:
        """Where the host tier indexes ``tokens``' prefixes: at its cuts (fast: every token)."""
        if not self.fast:
            return self.rule.cuts(tokens)
        if image_runs(tokens, self.rule.n_vocab):  # (never inside an image: docs/vision.md)
            return [p for p in range(1, len(tokens) + 1) if self.rule.image_floor(tokens, p) == p]
        return range(1, len(tokens) + 1)

    def spill_order(self) -> list[int]:
        """Every id, the most recently used last (the order to save their prefixes to
        the host tier in: it keeps the newest when it is full)."""
        return sorted(range(len(self._cached)), key=lambda i: self._used_at[i])

    def serves(self, seq_id: int, shared: int) -> bool:
        """Whether ``seq_id``'s cells give back its first ``shared`` tokens exactly (a
        sliding-window model: the window cells the tokens after them attend to are there)."""
        return self.host.serves(self._floor[seq_id], shared)

    def savable(self, seq_id: int) -> bool:
        """Whether ``seq_id`` caches a prefix worth saving to the host tier: one its cells
        give back exactly."""
        tokens = self._cached[seq_id]
        return bool(tokens) and self.host.keeps and self.serves(seq_id, len(tokens))

    def host_covers(self, tokens: list[int], salt: str = "") -> bool:
        """Whether the host tier already holds ``tokens`` of ``salt`` (as an entry or its
        prefix)."""
        return self.host.covers(tokens, self.host_cuts(tokens), salt=salt)

    def checkpoint(self, seq_id: int, keep: int = 0) -> int:
        """The prompt end of ``seq_id``'s last request, when its cells hold more than it
        (the idle recompute added the reply's pieces) and a host-memory state of all of
        them could not give it back: a sliding-window model's state keeps the window
        cells of its last ``window`` positions only, so the same prompt asked again
        would find nothing (measured: 4 of 5 prompts of 356–474 tokens with a
        160-token reply). Saved beside the longer prefix, as llama-server keeps
        checkpoints of its sliding-window slots. 0: none, or it is below ``keep`` (the
        cells the id's next sequence reuses: saving it needs the cells past it gone)."""
        tokens = self._cached[seq_id]
        end = self._prompt_end[seq_id]
        host = self.host
        if not host.window or not host.keeps or not keep <= end < len(tokens):
            return 0
        if host.usable(len(tokens), end, self._floor[seq_id]) or not self.serves(seq_id, end):
            return 0  # (the longer state gives it back; the cells cannot)
        return 0 if self.host_covers(tokens[:end], self._salt[seq_id]) else end

    # ------------------------------------------------------------ admission

    def take(self, seq_id: int, salt: str = "", *, marks: int = 0) -> None:
        """``seq_id``'s cells now belong to a running sequence of ``salt``, which keeps
        the id's window checkpoints up to ``marks`` tokens (the prefix it reuses). (Under
        the scheduler's lock: ``/health`` reads what the ids keep.)"""
        self.marks.cut(seq_id, marks)
        self._salt[seq_id] = salt
        self._clear_record(seq_id)

    # ------------------------------------------------------------ release

    def keep(
        self, *, cache_prompt: bool, failed: bool, computed: int, prefilled: int, cuts: list[int]
    ) -> int:
        """How many leading cells a finished sequence keeps: exact, the whole prompt
        pieces it holds (``prefilled``: its prompt tokens in cells; ``cuts``: its
        prompt's); fast, every cell it computed (``computed``, the reply's too); none
        after an error or with the cache off for it."""
        if not (self.enabled and cache_prompt and not failed):
            return 0
        return computed if self.fast else last_cut(cuts, prefilled)

    def forget(self, seq_id: int) -> None:
        """``seq_id`` keeps nothing (its cells are being cleared)."""
        self.marks.set(seq_id, [])
        self._clear_record(seq_id)

    def _clear_record(self, seq_id: int) -> None:
        """What the policy knows of ``seq_id``'s cells, cleared: no cached tokens, floor,
        prompt end, last logits or history."""
        self._cached[seq_id] = []
        self._floor[seq_id] = 0
        self._prompt_end[seq_id] = 0
        self._logits_at[seq_id] = 0
        self._history.pop(seq_id, None)

    def release(
        self,
        seq_id: int,
        prompt: list[int],
        generated: list[int],
        kept: int,
        *,
        finished: bool,
        floor: int = 0,
        logits: bool = False,
    ) -> None:
        """A sequence left ``seq_id`` with its first ``kept`` cells (``prompt`` then
        ``generated``), its sliding-window cells from position ``floor`` on;
        ``finished``: it ended on its own (stop or length), so its conversation is
        remembered for the idle recompute (when its cells give back what they keep: the
        pieces after them attend to those); ``logits``: the id keeps its prompt's last
        logits (a full hit's row, when every prompt cell is kept). The id becomes the
        most recently used."""
        if kept > len(prompt):
            self._cached[seq_id] = (prompt + generated)[:kept]
        else:
            self._cached[seq_id] = prompt[:kept]
        self._floor[seq_id] = floor if kept else 0
        self._prompt_end[seq_id] = min(kept, len(prompt))
        self._logits_at[seq_id] = len(prompt) if logits and kept >= len(prompt) and not self.fast else 0
        if self.idle_recompute and kept and finished and self.serves(seq_id, kept):
            history = prompt + generated + self.rule.continuation(prompt)
            cuts = self.rule.cuts(history)
            if cuts and cuts[-1] > kept:
                self._history[seq_id] = (history, cuts)
        self._uses += 1
        self._used_at[seq_id] = self._uses

    # ------------------------------------------------------------ idle recompute

    def next_recompute(self) -> Recompute | None:
        """The next piece of the most recently finished conversation; ``None`` (and the
        conversation dropped) when nothing whole is left of it. (Only while
        :attr:`pending`.)"""
        seq_id = max(self._history, key=lambda i: self._used_at[i])
        history, cuts = self._history[seq_id]
        start = len(self._cached[seq_id])
        end = next_cut(cuts, start, 0)
        if not end:  # (nothing left whole: done)
            del self._history[seq_id]
            return None
        return Recompute(seq_id, history, cuts, start, end)

    def recomputed(self, job: Recompute, floor: int | None = None) -> None:
        """``job``'s piece is in its id's cells, whose window cells now start at
        ``floor`` (``None``: unchanged — the window layers keep every cell)."""
        self._cached[job.seq_id] = job.history[: job.end]
        if floor is not None:
            self._floor[job.seq_id] = floor
        if job.end >= job.cuts[-1]:
            del self._history[job.seq_id]

    def drop_history(self, seq_id: int) -> None:
        """Leave ``seq_id``'s conversation (its recompute failed)."""
        self._history.pop(seq_id, None)

    def drop_histories(self) -> list[int]:
        """Leave every conversation; the ids they were on."""
        ids = list(self._history)
        self._history.clear()
        return ids
