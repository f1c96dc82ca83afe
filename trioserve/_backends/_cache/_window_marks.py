"""Checkpoints of a sequence's sliding-window cells (docs/prompt-cache.md, "Window
layers"): with the window layers kept to their window (``--no-swa-full``), an id's
cells give back a prefix only while the window cells the tokens after it attend to
are still there — a conversation that ran more than about a batch past a shared head
loses them. A mark is the window layers' state (``llama_state_seq_get_data_ext`` with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) taken right after a prompt piece that ends on
a cut; the full-attention layers keep every cell anyway, so restoring the mark's
window cells and removing the cells past its end gives back that prefix exactly —
the same values a fresh evaluation computed, in the same cells. llama-server keeps
such checkpoints per slot (``--ctx-checkpoints``).

Pure bookkeeping (the state is opaque here): which cuts get a mark, which to drop when
an id holds too many, and which mark serves a prefix."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WindowMark", "WindowMarks"]


@dataclass(frozen=True, slots=True)
class WindowMark:
    """An id's window cells at ``end`` (a cut of the prompt it was taken in): the state
    (``size`` bytes) holds the window cells from position ``floor`` on."""

    end: int
    floor: int
    state: object
    size: int


class WindowMarks:
    """Every id's marks, oldest first. ``keep``: at most that many an id (0: none taken);
    ``step``: a mark is taken at a turn's start, at a prompt's last cut, and at any cut
    at least ``step`` tokens past the id's last mark."""

    def __init__(self, slots: int, *, keep: int, step: int) -> None:
        self.keep = keep
        self.step = step
        self._marks: list[list[WindowMark]] = [[] for _ in range(slots)]
        #: marks restored (a prefix given back that the cells alone could not)
        self.restores = 0

    def of(self, seq_id: int) -> list[WindowMark]:
        """``seq_id``'s marks, oldest first (a copy)."""
        return list(self._marks[seq_id])

    @property
    def count(self) -> int:
        return sum(len(marks) for marks in self._marks)

    @property
    def bytes(self) -> int:
        return sum(mark.size for marks in self._marks for mark in marks)

    def stats(self, seconds: float) -> dict[str, object]:
        """``/health``'s ``cache.window_checkpoints`` (``seconds``: spent taking them)."""
        return {
            "per_sequence": self.keep,
            "step": self.step,
            "count": self.count,
            "bytes": self.bytes,
            "restores": self.restores,
            "seconds": round(seconds, 6),
        }

    def wants(self, seq_id: int, end: int, last_cut: int, *, turn: bool) -> bool:
        """Whether a prompt piece that just ended on the cut ``end`` (``last_cut``: the
        prompt's last; ``turn``: a turn starts there) should leave a mark: at a turn's
        start, at the prompt's last cut, and ``step`` tokens past the id's last mark."""
        if not self.keep or end <= 0:
            return False
        marks = self._marks[seq_id]
        last = marks[-1].end if marks else 0
        if end <= last:
            return False
        return turn or end == last_cut or end - last >= self.step

    def add(self, seq_id: int, mark: WindowMark) -> None:
        """Keep ``mark`` (taken past the id's others); over ``keep``, the mark whose loss
        leaves the shortest gap between its neighbours goes (never the first nor the
        newest: the first serves the shortest shared heads, the newest the next turn)."""
        marks = self._marks[seq_id]
        marks.append(mark)
        while len(marks) > self.keep:
            if len(marks) <= 2:
                del marks[0]
                continue
            gaps = [marks[i + 1].end - marks[i - 1].end for i in range(1, len(marks) - 1)]
            del marks[1 + gaps.index(min(gaps))]

    def cut(self, seq_id: int, keep: int) -> None:
        """``seq_id`` keeps its cells below ``keep`` only: marks past it go."""
        self._marks[seq_id] = [m for m in self._marks[seq_id] if m.end <= keep]

    def set(self, seq_id: int, marks: list[WindowMark]) -> None:
        self._marks[seq_id] = list(marks)

    def serving(self, seq_id: int, shared: int, window: int) -> WindowMark | None:
        """The longest of ``seq_id``'s marks that gives back a prefix of at most
        ``shared`` tokens: its window cells reach down to what the tokens after its
        end attend to."""
        for mark in reversed(self._marks[seq_id]):
            if mark.end <= shared and mark.floor <= max(0, mark.end - window + 1):
                return mark
        return None
