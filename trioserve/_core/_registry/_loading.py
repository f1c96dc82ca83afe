"""Loads: one per model at a time, shared by every request that waits for it, run in
the registry's nursery; each waiter waits inside its own scope, and when the last has
gone the load is cancelled (the source aborts it: for llama.cpp, its progress callback
returns false). Loads take load slots (``max_concurrent_loads``, one by default) in
arrival order, so each load's measured footprint is its own."""

from __future__ import annotations

import logging
import os
import time

from .._backend import Backend
from .._engine import Engine
from .._exceptions import ServiceUnavailableError
from ._draining import _Draining
from ._entry import ModelEntry, _Load, _Ticket

logger = logging.getLogger("trioserve.models")


class _Loading(_Draining):
    """Starting, admitting, running and waiting for loads."""

    # ----------------------------------------------------------------- loads

    def _start_load(self, entry: ModelEntry) -> None:
        entry.state = "loading"
        entry.progress = 0.0
        entry.error = None
        load = entry._load = _Load()
        self._loads_queued.append(load)
        self._admit_loads()
        self._spawn(self._run_load, entry)
        self._notify()

    def _admit_loads(self) -> None:
        """Give load slots to the loads that wait for one, in arrival order."""
        while self._loads_queued and len(self._loads_running) < self.max_concurrent_loads:
            load = self._loads_queued.popleft()
            if self._loads_running:  # (only with max_concurrent_loads > 1)
                load.overlapped = True
                for running in self._loads_running:
                    running.overlapped = True
            self._loads_running.add(load)
            load.may_start.set()

    def _end_load(self, load: _Load) -> None:
        """``load`` is over (or never started): its slot goes to the next."""
        if load in self._loads_running:
            self._loads_running.discard(load)
        else:
            self._loads_queued.remove(load)
        self._admit_loads()

    async def _run_load(self, entry: ModelEntry) -> None:
        load = entry._load
        assert load is not None

        def progress(value: float) -> None:
            entry.progress = value  # (a float store, from the loading thread)

        backend: Backend | None = None
        before = after = None
        try:
            with load.scope:
                await load.may_start.wait()  # a load slot, in arrival order
                load.started = time.monotonic()
                before = _rss_bytes()
                if entry.spec.source.description:
                    logger.info(
                        "model %s: loading %s", entry.name or "(default)", entry.spec.source.description
                    )
                backend = await entry.spec.source.load(progress)
                after = _rss_bytes()
        except Exception as exc:
            described = entry.spec.source.description
            entry.error = str(exc) if not described or described in str(exc) else f"{described}: {exc}"
            logger.error("model %s: the load failed: %s", entry.name, entry.error)
        finally:
            self._end_load(load)
        entry.loads += 1
        entry._load = None
        seconds = time.monotonic() - load.started
        if backend is None:
            if load.scope.cancelled_caught and entry.error is None:
                logger.info("model %s: load aborted after %.2f s (nobody waits for it)", entry.name, seconds)
                entry.state = "unloaded"
            else:
                entry.state = "failed"
                if entry.error is None:
                    entry.error = f"{entry.spec.source.description}: the load was cancelled"
            load.done.set()
            self._notify()
            return
        if before is not None and after is not None and after > before and not load.overlapped:
            entry.measured_bytes = max(after - before, 1)
        if not entry.spec.name:
            entry.spec.name = backend.info.id
            self._by_name.setdefault(entry.spec.name, entry)
        entry.engine = Engine(backend, max_queue=self.max_queue, pause_budget=self.pause_budget)
        entry.state = "loaded"
        entry.draining = False
        entry.loaded_at = int(time.time())
        entry.load_seconds = seconds
        entry.last_used = time.monotonic()
        # the waiters hold their leases from now: nothing can evict it before they run
        entry.leases += load.waiters
        load.succeeded = True
        logger.info("model %s: loaded in %.2f s (%d request(s) waiting)", entry.name, seconds, load.waiters)
        for listener in self.on_loaded:
            listener(entry)
        load.done.set()
        self._notify()
        if load.waiters == 0 and entry.leases == 0:
            self._release_idle(entry)

    async def _wait_for_load(self, entry: ModelEntry, ticket: _Ticket) -> None:
        load = entry._load
        assert load is not None
        load.waiters += 1
        self._notify()
        try:
            await load.done.wait()
        finally:
            self._notify()
            if load.succeeded:
                ticket.granted = True  # the load counted this waiter's lease already
            else:
                load.waiters -= 1
                if load.waiters == 0 and not load.done.is_set() and not load.keep:
                    logger.info("model %s: every request waiting for its load has gone: abort", entry.name)
                    load.scope.cancel()
        if entry.state == "failed" and not ticket.granted:
            raise ServiceUnavailableError(f"the model {entry.name!r} failed to load: {entry.error}")


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux), for the measured footprint of a load."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return None
