"""The prompt cache's bookkeeping (docs/prompt-cache.md): which cached prompt shares
the longest prefix of whole pieces with a new prompt, and the host-memory tier that
keeps prefixes evicted from KV cells under a byte budget, least recently used out
first. Pieces end at the prompt's cuts (:mod:`._pieces`: canonical and causal, so the
cuts of a shared prefix are the same in both). Pure Python: the scheduler thread owns
it and does the llama.cpp calls."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

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
    ``len(entry) - window <= n - window + 1``, i.e. (almost) whole."""

    def __init__(self, budget: int, *, rule: str, window: int = 0) -> None:
        self.budget = budget
        self.rule = rule
        self.window = window
        #: entry tokens → (state, the hashes of its prefixes at its cuts)
        self._entries: OrderedDict[tuple[int, ...], tuple[bytes, list[int]]] = OrderedDict()
        #: prefix hash → the entries with that prefix
        self._index: dict[int, set[tuple[int, ...]]] = {}
        self.bytes = 0
        self.saves = 0
        self.restores = 0
        self.evictions = 0

    def usable(self, length: int, shared: int) -> bool:
        """Whether an entry of ``length`` tokens restores its first ``shared`` exactly
        (every cell the tokens after them attend to is in the state)."""
        if not self.window:
            return True
        return max(0, length - self.window) <= max(0, shared - self.window + 1)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(key) for key in self._entries)

    def covers(self, tokens: Sequence[int], cuts: Sequence[int]) -> bool:
        """Whether an entry already holds ``tokens`` (as itself or as its prefix)."""
        n = len(tokens)
        chain = _chain(tokens, cuts, n)
        if chain and chain[-1][0] == n:
            keys = self._index.get(chain[-1][1], ())
            return any(key[:n] == tuple(tokens) for key in keys)
        wanted = tuple(tokens)
        return any(len(key) >= n and key[:n] == wanted for key in self._entries)

    def _drop(self, key: tuple[int, ...]) -> bytes:
        state, hashes = self._entries.pop(key)
        for h in hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[h]
        self.bytes -= len(state)
        return state

    def put(self, tokens: Sequence[int], cuts: Sequence[int], state: bytes) -> None:
        """Keep ``state``, the cells of ``tokens`` (which end on one of its ``cuts``)."""
        if not tokens or len(state) > self.budget or self.covers(tokens, cuts):
            return
        key = tuple(tokens)
        # entries this one extends are redundant now
        for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
            self._drop(other)
        hashes = [h for _, h in _chain(key, cuts, len(key))]
        self._entries[key] = (state, hashes)
        for h in hashes:
            self._index.setdefault(h, set()).add(key)
        self.bytes += len(state)
        self.saves += 1
        while self.bytes > self.budget:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

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
            usable = next((key for key in keys if self.usable(len(key), c)), None)
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
            if shared > best_shared and self.usable(len(key), shared):
                best_key, best_shared = key, shared
        return best_key, best_shared
