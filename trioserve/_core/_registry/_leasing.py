"""Leases: a request holds one on its model from before its prompt is prepared to after
its last byte; a model with a lease is never evicted nor freed. Taking one may start a
load, wait for one, or wait for room."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from .._exceptions import NotFoundError, ServiceUnavailableError
from ._entry import Lease, ModelEntry, _Ticket
from ._room import _Room


class _Leasing(_Room):
    """:meth:`lease`, :meth:`acquire` and :meth:`load`."""

    # ---------------------------------------------------------------- leases

    @asynccontextmanager
    async def lease(
        self,
        name: str | ModelEntry | None = None,
        *,
        keep_alive: float | None = None,
        on_unload: Callable[[], None] | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold model ``name`` loaded for the body of the block (loading it first, and
        making room for it, if need be).

        ``keep_alive`` overrides how long it stays loaded after this request (Ollama's
        ``keep_alive``: 0 unloads it as soon as it is idle). ``on_unload`` is what an
        unload whose grace has run out, or the registry closing, calls (default: cancel
        the body, which then raises :class:`ServiceUnavailableError`, code
        ``model_unloaded``, or ``shutting_down`` when the registry closes).

        Raises:
            NotFoundError: no model of that name.
            OverloadedError: too many requests already wait for room.
            ServiceUnavailableError: the load failed (the message names the file and
                the cause), the registry is closing, or the model can never fit.

        Cancellation: a cancel while waiting leaves only this request's place; a load
        nobody waits for any more is aborted. The lease is released when the block is
        left, however it is left (after a worker thread the body waits for has returned).
        """
        lease = await self.acquire(name, keep_alive=keep_alive)
        scope = trio.CancelScope()
        lease.on_unload = on_unload or scope.cancel
        try:
            with scope:
                yield lease
        finally:
            lease.release()
        if scope.cancelled_caught:
            if self._closing:
                raise ServiceUnavailableError(
                    "the server is shutting down; retry on another instance", code="shutting_down"
                )
            raise ServiceUnavailableError(
                f"the model {lease.entry.name!r} was unloaded while this request ran", code="model_unloaded"
            )

    async def acquire(
        self, name: str | ModelEntry | None = None, *, keep_alive: float | None = None
    ) -> Lease:
        """:meth:`lease` without the block: the caller must :meth:`Lease.release` it
        (and should set its ``on_unload``: the registry's :meth:`aclose` waits for it)."""
        entry = name if isinstance(name, ModelEntry) else self.resolve(name)
        started = time.monotonic()
        ticket = _Ticket(entry)
        try:
            while True:
                if self._closing:
                    raise ServiceUnavailableError(
                        "the server is shutting down; retry on another instance", code="shutting_down"
                    )
                if ticket.granted:
                    break
                if entry.removed:  # (deleted while this request waited for it)
                    raise NotFoundError(
                        f"the model {entry.name!r} was deleted", param="model", code="model_not_found"
                    )
                if entry.state == "loaded" and not entry.draining:
                    entry.leases += 1
                    ticket.granted = True
                    break
                if entry.state == "loading":
                    if entry.spec.ready_gate and entry.loads == 0:
                        raise ServiceUnavailableError(
                            "the model is still loading; retry shortly", retry_after=1, code="loading"
                        )
                    await self._wait_for_load(entry, ticket)
                    continue
                if entry.state == "unloading" or entry.draining:
                    # on its way out — or not: it stays if every claim that wanted its
                    # room leaves. Any change may be the one: look again after each.
                    self._waiting_for_model += 1
                    self._notify()
                    try:
                        await self._wait_for_change()
                    finally:
                        self._waiting_for_model -= 1
                        self._notify()
                    continue
                if entry.state == "failed" and entry.spec.ready_gate and entry.loads == 1:
                    raise ServiceUnavailableError(f"the model failed to load: {entry.error}")
                # unloaded or failed (a later request retries): take room, in order
                await self._claim_room(ticket)
                if entry.state in ("unloaded", "failed") and not entry.removed:
                    self._start_load(entry)
        except BaseException:
            if ticket.granted:
                self._release_entry(entry)
            raise
        entry._idle_deadline = None  # in use: its idle timer (if any) stops
        lease = Lease(self, entry, time.monotonic() - started)
        lease.keep_alive = keep_alive
        entry._holders.add(lease)
        return lease

    async def load(self, name: str) -> ModelEntry:
        """Load ``name`` if it is not (``POST /models/load``), making room for it, and
        wait for the load. Cancellation: as a request waiting for it."""
        lease = await self.acquire(name)
        lease.release()
        return lease.entry
