"""The prompt cache: what a sequence's cells keep, and the tiers a prompt's state is
restored from (docs/prompt-cache.md).

One job per module, from the face down::

    _cache_policy   CachePolicy: which id a prompt takes, what each id keeps, when a
                    state goes to the host or the disk tier (pure: no llama.cpp, no Trio)
    _placement      Placer: which free id a new prompt takes, how much of it is reused
    _prompt_cache   the host-memory tier (HostCache, its HostBudget shared by the models)
                    and the longest shared prefix of whole pieces
    _disk_cache     the disk tier's store (DiskStore: one directory per server) and the
                    model fingerprint that names a directory
    _disk_tier      one model's entries on disk: index, lookups, restores
    _disk_format    an entry's bytes: header, salt tag, chained prefix digests
    _pieces         where a prompt is cut into decode calls (PieceRule)
    _switch_salt    salts that change along a prompt (activated LoRA)
    _window_marks   checkpoints of a sequence's sliding-window cells
    _cache_stats    CacheStats, the snapshot for /health and /metrics
    _memory         StateBuffer: a state's bytes in memory that goes back to the system

Imports :mod:`trioserve._core` at most: nothing of a backend, of llama.cpp or of Trio.
"""

from ._cache_policy import CachePolicy, WindowMark, WindowMarks
from ._cache_stats import CacheStats
from ._disk_cache import DiskEntry, DiskStore, DiskTier, fingerprint, gguf_digest
from ._memory import StateBuffer, trim_heap
from ._pieces import PieceRule, classify_piece, host_rule, make_rule
from ._prompt_cache import HostBudget, HostCache
from ._switch_salt import final_salt, switch_cuts, switched_salt

__all__ = [
    "CachePolicy",
    "CacheStats",
    "DiskEntry",
    "DiskStore",
    "DiskTier",
    "HostBudget",
    "HostCache",
    "PieceRule",
    "StateBuffer",
    "WindowMark",
    "WindowMarks",
    "classify_piece",
    "final_salt",
    "fingerprint",
    "gguf_digest",
    "host_rule",
    "make_rule",
    "switch_cuts",
    "switched_salt",
    "trim_heap",
]
