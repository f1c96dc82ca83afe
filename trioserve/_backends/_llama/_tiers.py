"""The prompt cache's tiers below the KV cells: a small store protocol
(:class:`StateTier`) that the scheduler's cell manager saves evicted prefixes to and
restores them from. Today's tier is host memory (:class:`~.._cache._prompt_cache.HostCache`,
``--cache-ram``); a disk tier plugs in behind the same protocol.

Pure: no llama.cpp, numpy or Trio (an import-linter contract). A sequence state is an
opaque buffer to a tier (``StateBuffer`` or ``bytes``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

# the tier modules themselves, not the cache's face: the face brings the cut (numpy)
from .._cache._disk_cache import DiskTier
from .._cache._prompt_cache import HostCache

__all__ = ["StateTier", "host_tier"]


class StateTier(Protocol):
    """Where the states of cached prefixes go when their cells are needed.

    Keys are token prefixes ending on the rule's cuts, under a salt (only requests of
    the same ``cache_salt`` share them); ``floor`` is the first position whose
    sliding-window cells the state holds."""

    #: bytes the tier may hold (0: off)
    budget: int
    #: the model's sliding attention window (0: none): a saved state keeps only its last cells
    window: int
    #: the disk tier under this one (``cache_dir``; ``None``: none)
    disk: DiskTier | None
    #: counters for ``/health`` and ``/metrics``
    saves: int
    restores: int
    evictions: int

    def serves(self, floor: int, shared: int) -> bool:
        """Whether cells whose window layers start at ``floor`` give back ``shared`` tokens."""
        ...

    def floor(self, length: int, floor: int = 0) -> int:
        """Where the window cells of a state of ``length`` tokens start."""
        ...

    @property
    def keeps(self) -> bool:
        """Whether a saved state is kept anywhere (this tier, or the disk under it)."""
        ...

    def put(
        self, tokens: Sequence[int], cuts: Sequence[int], state: Any, *, floor: int = 0, salt: str = ""
    ) -> bool:
        """Keep ``state``, the cells of ``tokens``; False if it does not fit."""
        ...

    def covers(self, tokens: Sequence[int], cuts: Sequence[int], *, salt: str = "") -> bool:
        """Whether the tier already holds a state of ``tokens``."""
        ...

    def __len__(self) -> int:
        """The prefixes held."""
        ...


def host_tier(
    given: HostCache | None,
    *,
    rule: str,
    budget: int,
    enabled: bool,
    window: int,
    kv_types: str = "f16/f16",
) -> HostCache:
    """The host tier a new context uses: ``given`` (a registry entry's, which outlives
    an unload: what the model cached before, under the server's one budget) when it is
    indexed by the same ``rule``, holds cells of the same ``kv_types`` and the cache is
    on; else a new one."""
    if given is not None and given.kv_types != kv_types and not len(given):
        # (made before the load chose the window layers' layout: it holds nothing yet)
        given.kv_types = kv_types
    if given is not None and given.rule == rule and given.kv_types == kv_types and enabled:
        given.budget = budget
        given.active = True  # (an unloaded model's entries are the first to go)
        given.shrink()
        host = given
    else:
        host = HostCache(budget if enabled else 0, rule=rule, kv_types=kv_types)
    #: the sliding attention window: a saved state keeps only its last cells
    host.window = window
    return host
