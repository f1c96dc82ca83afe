"""A snapshot of the prompt cache for ``/health`` and ``/metrics`` (:class:`CacheStats`):
what the ids keep, the host tier, the idle recompute, the disk tier and the window
checkpoints — read by ``_llama/_stats.py``, written out by :meth:`CacheStats.as_dict`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    """A snapshot of the prompt cache, for ``/health`` (:meth:`as_dict`)."""

    enabled: bool
    fast: bool
    chunk: int
    piece_rule: str
    #: per sequence id: the prompt tokens it keeps (``None``: running a request)
    sequences: tuple[int | None, ...]
    kv_bytes_per_token: float
    ram_budget_bytes: int
    ram_bytes: int
    ram_prefixes: int
    ram_saves: int
    ram_restores: int
    ram_evictions: int
    #: the budget this tier shares with the other models' (``HostBudget``): bytes held
    #: by all of them, the budget, and how many models' tiers it holds
    ram_shared_bytes: int = 0
    ram_shared_budget_bytes: int = 0
    ram_shared_models: int = 1
    save_seconds: float
    restore_seconds: float
    #: full hits: prompts all cached with their last logits, first token with no call
    whole_hits: int = 0
    idle_recompute: bool
    idle_chunks: int
    idle_tokens: int
    idle_aborted: int
    idle_pending: int
    #: the cut rule's key (part of every tier's fingerprint) and its deep pieces: past
    #: ``deep_from`` tokens a piece ends at a turn header or after ``deep_piece`` (0: none)
    piece_rule_key: str = ""
    deep_from: int = 0
    deep_piece: int = 0
    #: the disk tier (``DiskTier.stats``), ``None`` without one
    disk: dict[str, object] | None = None
    #: the window cells' checkpoints (``WindowMarks.stats``), ``None`` without them
    window: dict[str, object] | None = None
    #: the window layers' rings (``--no-swa-full``): cells a sequence, trims laid out
    #: again and their time (``WindowRing.stats``), ``None`` with every cell kept
    ring: dict[str, object] | None = None

    @property
    def tokens(self) -> int:
        """The prompt tokens the idle sequence ids keep."""
        return sum(n for n in self.sequences if n)

    def as_dict(self) -> dict[str, object]:
        """The ``cache`` object of ``/health`` (``LlamaBackend.cache_stats``)."""
        tokens = self.tokens
        return {
            "enabled": self.enabled,
            "mode": "fast" if self.fast else "exact",
            "chunk": self.chunk,
            "piece_rule": self.piece_rule,
            "piece_rule_key": self.piece_rule_key,
            "deep_pieces": {"from": self.deep_from, "piece": self.deep_piece} if self.deep_piece else None,
            "tokens": tokens,
            "kv_bytes": int(tokens * self.kv_bytes_per_token),
            #: per sequence id: the prompt tokens it keeps (``null``: running a request)
            "sequences": list(self.sequences),
            "ram": {
                "budget_bytes": self.ram_budget_bytes,
                "bytes": self.ram_bytes,
                "prefixes": self.ram_prefixes,
                "saves": self.ram_saves,
                "restores": self.ram_restores,
                "evictions": self.ram_evictions,
                "shared": {
                    "bytes": self.ram_shared_bytes,
                    "budget_bytes": self.ram_shared_budget_bytes,
                    "models": self.ram_shared_models,
                },
                "save_seconds": round(self.save_seconds, 6),
                "restore_seconds": round(self.restore_seconds, 6),
            },
            "whole_hits": self.whole_hits,
            "disk": self.disk,
            "window_checkpoints": self.window,
            "window_ring": self.ring,
            "idle_recompute": {
                "enabled": self.idle_recompute,
                "chunks": self.idle_chunks,
                "tokens": self.idle_tokens,
                "aborted": self.idle_aborted,
                "pending": self.idle_pending,
            },
        }
