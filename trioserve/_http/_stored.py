"""Stored Responses (docs/dialects.md, "Stored responses"): one SQLite database of the
responses clients asked to keep, each owned by the API key that created it, bounded by
age, a quota per key and a total (:mod:`._response_db`).

:class:`ResponseStore` is synchronous and used from one worker thread at a time
(:class:`AsyncResponseStore` runs each call in a thread under a limiter of one): SQLite
never runs on the event loop. :class:`StoredResponses` is what the server holds: the
store, and the background responses running now (each an
:class:`~trioserve._http._request.InFlightRequest` no connection holds, in a nursery of
the server's). A write that fails (a full disk, a full store) never changes an answer:
:meth:`StoredResponses.record` logs it, counts it and says so in ``/health``. A
background response whose end cannot be written at all is remembered in memory (its
final status, no output; the newest :data:`MAX_UNSTORED_ENDS`): a client polling it sees
it end, not ``queued`` for ever."""

from __future__ import annotations

import logging
import sqlite3
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

import trio

from .._core._exceptions import InvalidRequestError, NotFoundError
from .._wire import StoredContext, StoredTurn
from ._response_db import ChainError, ResponseStore, StoredResponse, StoreFullError

if TYPE_CHECKING:
    from ._request import InFlightRequest

__all__ = [
    "AsyncResponseStore",
    "BackgroundJob",
    "ChainError",
    "ResponseStore",
    "StoreFullError",
    "StoredResponse",
    "StoredResponses",
    "check_include",
    "missing_response",
    "open_stored_responses",
]

logger = logging.getLogger("trioserve.responses")

P = ParamSpec("P")
T = TypeVar("T")

#: why a write failed: the database or its disk (``error``: the store is degraded), or
#: no room within the key's quota and the total (``full``)
StoreFailure = Literal["error", "full"]

#: the background responses whose end could not be stored that are remembered (the
#: oldest forgotten first; a few hundred bytes each)
MAX_UNSTORED_ENDS = 1024

#: the causes a background response ends ``incomplete`` with (cut short, not failed)
INCOMPLETE_CAUSES = frozenset({"deadline", "shutdown", "unload", "detach_timeout", "evicted"})

#: ``include`` values a read honours trivially (nothing is encrypted here)
_INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content"})


def missing_response(response_id: str) -> NotFoundError:
    """The 404 of a response id this caller has no response for."""
    return NotFoundError(
        f"no stored response {response_id!r} (it expired, was deleted, was not stored, or was made "
        "with another API key)",
        param="response_id",
    )


def check_include(values: list[str]) -> None:
    """A read's ``include`` (``include[]``): only what there is nothing to add for."""
    for value in values:
        if value not in _INCLUDE_NOTHING:
            raise InvalidRequestError(
                f"include is not supported: {value!r} cannot be included here "
                "(reasoning.encrypted_content can: nothing is encrypted)",
                param="include",
            )


#: the fields of a response object kept for an end that could not be stored (the rest,
#: its instructions and tools, are the stored ``queued`` row's; its output is dropped)
_END_FIELDS = (
    "id",
    "object",
    "created_at",
    "status",
    "background",
    "error",
    "incomplete_details",
    "model",
    "usage",
    "trioserve",
)


class AsyncResponseStore:
    """:class:`ResponseStore` for Trio: each call in a worker thread, one at a time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        def job() -> T:
            return call(*args, **kwargs)

        return await trio.to_thread.run_sync(job, limiter=self._limiter)


@dataclass(slots=True)
class BackgroundJob:
    """A background response while it runs: its request (cancel it to stop it), its
    owner, and an event set once its final state is stored."""

    turn: StoredTurn
    owner: str
    queued: dict[str, Any]
    request: InFlightRequest | None = None
    done: trio.Event = field(default_factory=trio.Event)
    #: whether its end was stored when it ended on its own (a failed write: its
    #: failure is recorded instead, where the store can)
    stored: bool = False


class StoredResponses:
    """The server's stored Responses: the database (in worker threads, one call at a
    time), the background responses running now, and the nursery they run in."""

    def __init__(
        self,
        store: ResponseStore,
        nursery: trio.Nursery,
        *,
        on_failure: Callable[[StoreFailure], None] | None = None,
    ) -> None:
        self.store = AsyncResponseStore(store)
        self.nursery = nursery
        #: the background responses not finished yet, by id
        self.jobs: dict[str, BackgroundJob] = {}
        #: writes that failed since start (``/health``; ``/metrics`` through ``on_failure``)
        self.failures = 0
        #: why the last write failed, while no write has succeeded since: the store is
        #: degraded (``/health``); ``None``: healthy
        self.degraded: str | None = None
        self.on_failure = on_failure
        #: background responses whose end could not be stored, by id: (owner, the
        #: final object's small fields), the newest :data:`MAX_UNSTORED_ENDS`
        self.unstored: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()

    def health(self) -> dict[str, object]:
        """What ``/health`` says of the store."""
        body: dict[str, object] = {"state": "degraded" if self.degraded else "ok", "failures": self.failures}
        if self.degraded:
            body["error"] = self.degraded
        return body

    def failed(
        self, response_id: str, kind: StoreFailure, exc: BaseException, what: str = "its answer is sent"
    ) -> None:
        """A write for ``response_id`` failed: logged (``what`` goes on all the same),
        counted (``error``: the store is degraded)."""
        self.failures += 1
        if kind == "error":
            self.degraded = f"{type(exc).__name__}: {exc}"
            logger.error("response %s could not be stored (%s): %s", response_id, what, self.degraded)
        else:
            logger.warning("response %s not stored (%s): %s", response_id, what, exc)
        if self.on_failure is not None:
            self.on_failure(kind)

    async def context(
        self, previous_id: str | None, owner: str, response_id: str | None = None
    ) -> StoredContext:
        """What a request that continues ``previous_id`` (of ``owner``) is given: the
        stored conversation, oldest first (400 naming ``previous_response_id`` when
        it cannot be followed)."""
        if previous_id is None:
            return StoredContext(response_id=response_id)
        job = self.jobs.get(previous_id)
        if job is not None and job.owner == owner:
            raise InvalidRequestError(
                f"the response {previous_id!r} is still running in the background; wait until it "
                "completes (GET /v1/responses/{id}) before continuing it",
                param="previous_response_id",
            )
        try:
            chain = await self.store.run(self.store.store.chain, previous_id, owner)
        except ChainError as exc:
            message = str(exc)
            if exc.missing is not None:
                message = (
                    f"previous_response_id: no stored response {exc.missing!r} (it expired, was deleted, "
                    "was not stored, or was made with another API key)"
                )
            raise InvalidRequestError(message, param="previous_response_id") from None
        history: list[dict[str, Any]] = []
        for response in chain:
            history += response.input_items
            history += response.output_items
        return StoredContext(history=tuple(history), response_id=response_id, previous_id=previous_id)

    async def record(
        self, turn: StoredTurn, owner: str, body: dict[str, Any] | None = None, *, streamed: bool = False
    ) -> bool:
        """Store ``turn`` with ``body`` (by default the last response object its dialect
        wrote; ``streamed``: its events will be kept, :mod:`._event_store`); whether it
        was stored. A failed write (the database or its disk: the
        store is degraded until a write succeeds; or no room: :class:`StoreFullError`)
        is logged and counted, never raised: a finished answer is sent all the same."""
        if body is None:
            body = turn.dialect.final
        if body is None:
            return False
        output = body.get("output")
        response = StoredResponse(
            id=turn.id,
            owner=owner,
            model=turn.model,
            status=str(body["status"]),
            input_items=turn.input_items,
            output_items=list(output) if isinstance(output, list) else [],
            body=body,
            previous_id=turn.previous_id,
            instructions=turn.instructions,
        )
        try:
            await self.store.run(self.store.store.put, response, streamed=streamed)
        except StoreFullError as exc:
            self.failed(turn.id, "full", exc)
            return False
        except (sqlite3.Error, OSError) as exc:
            self.failed(turn.id, "error", exc)
            return False
        self.degraded = None
        self.unstored.pop(turn.id, None)  # (the store has it now)
        return True

    def remember_end(self, response_id: str, owner: str, body: dict[str, Any]) -> None:
        """A background response's end that could not be stored (its row still says
        ``queued``): kept in memory, without its output, for :meth:`get` to answer
        with; the oldest such end is forgotten past :data:`MAX_UNSTORED_ENDS`."""
        fields = {name: body[name] for name in _END_FIELDS if name in body}
        fields["output"] = []
        self.unstored[response_id] = (owner, fields)
        self.unstored.move_to_end(response_id)
        while len(self.unstored) > MAX_UNSTORED_ENDS:
            self.unstored.popitem(last=False)
        logger.error(
            "background response %s: its end (%s) could not be stored; kept in memory only",
            response_id,
            fields.get("status"),
        )

    async def record_end(self, turn: StoredTurn, owner: str) -> None:
        """A response that ended on its own, stored before its last bytes go out (a
        background one's job remembers whether it was: :meth:`record` never raises)."""
        stored = await self.record(turn, owner)
        job = self.jobs.get(turn.id)
        if job is not None:
            job.stored = stored

    async def settle(self, job: BackgroundJob) -> None:
        """Store a background response's final state once its request has ended, unless
        its end stored it; then it is no longer running. Never raises: an end that
        cannot be written at all is remembered in memory (its status, no output): its
        stored row says ``queued``, and a client polling it must see it end."""
        request = job.request
        assert request is not None
        cause = request.cause
        dialect = job.turn.dialect
        try:
            if request.delivered and cause in ("stop", "length"):
                if job.stored:
                    return  # stored before its (unsent) last bytes
                # its result could not be stored: its failure, a smaller write (no
                # output), where it can be (else in memory; the log and counters say so)
                reason = self.degraded or "the response store is full"
                error = f"its result could not be stored: {reason}"
                final = {**dialect.snapshot("failed", error=error), "output": []}
            elif cause == "cancelled":
                final = dialect.snapshot("cancelled", cause="cancelled")
            elif cause in INCOMPLETE_CAUSES:
                final = dialect.snapshot("incomplete", cause=cause)
            else:
                final = dialect.snapshot("failed", error=request.error or "inference failed", cause="error")
            if not await self.record(job.turn, job.owner, final):
                self.remember_end(job.turn.id, job.owner, final)
        except Exception:
            logger.exception("background response %s: its end could not be stored", job.turn.id)
            error_body = {"code": "server_error", "message": "its end could not be stored"}
            self.remember_end(job.turn.id, job.owner, {"status": "failed", "error": error_body})
        finally:
            self.jobs.pop(job.turn.id, None)

    async def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The response object as it stands (a running background response's status
        is read live until its end is stored — a client that read a stream's last event
        reads its end, though its job is still writing its last events; one whose end
        could not be stored, its end as remembered), or ``None``."""
        job = self.jobs.get(response_id)
        if job is not None and job.owner == owner and not job.stored:
            body = dict(job.queued)
            request = job.request
            if request is not None and request.choices:
                body["status"] = "in_progress"
            return body
        end = self.unstored.get(response_id)
        if end is None or end[0] != owner:
            stored = await self.store.run(self.store.store.get, response_id, owner)
            return stored.body if stored is not None else None
        try:
            stored = await self.store.run(self.store.store.get, response_id, owner)
        except (sqlite3.Error, OSError):
            return dict(end[1])  # (the store cannot be read: its end, as remembered)
        if stored is None:
            # its row was deleted (or expired): so is what was remembered of it
            self.unstored.pop(response_id, None)
            return None
        return {**stored.body, **end[1]}


@asynccontextmanager
async def open_stored_responses(
    where: str | Path,
    *,
    max_age: float,
    max_bytes: int,
    max_key_bytes: int | None = None,
    on_failure: Callable[[StoreFailure], None] | None = None,
) -> AsyncIterator[StoredResponses]:
    """The store at ``where`` (a file, or ``"memory"``), opened in a worker thread, with
    a nursery for background responses; on the way out the nursery is waited for (the
    server's drain has cancelled what runs) and the database closed."""
    path = None if where == "memory" else Path(where)

    def open_store() -> ResponseStore:
        store = ResponseStore(path, max_age=max_age, max_bytes=max_bytes, max_key_bytes=max_key_bytes)
        store.settle_unfinished()
        return store

    store = await trio.to_thread.run_sync(open_store)
    try:
        async with trio.open_nursery() as nursery:
            yield StoredResponses(store, nursery, on_failure=on_failure)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(store.close)
