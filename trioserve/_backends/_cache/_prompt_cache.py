"""The prompt cache's bookkeeping (docs/prompt-cache.md): which cached prompt shares
the longest prefix of whole pieces with a new prompt, and the host-memory tier that
keeps prefixes evicted from KV cells under a byte budget, least recently used out
first. Pieces end at the prompt's cuts (:mod:`._pieces`: canonical and causal, so the
cuts of a shared prefix are the same in both). Pure Python: the scheduler thread owns
it and does the llama.cpp calls.

Every entry carries a *salt* (``GenerationRequest.cache_salt``: empty, or derived from
the request's API key): a prompt finds only the entries saved under its own salt, so
one key cannot learn, from ``cached_tokens`` or the time to first token, what another
key's prompts were (docs/operations.md, "What one key can learn"). The tiers of one
server's models share one byte budget (:class:`HostBudget`: ``--cache-ram`` is the
total), the entries of unloaded models going first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._disk_cache import DiskEntry, DiskTier
from ._memory import StateBuffer

__all__ = ["HostBudget", "HostCache", "shared_prefix"]


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


def _chain(tokens: Sequence[int], cuts: Sequence[int], limit: int, salt: str = "") -> list[tuple[int, int]]:
    """``(cut, hash)`` of ``tokens``' prefixes ending at ``cuts`` (at most ``limit``):
    each hash identifies ``tokens[:cut]`` under ``salt`` (chained on the one before, so
    the whole list costs one pass over the tokens)."""
    hashes: list[tuple[int, int]] = []
    h = hash(("salt", salt)) if salt else 0
    start = 0
    for c in cuts:
        if c > limit or c > len(tokens):
            break
        h = hash((h, tuple(tokens[start:c])))
        hashes.append((c, h))
        start = c
    return hashes


#: an entry's key: its salt and its tokens
_Key = tuple[str, tuple[int, ...]]


@dataclass(slots=True)
class _Entry:
    state: StateBuffer | bytes
    #: the hashes of its prefixes at its cuts (under its salt)
    hashes: list[int]
    #: the first position whose sliding-window cells the state holds
    start: int
    #: the budget's clock at its last use (save or restore): the LRU order across models
    used: int


class HostBudget:
    """One byte budget for the host tiers of a server's models: ``--cache-ram`` is the
    total, however many models the server has (docs/prompt-cache.md, "One budget").

    When a save takes the total over it, entries go, least recently used first — the
    entries of models that are not loaded (:attr:`HostCache.active` false) before any
    loaded model's. Thread-safe: each loaded model's scheduler thread saves into its own
    tier, and an eviction may take another model's entry, so every tier's reads and
    writes hold :attr:`lock` (dictionary work only: the states are bytes already)."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the host-memory budget must be at least 0, got {budget}")
        self.budget = budget
        self.lock = threading.RLock()
        #: bytes held by every tier
        self.bytes = 0
        self._tiers: list[HostCache] = []
        self._clock = 0

    @property
    def tiers(self) -> int:
        """The tiers sharing the budget (one per model that has loaded)."""
        return len(self._tiers)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _fit(self) -> None:
        """Evict until the tiers fit the budget: unloaded models' entries first, then the
        least recently used of all. (Under the lock.)"""
        while self.bytes > self.budget:
            held = [tier for tier in self._tiers if tier._entries]
            if not held:  # pragma: no cover - (bytes are only held by entries)
                return
            victim = min(held, key=lambda tier: (tier.active, tier._oldest()))
            victim._evict_oldest()


class HostCache:
    """Sequence states (``llama_state_seq_get_data``) of cached prefixes, in host memory.

    Holds at most ``budget`` bytes — this model's cap, within its :class:`HostBudget`
    (``pool``; none given: a budget of its own); an entry that does not fit alone is not
    kept. A prefix already held by a longer entry of the same salt is not stored again.
    Entries are indexed by the hashes of their prefixes at their cuts (under their salt),
    so finding the one that shares the most pieces with a prompt costs one pass over the
    prompt, however many entries there are. ``rule`` names the cut (:attr:`PieceRule.key`,
    or ``"token"`` in fast mode: every position): every call passes cuts made by that rule.

    ``kv_types``: the K/V cache types of the cells its states hold (``"f16/f16"``).

    ``salt``: an entry serves only prompts of the same salt (``GenerationRequest.cache_salt``).

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

    def __init__(
        self,
        budget: int,
        *,
        rule: str,
        window: int = 0,
        pool: HostBudget | None = None,
        kv_types: str = "f16/f16",
    ) -> None:
        self._own_pool = pool is None
        self.pool = HostBudget(budget) if pool is None else pool
        #: this model's cap (the pool's budget bounds it too)
        self.cap = budget
        self.rule = rule
        #: the KV cache types its states hold (``LlamaSettings.kv_types``): a state is
        #: restored only into cells of the same types
        self.kv_types = kv_types
        self.window = window
        #: its model is loaded: an unloaded model's entries are evicted first
        self.active = True
        #: (salt, entry tokens) → the entry, least recently used first
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        #: prefix hash → the entries with that prefix
        self._index: dict[int, set[_Key]] = {}
        self.bytes = 0
        self.saves = 0
        self.restores = 0
        self.evictions = 0
        #: the disk tier under this one (``--cache-dir``; docs/prompt-cache.md, "On
        #: disk"): every state offered here is written there too, and a prompt it holds
        #: more of is restored from it
        self.disk: DiskTier | None = None
        #: why the disk tier asked for is off (its directory is not writable), or ``None``
        self.disk_off: str | None = None
        with self.pool.lock:
            self.pool._tiers.append(self)

    @property
    def keeps(self) -> bool:
        """Whether a saved state is kept anywhere: host memory, or the disk under it."""
        return bool(self.budget) or self.disk is not None

    @property
    def budget(self) -> int:
        """The bytes this tier may hold: its cap, within the shared budget."""
        return min(self.cap, self.pool.budget)

    @budget.setter
    def budget(self, value: int) -> None:
        self.cap = value
        if self._own_pool:
            self.pool.budget = value

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
        return sum(len(tokens) for _, tokens in list(self._entries))

    def covers(self, tokens: Sequence[int], cuts: Sequence[int], *, salt: str = "") -> bool:
        """Whether an entry of ``salt`` already holds ``tokens`` (as itself or as its
        prefix) and can give them back (:meth:`serves`)."""
        with self.pool.lock:
            return self._covers(tokens, cuts, salt)

    def _covers(self, tokens: Sequence[int], cuts: Sequence[int], salt: str) -> bool:
        n = len(tokens)
        wanted = tuple(tokens)
        chain = _chain(tokens, cuts, n, salt)
        if chain and chain[-1][0] == n:
            keys: Iterable[_Key] = self._index.get(chain[-1][1], ())
        else:
            keys = (key for key in self._entries if key[0] == salt and len(key[1]) >= n)
        return any(
            key[0] == salt and key[1][:n] == wanted and self.serves(self._entries[key].start, n)
            for key in keys
        )

    def _drop(self, key: _Key) -> StateBuffer | bytes:
        entry = self._entries.pop(key)
        for h in entry.hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[h]
        self.bytes -= len(entry.state)
        self.pool.bytes -= len(entry.state)
        return entry.state

    def _oldest(self) -> int:
        """When the least recently used entry was last used (there is one)."""
        return next(iter(self._entries.values())).used

    def _evict_oldest(self) -> None:
        self._drop(next(iter(self._entries)))
        self.evictions += 1

    def put(
        self,
        tokens: Sequence[int],
        cuts: Sequence[int],
        state: StateBuffer | bytes,
        *,
        floor: int = 0,
        salt: str = "",
    ) -> bool:
        """Keep ``state``, the cells of ``tokens`` (which end on one of its ``cuts``),
        saved from a sequence whose sliding-window cells started at position ``floor``,
        for the prompts of ``salt``. Whether it is kept: not when it cannot give back
        ``tokens`` themselves (its window cells start too late: :meth:`serves`), is
        larger than the budget, or is already covered. Over the budget, this tier's least
        recently used entries go (its cap), then the shared budget's (:class:`HostBudget`)."""
        key: _Key = (salt, tuple(tokens))
        start = self.floor(len(tokens), floor)
        if not tokens or not self.serves(start, len(tokens)):
            return False
        on_disk = self.disk is not None and self.disk.put(tokens, cuts, state, start=start, salt=salt)
        if len(state) > self.budget:
            return on_disk
        with self.pool.lock:
            if self._covers(key[1], cuts, salt):
                return on_disk
            # entries of this salt it extends (and gives back exactly) are redundant now
            n = len(tokens)
            for other in [
                k
                for k in self._entries
                if k[0] == salt
                and len(k[1]) < n
                and key[1][: len(k[1])] == k[1]
                and self.serves(start, len(k[1]))
            ]:
                self._drop(other)
            hashes = [h for _, h in _chain(key[1], cuts, n, salt)]
            self._entries[key] = _Entry(state, hashes, start, self.pool._tick())
            for h in hashes:
                self._index.setdefault(h, set()).add(key)
            self.bytes += len(state)
            self.pool.bytes += len(state)
            self.saves += 1
            while self.bytes > self.cap:
                self._evict_oldest()
            self.pool._fit()
        return True

    def shrink(self) -> None:
        """Drop the least recently used entries until the bytes held fit the budget
        (after the budget changed)."""
        with self.pool.lock:
            while self.bytes > self.cap and self._entries:
                self._evict_oldest()
            self.pool._fit()

    def clear(self) -> None:
        """Drop every entry; the tier stays in its shared budget (a test starts from
        nothing cached: ``LlamaBackend.clear_cache``)."""
        with self.pool.lock:
            for key in list(self._entries):
                self._drop(key)

    def close(self) -> None:
        """Drop every entry and leave the shared budget (the model's file changed)."""
        with self.pool.lock:
            for key in list(self._entries):
                self._drop(key)
            if self in self.pool._tiers:
                self.pool._tiers.remove(self)

    def best(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int, *, salt: str = ""
    ) -> tuple[int, StateBuffer | bytes | DiskEntry] | None:
        """``(shared tokens, state)`` of the entry of ``salt`` sharing the most whole
        pieces with ``prompt`` (``cuts``: its cuts; at most ``limit`` tokens); ``None``
        if none shares a piece. The entry becomes the most recently used. When the disk
        tier holds more of the prompt than host memory, its entry (a
        :class:`~._disk_cache.DiskEntry`, read when it is restored)."""
        found = self._best_in_memory(prompt, cuts, limit, salt) if self.budget else None
        if self.disk is not None and (found is None or found[0] < limit):
            on_disk = self.disk.best(prompt, cuts, limit, salt=salt)
            if on_disk is not None and (found is None or on_disk[0] > found[0]):
                return on_disk
        return found

    def _best_in_memory(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int, salt: str
    ) -> tuple[int, StateBuffer | bytes] | None:
        with self.pool.lock:
            best_key: _Key | None = None
            best_shared = 0
            for c, h in _chain(prompt, cuts, limit, salt):
                keys = self._index.get(h)
                if not keys:
                    break
                usable = next(
                    (key for key in keys if key[0] == salt and self.serves(self._entries[key].start, c)),
                    None,
                )
                if usable is not None:
                    best_key, best_shared = usable, c
            if best_key is None:
                return None
            collided = list(best_key[1][:best_shared]) != list(prompt[:best_shared])
            if collided:  # pragma: no cover - a hash collision
                best_key, best_shared = self._scan(prompt, cuts, limit, salt)
                if best_key is None:
                    return None
            self._entries.move_to_end(best_key)
            entry = self._entries[best_key]
            entry.used = self.pool._tick()
            return best_shared, entry.state

    def _scan(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int, salt: str
    ) -> tuple[_Key | None, int]:
        """:meth:`best` the slow way, entry by entry (only after a hash collision)."""
        best_key: _Key | None = None
        best_shared = 0
        for key, entry in self._entries.items():
            if key[0] != salt:
                continue
            tokens = key[1]
            shared = shared_prefix(list(tokens[:limit]), list(prompt), cuts, min(limit, len(tokens)))
            if shared > best_shared and self.serves(entry.start, shared):
                best_key, best_shared = key, shared
        return best_key, best_shared
