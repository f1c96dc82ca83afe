"""The prompt cache's bookkeeping (docs/prompt-cache.md): which cached prompt shares
the longest prefix of whole chunks with a new prompt, and the host-memory tier that
keeps prefixes evicted from KV cells under a byte budget, least recently used out
first. Pure Python: the scheduler thread owns it and does the llama.cpp calls."""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["HostCache", "shared_chunks"]


def shared_chunks(cached: list[int], prompt: list[int], limit: int, chunk: int) -> int:
    """How many leading tokens of ``prompt`` ``cached`` holds, in whole chunks, at most
    ``limit``."""
    n = 0
    while n + chunk <= limit and cached[n : n + chunk] == prompt[n : n + chunk]:
        n += chunk
    return n


def _chain(tokens: list[int] | tuple[int, ...], chunk: int, limit: int) -> list[int]:
    """The hashes of ``tokens``' whole-chunk prefixes, at most ``limit`` tokens: entry k
    identifies ``tokens[: (k + 1) * chunk]`` (each chained on the one before, so the
    whole list costs one pass over the tokens)."""
    hashes: list[int] = []
    h = 0
    for start in range(0, min(limit, len(tokens)) // chunk * chunk, chunk):
        h = hash((h, tuple(tokens[start : start + chunk])))
        hashes.append(h)
    return hashes


class HostCache:
    """Sequence states (``llama_state_seq_get_data``) of cached prefixes, in host memory.

    Holds at most ``budget`` bytes; an entry that does not fit alone is not kept. A
    prefix already held by a longer entry is not stored again. Entries are indexed by
    the hashes of their whole-chunk prefixes (``chunk`` tokens each), so finding the
    one that shares the most chunks with a prompt costs one pass over the prompt,
    however many entries there are."""

    def __init__(self, budget: int, *, chunk: int = 128) -> None:
        self.budget = budget
        self.chunk = chunk
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        #: prefix hash → the entries with that whole-chunk prefix
        self._index: dict[int, set[tuple[int, ...]]] = {}
        self.bytes = 0
        self.saves = 0
        self.restores = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        return sum(len(key) for key in self._entries)

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already holds ``tokens`` (as itself or as its prefix)."""
        n = len(tokens)
        if n and n % self.chunk == 0:
            keys = self._index.get(_chain(tokens, self.chunk, n)[-1], ())
            return any(list(key[:n]) == tokens for key in keys)
        return any(len(key) >= n and list(key[:n]) == tokens for key in self._entries)

    def _drop(self, key: tuple[int, ...]) -> bytes:
        for h in _chain(key, self.chunk, len(key)):
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[h]
        state = self._entries.pop(key)
        self.bytes -= len(state)
        return state

    def put(self, tokens: list[int], state: bytes) -> None:
        if not tokens or len(state) > self.budget or self.covers(tokens):
            return
        key = tuple(tokens)
        # entries this one extends are redundant now
        for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
            self._drop(other)
        self._entries[key] = state
        for h in _chain(key, self.chunk, len(key)):
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

    def best(self, prompt: list[int], limit: int, chunk: int) -> tuple[int, bytes] | None:
        """``(shared tokens, state)`` of the entry sharing the most whole chunks with
        ``prompt`` (at most ``limit`` tokens); ``None`` if none shares a chunk. The entry
        becomes the most recently used."""
        if chunk != self.chunk:
            raise ValueError(f"this cache is indexed by chunks of {self.chunk} tokens, not {chunk}")
        best_key: tuple[int, ...] | None = None
        best_shared = 0
        for k, h in enumerate(_chain(prompt, chunk, limit)):
            keys = self._index.get(h)
            if not keys:
                break
            best_key, best_shared = next(iter(keys)), (k + 1) * chunk
        if best_key is None:
            return None
        if list(best_key[:best_shared]) != prompt[:best_shared]:  # pragma: no cover - a hash collision
            best_key, best_shared = self._scan(prompt, limit)
            if best_key is None:
                return None
        self._entries.move_to_end(best_key)
        return best_shared, self._entries[best_key]

    def _scan(self, prompt: list[int], limit: int) -> tuple[tuple[int, ...] | None, int]:
        """:meth:`best` the slow way, entry by entry (only after a hash collision)."""
        best_key: tuple[int, ...] | None = None
        best_shared = 0
        for key in self._entries:
            shared = shared_chunks(list(key[: limit + 1]), prompt, min(limit, len(key)), self.chunk)
            if shared > best_shared:
                best_key, best_shared = key, shared
        return best_key, best_shared
