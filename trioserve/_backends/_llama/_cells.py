"""Which sequence ids (and so which KV cells) are free, and who holds the others.

Pure bookkeeping, no llama.cpp, numpy or Trio (an import-linter contract): the loop
takes an id at admission and gives it back when it releases the sequence; what the
cells of each id *keep* for the prompt cache is :class:`~.._cache._cache_policy.CachePolicy`'s.
Callers hold the scheduler's lock around every change (the Trio side reads it for
``/health`` and ``/metrics``)."""

from __future__ import annotations

__all__ = ["Cells"]


class Cells:
    """The ids of a context of ``slots`` sequences; each id owns ``n_ctx`` cells.

    The free ids are kept in the order they were freed: the policy breaks ties by
    least recent use, and that order is its input."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slots = slots
        self._free = list(range(slots))

    @property
    def free(self) -> list[int]:
        """The free ids, least recently freed first (a copy)."""
        return list(self._free)

    def __len__(self) -> int:
        """How many ids are free."""
        return len(self._free)

    def is_free(self, seq_id: int) -> bool:
        return seq_id in self._free

    def take(self, seq_id: int) -> None:
        """Give ``seq_id`` to a sequence; it must be free."""
        if seq_id not in self._free:
            raise ValueError(f"sequence id {seq_id} is not free")
        self._free.remove(seq_id)

    def give_back(self, seq_id: int) -> None:
        """``seq_id``'s sequence has left (its cells hold only what the cache keeps).
        Giving back a free id changes nothing."""
        if not 0 <= seq_id < self.slots:
            raise ValueError(f"sequence id {seq_id} is not one of this context's")
        if seq_id not in self._free:
            self._free.append(seq_id)

    @property
    def busy(self) -> int:
        """How many ids a sequence holds."""
        return self.slots - len(self._free)
