"""Leases given back, and what follows: keep-alive (the idle timer), eviction of a
drained model, an explicit unload with its grace period, and the registry's close.

An explicit unload gives running streams a grace period, then ends each with cause
``unload``; a model is never freed while a lease on it is held."""

from __future__ import annotations

import logging
import math
import time

import trio

from .._exceptions import InvalidRequestError
from ._base import _RegistryBase
from ._entry import Lease, ModelEntry

logger = logging.getLogger("trioserve.models")


class _Draining(_RegistryBase):
    """Releases, idle timers, evictions, unloads and the close."""

    # ---------------------------------------------------------------- release

    def _release(self, lease: Lease) -> None:
        lease.entry._holders.discard(lease)
        self._release_entry(lease.entry, lease.keep_alive)

    def _release_entry(self, entry: ModelEntry, keep_alive: float | None = None) -> None:
        entry.leases -= 1
        entry.last_used = time.monotonic()
        if entry.leases == 0 and entry.state == "loaded" and not self._closing:
            if entry.draining:
                # chosen to make room, and now idle: it goes (one eviction per model)
                if not entry._evicting:
                    entry._evicting = True
                    self._spawn(self._evict, entry)
            elif not entry.spec.pinned:
                # the last request's X-Keep-Alive, else the model's, else the server's
                keep = keep_alive if keep_alive is not None else entry.spec.keep_alive
                if keep is None:
                    keep = self.keep_alive
                if math.isfinite(keep):
                    entry._idle_deadline = trio.current_time() + max(0.0, keep)
                    if not entry._timer_running:  # one timer per model, its deadline moved
                        entry._timer_running = True
                        self._spawn(self._idle_timer, entry)
        self._notify()

    def _release_idle(self, entry: ModelEntry) -> None:
        """A model loaded with nobody waiting (preload, ``POST /models/load``): its idle
        timer starts now."""
        entry.leases += 1
        self._release_entry(entry)

    async def _evict(self, victim: ModelEntry) -> None:
        """A draining model's last lease has ended: unload it — unless it stopped
        draining meanwhile (every claim that wanted its room left)."""
        try:
            if victim.state == "loaded" and victim.draining and victim.leases == 0 and not self._closing:
                await self._unload(victim, grace=0.0, why="evicted (least recently used)")
        finally:
            victim._evicting = False

    # --------------------------------------------------------------- unloads

    async def unload(
        self, name: str | ModelEntry, *, grace: float | None = None, force: bool = False
    ) -> ModelEntry:
        """Unload ``name`` (``POST /models/unload``): no new leases; running streams get
        ``grace`` seconds (default: ``unload_grace``), then each is ended (its lease's
        ``on_unload``: cause ``unload``); then the model is freed. Requests that arrive
        meanwhile wait, and load it again afterwards.

        Raises:
            InvalidRequestError: (code ``model_pinned``) the model is pinned — the
                single-model server's model among them — and ``force`` is not set.

        Cancellation: the unload is the server's own; it goes on (shielded) once begun."""
        entry = name if isinstance(name, ModelEntry) else self.resolve(name)
        if grace is not None and not grace >= 0:
            raise ValueError(f"grace must be 0 or more seconds, got {grace}")
        if entry.spec.pinned and not force:
            if entry.spec.ready_gate:
                why = "it is this server's only model, loaded at startup (/health reports on it)"
            else:
                why = "it is pinned (the preset's pinned = true)"
            raise InvalidRequestError(
                f"the model {entry.name!r} cannot be unloaded: {why}; stop the server instead",
                param="model",
                code="model_pinned",
            )
        if entry.state == "loading" and entry._load is not None:
            load = entry._load
            load.scope.cancel()
            await load.done.wait()
            return entry
        if entry.state not in ("loaded", "unloading"):
            return entry
        grace = self.unload_grace if grace is None else grace
        await self._unload(entry, grace=grace, why="unloaded on request")
        return entry

    async def _idle_timer(self, entry: ModelEntry) -> None:
        """Unload ``entry`` at its idle deadline, unless a lease came first (which clears
        the deadline) or a later release moved it."""
        try:
            while True:
                deadline = entry._idle_deadline
                if deadline is None:
                    return
                if trio.current_time() >= deadline:
                    break
                await trio.sleep_until(deadline)
        finally:
            entry._timer_running = False
        entry._idle_deadline = None
        if entry.state == "loaded" and entry.leases == 0 and not entry.draining and not self._closing:
            await self._unload(entry, grace=0.0, why="idle (keep_alive)")

    async def _unload(self, entry: ModelEntry, *, grace: float, why: str) -> None:
        """Unload ``entry`` (or, if another unload has begun, wait for that one)."""
        with trio.CancelScope(shield=True):
            if entry.state != "loaded":
                while entry.state == "unloading":
                    await self._wait_for_change()
                return
            entry.draining = True
            entry.state = "unloading"
            self._notify()
            with trio.move_on_after(grace):
                while entry.leases > 0:
                    await self._wait_for_change()
            if entry.leases:
                logger.info("model %s: ending %d stream(s) (cause unload)", entry.name, entry.leases)
                for lease in list(entry._holders):
                    if lease.on_unload is not None:
                        lease.on_unload()
                # (never freed under a lease: each request's teardown is bounded by
                # its own, cancelled scope)
                while entry.leases > 0:
                    await self._wait_for_change()
            await self._close(entry)
            logger.info("model %s: unloaded (%s)", entry.name, why)

    async def _close(self, entry: ModelEntry) -> None:
        engine, entry.engine = entry.engine, None
        try:
            if engine is not None:
                await engine.aclose(close_backend=self._close_backends)
        except Exception:  # the model is gone either way: never stuck "unloading"
            logger.exception("model %s: closing it failed", entry.name)
        finally:
            entry.state = "unloaded"
            entry.draining = False
            entry._idle_deadline = None
            self._notify()
        if engine is not None:
            for listener in self.on_unloaded:
                try:
                    listener(entry, engine)
                except Exception:
                    logger.exception("an unload listener failed")

    # ------------------------------------------------------------------ close

    async def aclose(self) -> None:
        """Refuse new leases, abort every load, end every stream, tell every other lease
        holder to stop (its ``on_unload``: :meth:`lease`'s block is cancelled), wait
        until every lease is released, then free every model. Idempotent.

        A model is never freed while a lease is held (a ``/tokenize`` thread, say): the
        wait is as long as the holders take to release theirs — bounded when each is
        cancelled by its ``on_unload``; a lease taken with :meth:`acquire` and no
        ``on_unload`` must be released by its holder.

        Cancellation: the aborts and the streams' ends are shielded. The wait for lease
        holders is not: a cancel (a second signal) cuts it short, and a model still
        leased then is left allocated (logged), never freed under its holder; the
        others are freed (shielded)."""
        self._closing = True
        self._notify()
        with trio.CancelScope(shield=True):
            for entry in self.entries:
                if entry._load is not None:
                    entry._load.scope.cancel()
            # streams end (``engine_closed``) and their inference returns; the backends
            # stay open until every lease is released
            for entry in self.entries:
                if entry.engine is not None:
                    await entry.engine.aclose(close_backend=False)
        try:
            told: set[Lease] = set()
            while True:
                for entry in self.entries:
                    for lease in entry._holders - told:
                        told.add(lease)
                        if lease.on_unload is not None:
                            lease.on_unload()
                busy = [
                    entry
                    for entry in self.entries
                    if entry.leases > 0 or entry._load is not None or entry.state == "unloading"
                ]
                if not busy:
                    break
                logger.info(
                    "closing: waiting for %s",
                    ", ".join(f"{entry.name} ({entry.state}, {entry.leases} lease(s))" for entry in busy),
                )
                await self._wait_for_change()
        finally:
            with trio.CancelScope(shield=True):
                for entry in self.entries:
                    if entry.engine is None or entry.state == "unloading":
                        continue
                    if entry.leases > 0:
                        logger.error(
                            "model %s: left allocated at close: %d lease(s) still held",
                            entry.name,
                            entry.leases,
                        )
                        continue
                    await self._close(entry)
