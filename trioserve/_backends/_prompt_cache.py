"""The prompt cache's bookkeeping (docs/prompt-cache.md): which cached prompt shares
the longest prefix of whole pieces with a new prompt, and the host-memory tier that
keeps prefixes evicted from KV cells under a byte budget, least recently used out
first. Pieces end at the prompt's cuts (:mod:`._pieces`: canonical and causal, so the
cuts of a shared prefix are the same in both). Pure Python: the scheduler thread owns
it and does the llama.cpp calls."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["HostCache", "shared_prefix"]


def shared_prefix(cached: Sequence[int], prompt: Sequence[int], cuts: Sequence[int], limit: int) -> int:
    """How many leading tokens of ``prompt`` ``cached`` holds, in whole pieces: the
    longest cut ``c`` of ``prompt`` (``cuts``, ascending), at most ``limit``, with
    ``cached[:c] == prompt[:c]``."""
    n = 0
    for c in cuts:
        if c > limit or cached[n:c] != prompt[n:c]:
            break
        n = c
    return n


def _chain(tokens: Sequence[int], cuts: Sequence[int], limit: int) -> list[tuple[int, int]]:
    """``(cut, hash)`` of ``tokens``' prefixes ending at ``cuts`` (at most ``limit``):
    each hash identifies ``tokens[:cut]`` (chained on the one before, so the whole list
    costs one pass over the tokens)."""
    hashes: list[tuple[int, int]] = []
    h = 0
    start = 0
    for c in cuts:
        if c > limit or c > len(tokens):
            break
        h = hash((h, tuple(tokens[start:c])))
        hashes.append((c, h))
        start = c
    return hashes


class HostCache:
    """Sequence states (``llama_state_seq_get_data``) of cached prefixes, in host memory.

    Holds at most ``budget`` bytes; an entry that does not fit alone is not kept. A
    prefix already held by a longer entry is not stored again. Entries are indexed by
    the hashes of their prefixes at their cuts, so finding the one that shares the most
    pieces with a prompt costs one pass over the prompt, however many entries there are.
    ``rule`` names the cut (:attr:`PieceRule.key`, or ``"token"`` in fast mode: every
    position): every call passes cuts made by that rule.

    ``window``: the model's sliding attention window (``llama_model_n_swa``; 0: none).
    A saved state keeps a sliding-window layer's cells only for the last ``window``
    positions (measured: a 689-token state restored starts its window cells at 177), so
    an entry longer than the window restores a prefix exactly only when the tokens after
    the prefix see no position the state dropped: it serves ``n`` shared tokens only if
    ``len(entry) - window <= n - window + 1``, i.e. (almost) whole. And a sequence whose
    cells were themselves set from a state (a restore, an ``n`` > 1 choice's copy of its
    leader's prompt) lacks the window cells below that state's own start: ``put`` takes
    that start (``floor``), and an entry that cannot serve even its own tokens is not
    kept — it would be indexed under prefixes it cannot give back."""

    def __init__(self, budget: int, *, rule: str, window: int = 0) -> None:
        self.budget = budget
        self.rule = rule
        self.window = window
        #: entry tokens → (state, the hashes of its prefixes at its cuts, the first
        #: position whose sliding-window cells the state holds)
        self._entries: OrderedDict[tuple[int, ...], tuple[bytes, list[int], int]] = OrderedDict()
        #: prefix hash → the entries with that prefix
        self._index: dict[int, set[tuple[int, ...]]] = {}
        self.bytes = 0
        self.saves = 0
        self.restores = 0
        self.evictions = 0

    def serves(self, floor: int, shared: int) -> bool:
        """Whether cells whose sliding-window layers start at position ``floor`` serve
        their first ``shared`` tokens exactly: the tokens after them attend to the
        positions from ``shared - window + 1`` on, and every one of those is there."""
        return not self.window or floor <= max(0, shared - self.window + 1)

    def floor(self, length: int, floor: int = 0) -> int:
        """Where the sliding-window cells of a state of ``length`` tokens start: at most
        its last ``window`` positions are written, and none below ``floor`` (the first
        window position the saved sequence held)."""
        return max(floor, length - self.window, 0) if self.window else 0

    def usable(self, length: int, shared: int, floor: int = 0) -> bool:
        """Whether an entry of ``length`` tokens (saved from cells whose window layers
        started at ``floor``) restores its first ``shared`` exactly (every cell the
        tokens after them attend to is in the state)."""
        return self.serves(self.floor(length, floor), shared)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(key) for key in self._entries)

    def covers(self, tokens: Sequence[int], cuts: Sequence[int]) -> bool:
        """Whether an entry already holds ``tokens`` (as itself or as its prefix) and can
        give them back (:meth:`serves`)."""
        n = len(tokens)
        wanted = tuple(tokens)
        chain = _chain(tokens, cuts, n)
        if chain and chain[-1][0] == n:
            keys: Iterable[tuple[int, ...]] = self._index.get(chain[-1][1], ())
        else:
            keys = (key for key in self._entries if len(key) >= n)
        return any(key[:n] == wanted and self.serves(self._entries[key][2], n) for key in keys)

    def _drop(self, key: tuple[int, ...]) -> bytes:
        state, hashes, _ = self._entries.pop(key)
        for h in hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[h]
        self.bytes -= len(state)
        return state

    def put(self, tokens: Sequence[int], cuts: Sequence[int], state: bytes, *, floor: int = 0) -> bool:
        """Keep ``state``, the cells of ``tokens`` (which end on one of its ``cuts``),
        saved from a sequence whose sliding-window cells started at position ``floor``.
        Whether it is kept: not when it cannot give back ``tokens`` themselves (its
        window cells start too late: :meth:`serves`), is larger than the budget, or is
        already covered."""
        key = tuple(tokens)
        start = self.floor(len(key), floor)
        if not key or len(state) > self.budget or not self.serves(start, len(key)):
            return False
        if self.covers(key, cuts):
            return False
        # entries this one extends (and gives back exactly) are redundant now
        for other in [
            k
            for k in self._entries
            if len(k) < len(key) and key[: len(k)] == k and self.serves(start, len(k))
        ]:
            self._drop(other)
        hashes = [h for _, h in _chain(key, cuts, len(key))]
        self._entries[key] = (state, hashes, start)
        for h in hashes:
            self._index.setdefault(h, set()).add(key)
        self.bytes += len(state)
        self.saves += 1
        while self.bytes > self.budget:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return True

    def shrink(self) -> None:
        """Drop the least recently used entries until the bytes held fit the budget
        (after the budget changed)."""
        while self.bytes > self.budget and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def best(self, prompt: Sequence[int], cuts: Sequence[int], limit: int) -> tuple[int, bytes] | None:
        """``(shared tokens, state)`` of the entry sharing the most whole pieces with
        ``prompt`` (``cuts``: its cuts; at most ``limit`` tokens); ``None`` if none shares
        a piece. The entry becomes the most recently used."""
        best_key: tuple[int, ...] | None = None
        best_shared = 0
        for c, h in _chain(prompt, cuts, limit):
            keys = self._index.get(h)
            if not keys:
                break
            usable = next((key for key in keys if self.serves(self._entries[key][2], c)), None)
            if usable is not None:
                best_key, best_shared = usable, c
        if best_key is None:
            return None
        if list(best_key[:best_shared]) != list(prompt[:best_shared]):  # pragma: no cover - a hash collision
            best_key, best_shared = self._scan(prompt, cuts, limit)
            if best_key is None:
                return None
        self._entries.move_to_end(best_key)
        return best_shared, self._entries[best_key][0]

    def _scan(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int
    ) -> tuple[tuple[int, ...] | None, int]:
        """:meth:`best` the slow way, entry by entry (only after a hash collision)."""
        best_key: tuple[int, ...] | None = None
        best_shared = 0
        for key in self._entries:
            shared = shared_prefix(list(key[:limit]), list(prompt), cuts, min(limit, len(key)))
            if shared > best_shared and self.serves(self._entries[key][2], shared):
                best_key, best_shared = key, shared
        return best_key, best_shared
