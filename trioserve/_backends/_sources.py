"""How a registry entry loads its model (:class:`~trioserve._core._registry.ModelSource`).

:class:`LlamaSource` loads a GGUF with :class:`LlamaSettings`, abortably, and keeps the
model's prompt-cache host tier across its loads: an unload saves every cached prefix
there, and the next load starts from it — unless the file changed (size, mtime, inode),
which drops it (docs/models.md, "The prompt cache outlives an unload"). The tiers of a
server's models share one :class:`~._prompt_cache.HostBudget` (``--cache-ram`` is the
total; an unloaded model's entries go first): 20 models do not hold 20 budgets.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from .._core._backend import Backend
from ._cache import HostBudget, HostCache, host_rule
from ._llama import LlamaBackend, LlamaSettings

__all__ = ["LlamaSource"]

logger = logging.getLogger("trioserve.models")


class LlamaSource:
    """A GGUF file and the settings to run it with.

    ``host_pool``: the host-memory budget this model's prompt-cache tier shares with the
    server's other models (none: a budget of its own, ``settings.cache_ram_bytes``);
    ``settings.cache_ram_bytes`` caps this model's share."""

    def __init__(self, settings: LlamaSettings, *, host_pool: HostBudget | None = None) -> None:
        self.settings = settings
        self.description = str(settings.model_path)
        self.host_pool = host_pool if host_pool is not None else HostBudget(settings.cache_ram_bytes)
        self._host: HostCache | None = None
        self._stamp: tuple[int, int, int] | None = None

    @property
    def input_modalities(self) -> tuple[str, ...]:
        """What the model reads, known before it loads: text, and images with a projector."""
        return ("text", "image") if self.settings.mmproj is not None else ("text",)

    @property
    def context_length(self) -> int:
        """The context per sequence (``--ctx-size``), known before the model loads."""
        return self.settings.n_ctx

    def footprint(self) -> int:
        """The file's size: the weights, before the KV cells are known (the registry uses
        the measured growth once the model has loaded)."""
        path = self.settings.model_path
        files = [path]
        if "-00001-of-" in path.name:  # a multi-file model: every shard
            files = sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
        if self.settings.mmproj is not None:  # (its projector loads with it)
            files.append(self.settings.mmproj)
        total = 0
        for file in files:
            with contextlib.suppress(OSError):
                total += file.stat().st_size
        return total

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.settings.model_path)
        except OSError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    def host_cache(self) -> HostCache | None:
        """The host tier for the next load: the last load's, if the file is unchanged."""
        settings = self.settings
        if not settings.prompt_cache or not settings.cache_ram_bytes:
            return None
        stamp = self._file_stamp()
        rule = host_rule(
            settings.piece_rule,
            settings.prefill_chunk,
            fast=settings.cache_mode == "fast",
            deep_from=settings.deep_from,
            deep_piece=settings.deep_chunk,
        )
        made = (rule, settings.kv_types)
        changed = self._host is not None and (self._host.rule, self._host.kv_types) != made
        if self._host is None or stamp != self._stamp or changed:
            if self._host is not None:
                if len(self._host):
                    logger.info("%s changed since it was loaded: its cached prefixes go", self.description)
                self._host.close()  # (its bytes leave the shared budget)
            self._host = HostCache(
                settings.cache_ram_bytes, rule=rule, pool=self.host_pool, kv_types=settings.kv_types
            )
            self._stamp = stamp
        return self._host

    async def load(self, progress: Callable[[float], None]) -> Backend:
        return await LlamaBackend.aload(self.settings, progress=progress, host_cache=self.host_cache())
