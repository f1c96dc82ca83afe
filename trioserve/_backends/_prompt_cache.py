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


class HostCache:
    """Sequence states (``llama_state_seq_get_data``) of cached prefixes, in host memory.

    Holds at most ``budget`` bytes; an entry that does not fit alone is not kept. A
    prefix already held by a longer entry is not stored again."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
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
        return any(len(key) >= n and list(key[:n]) == tokens for key in self._entries)

    def put(self, tokens: list[int], state: bytes) -> None:
        if not tokens or len(state) > self.budget or self.covers(tokens):
            return
        key = tuple(tokens)
        # entries this one extends are redundant now
        for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
            self.bytes -= len(self._entries.pop(other))
        self._entries[key] = state
        self.bytes += len(state)
        self.saves += 1
        while self.bytes > self.budget:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= len(dropped)
            self.evictions += 1

    def best(self, prompt: list[int], limit: int, chunk: int) -> tuple[int, bytes] | None:
        """``(shared tokens, state)`` of the entry sharing the most whole chunks with
        ``prompt`` (at most ``limit`` tokens); ``None`` if none shares a chunk. The entry
        becomes the most recently used."""
        best_key: tuple[int, ...] | None = None
        best_shared = 0
        for key in self._entries:
            shared = shared_chunks(list(key[: limit + 1]), prompt, min(limit, len(key)), chunk)
            if shared > best_shared:
                best_key, best_shared = key, shared
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        return best_shared, self._entries[best_key]
