"""Stored Responses (docs/dialects.md, "Stored responses"): one SQLite database of the
responses clients asked to keep, each owned by the API key that created it, bounded by
age and size.

:class:`ResponseStore` is synchronous and used from one worker thread at a time
(:class:`AsyncResponseStore` runs each call in a thread under a limiter of one): SQLite
never runs on the event loop. :class:`StoredResponses` is what the server holds: the
store, and the background responses running now (each an
:class:`~trioserve._http._request.InFlightRequest` no connection holds, in a nursery of
the server's)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import trio

from .._core._exceptions import InvalidRequestError
from .._wire import StoredContext, StoredTurn

if TYPE_CHECKING:
    from ._request import InFlightRequest

__all__ = [
    "AsyncResponseStore",
    "BackgroundJob",
    "ChainError",
    "ResponseStore",
    "StoredResponse",
    "StoredResponses",
    "open_stored_responses",
]

P = ParamSpec("P")
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    previous_id TEXT,
    status TEXT NOT NULL,
    instructions TEXT,
    input_items TEXT NOT NULL,
    output_items TEXT NOT NULL,
    body TEXT NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


@dataclass(slots=True)
class StoredResponse:
    """One stored response: its input items (this turn's), output items and the body
    as it was sent."""

    id: str
    owner: str
    model: str
    status: str
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    body: dict[str, Any]
    previous_id: str | None = None
    instructions: str | None = None
    created: float = field(default_factory=time.time)


class ChainError(LookupError):
    """A ``previous_response_id`` chain that cannot be followed: a link is missing (or
    another key's), or the chain is longer or larger than allowed. ``missing``: the id
    not found (``None``: a bound was passed)."""

    def __init__(self, message: str, missing: str | None = None) -> None:
        super().__init__(message)
        self.missing = missing


def _row(row: sqlite3.Row) -> StoredResponse:
    return StoredResponse(
        id=row["id"],
        owner=row["owner"],
        model=row["model"],
        status=row["status"],
        input_items=json.loads(row["input_items"]),
        output_items=json.loads(row["output_items"]),
        body=json.loads(row["body"]),
        previous_id=row["previous_id"],
        instructions=row["instructions"],
        created=row["created"],
    )


class ResponseStore:
    """The database. ``path``: a file (it survives a restart) or ``None`` (in memory).
    ``max_age`` seconds and ``max_bytes`` (of the stored JSON) bound it: after each
    write the expired and then the oldest responses go. Thread-safe (one lock)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        max_age: float = 30 * 86400.0,
        max_bytes: int = 512 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self.max_age = max_age
        self.max_bytes = max_bytes
        self._clock = clock

    def close(self) -> None:
        """Close the database (a second call does nothing)."""
        with self._lock:
            self._db.close()

    def put(self, response: StoredResponse) -> None:
        """Store (or replace: a background response's status moves on) ``response``."""
        values = (
            response.id,
            response.owner,
            response.created,
            response.model,
            response.previous_id,
            response.status,
            response.instructions,
            json.dumps(response.input_items),
            json.dumps(response.output_items),
            json.dumps(response.body),
        )
        size = sum(len(v) for v in values[-3:])
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", (*values, size)
            )
            self._prune()

    def _prune(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created < ?", (self._clock() - self.max_age,))
        (total,) = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()
        if total <= self.max_bytes:
            return
        over = total - self.max_bytes
        gone = 0
        for row_id, size in self._db.execute("SELECT id, size FROM responses ORDER BY created").fetchall():
            if gone >= over:
                break
            self._db.execute("DELETE FROM responses WHERE id = ?", (row_id,))
            gone += size

    def settle_unfinished(self) -> int:
        """Background responses a killed process left ``queued`` or ``in_progress``:
        stored ``incomplete`` with cause ``shutdown`` (a client polling them must see
        an end); how many."""
        cause = json.dumps(
            {"end_cause": "shutdown", "message": "the server stopped before this response was complete"}
        )
        with self._lock, self._db:
            return self._db.execute(
                "UPDATE responses SET status = 'incomplete', body = json_set(body, '$.status', "
                "'incomplete', '$.trioserve', json(?)) WHERE status IN ('queued', 'in_progress')",
                (cause,),
            ).rowcount

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if it exists and belongs to ``owner`` (else ``None``: another
        key's response is not told apart from a missing one)."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM responses WHERE id = ? AND owner = ? AND created >= ?",
                (response_id, owner, self._clock() - self.max_age),
            ).fetchone()
        return _row(row) if row is not None else None

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock, self._db:
            deleted = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).rowcount
        return bool(deleted)

    def chain(
        self, response_id: str, owner: str, *, max_links: int = 1000, max_bytes: int = 32 << 20
    ) -> list[StoredResponse]:
        """``response_id`` and every response before it, oldest first: the conversation
        a ``previous_response_id`` continues. :class:`ChainError` when a link is missing
        (or another key's) or the chain passes ``max_links`` / ``max_bytes``."""
        found: list[StoredResponse] = []
        size = 0
        next_id: str | None = response_id
        while next_id is not None:
            if len(found) >= max_links:
                raise ChainError(f"the conversation is longer than {max_links} stored responses")
            response = self.get(next_id, owner)
            if response is None:
                raise ChainError(f"no stored response {next_id!r}", missing=next_id)
            size += len(json.dumps(response.input_items)) + len(json.dumps(response.output_items))
            if size > max_bytes:
                raise ChainError(f"the stored conversation is larger than {max_bytes} bytes")
            found.append(response)
            next_id = response.previous_id
        found.reverse()
        return found

    def input_items(
        self, response_id: str, owner: str, *, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of the response's input items (OpenAI's list: ``order`` ``asc`` or
        ``desc``, ``after`` an item id, at most ``limit``), and whether more follow;
        ``None`` if there is no such response of ``owner``."""
        response = self.get(response_id, owner)
        if response is None:
            return None
        items = list(response.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        return items[:limit], len(items) > limit


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


class StoredResponses:
    """The server's stored Responses: the database (in worker threads, one call at a
    time), the background responses running now, and the nursery they run in."""

    def __init__(self, store: ResponseStore, nursery: trio.Nursery) -> None:
        self.store = AsyncResponseStore(store)
        self.nursery = nursery
        #: the background responses not finished yet, by id
        self.jobs: dict[str, BackgroundJob] = {}

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

    async def record(self, turn: StoredTurn, owner: str, body: dict[str, Any] | None = None) -> None:
        """Store ``turn`` with ``body`` (by default the last response object its dialect
        wrote)."""
        if body is None:
            body = turn.dialect.final
        if body is None:
            return
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
        await self.store.run(self.store.store.put, response)

    async def get(self, response_id: str, owner: str) -> dict[str, Any] | None:
        """The response object as it stands (a running background response's status
        is read live), or ``None``."""
        job = self.jobs.get(response_id)
        if job is not None and job.owner == owner:
            body = dict(job.queued)
            request = job.request
            if request is not None and request.choices:
                body["status"] = "in_progress"
            return body
        stored = await self.store.run(self.store.store.get, response_id, owner)
        return stored.body if stored is not None else None


@asynccontextmanager
async def open_stored_responses(
    where: str | Path, *, max_age: float, max_bytes: int
) -> AsyncIterator[StoredResponses]:
    """The store at ``where`` (a file, or ``"memory"``), opened in a worker thread, with
    a nursery for background responses; on the way out the nursery is waited for (the
    server's drain has cancelled what runs) and the database closed."""
    path = None if where == "memory" else Path(where)

    def open_store() -> ResponseStore:
        store = ResponseStore(path, max_age=max_age, max_bytes=max_bytes)
        store.settle_unfinished()
        return store

    store = await trio.to_thread.run_sync(open_store)
    try:
        async with trio.open_nursery() as nursery:
            yield StoredResponses(store, nursery)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(store.close)
