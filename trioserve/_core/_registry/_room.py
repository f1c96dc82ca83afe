"""Room for a model: ``max_loaded`` models and a memory budget, taken in arrival order;
the least recently used idle model is evicted to make it; if none is idle, the claim
waits for a lease to end — never a cut stream."""

from __future__ import annotations

import logging

from .._exceptions import InvalidRequestError, OverloadedError, ServiceUnavailableError
from ._entry import ModelEntry, _Ticket
from ._loading import _Loading

logger = logging.getLogger("trioserve.models")


class _Room(_Loading):
    """What is used, what fits, the claims for room and the choice of a victim."""

    # ------------------------------------------------------------------ room

    def _used(self, *, excluding: ModelEntry | None = None) -> tuple[int, int]:
        count = memory = 0
        for entry in self.entries:
            if entry is not excluding and entry.state in ("loading", "loaded", "unloading"):
                count += 1
                memory += entry.footprint()
        return count, memory

    def _fits(self, entry: ModelEntry) -> bool:
        count, memory = self._used(excluding=entry)
        if self.max_loaded is not None and count >= self.max_loaded:
            return False
        return self.memory_budget is None or memory + entry.footprint() <= self.memory_budget

    def check_adapter_room(self, entry: ModelEntry, size: int) -> None:
        """A LoRA adapter file of ``size`` bytes loaded at run time into ``entry``
        (docs/lora.md): 400 naming the budget if the loaded models and it would not fit
        (an adapter evicts no model)."""
        if self.memory_budget is None:
            return
        _, memory = self._used()
        if memory + size > self.memory_budget:
            raise InvalidRequestError(
                f"the LoRA adapter's file takes {size:,} bytes; the loaded models take {memory:,} of the "
                f"{self.memory_budget:,}-byte memory budget (--models-memory): unload an adapter or a "
                "model first",
                param="lora_path",
                code="model_does_not_fit",
            )

    def _could_ever_fit(self, entry: ModelEntry) -> bool:
        pinned = [
            e for e in self.entries if e.spec.pinned and e is not entry and e.state in ("loading", "loaded")
        ]
        if self.max_loaded is not None and len(pinned) >= self.max_loaded:
            return False
        if self.memory_budget is None:
            return True
        return sum(e.footprint() for e in pinned) + entry.footprint() <= self.memory_budget

    async def _claim_room(self, ticket: _Ticket) -> None:
        """Wait, in arrival order, until ``ticket``'s model fits; evict idle models (least
        recently used first) to make room; mark busy ones to drain if none is idle.
        Returns when the model fits, or when its state is no longer unloaded or failed
        (another request started its load), or it was deleted: the caller looks again."""
        entry = ticket.entry
        if not self._could_ever_fit(entry):
            raise ServiceUnavailableError(
                f"the model {entry.name!r} cannot fit beside the pinned models "
                f"(--models-max {self.max_loaded}, memory budget {self.memory_budget} bytes)",
                code="model_does_not_fit",
            )
        if len(self._queue) >= self.max_queue:
            raise OverloadedError(
                f"{len(self._queue)} requests already wait for a model to load; retry shortly",
                retry_after=max(1.0, entry.load_seconds or 1.0),
            )
        self._queue.append(ticket)
        self._notify()
        try:
            while True:
                if self._closing:
                    raise ServiceUnavailableError(
                        "the server is shutting down; retry on another instance", code="shutting_down"
                    )
                if entry.state not in ("unloaded", "failed") or entry.removed:
                    return  # another request started its load meanwhile; or it was deleted
                if self._queue[0] is ticket:
                    if self._fits(entry):
                        return
                    victim = self._victim(entry)
                    if victim is not None:
                        victim.draining = True
                        if victim.leases == 0:
                            await self._unload(victim, grace=0.0, why="evicted (least recently used)")
                            continue
                        logger.info(
                            "model %s: waiting for %d request(s) on %s to finish before it is evicted",
                            entry.name,
                            victim.leases,
                            victim.name,
                        )
                        self._notify()  # (requests for the victim now wait)
                await self._wait_for_change()
        finally:
            self._queue.remove(ticket)
            if not self._queue:
                # nobody waits for room any more: a model marked to go (and not yet
                # unloading) stays, and the requests waiting for it get their leases
                for e in self.entries:
                    if e.draining and e.state == "loaded":
                        e.draining = False
            self._notify()

    def _victim(self, entry: ModelEntry) -> ModelEntry | None:
        """The model to evict for ``entry``: one already draining, else the least
        recently used loaded model that is not pinned (idle ones first)."""
        if any(e.draining and e.state in ("loaded", "unloading") for e in self.entries):
            return None  # one is on its way out: wait for it
        candidates = [e for e in self.entries if e is not entry and e.state == "loaded" and not e.spec.pinned]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (e.leases > 0, e.last_used))
