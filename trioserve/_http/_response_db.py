"""Stored Responses' database (docs/dialects.md, "Stored responses"): one SQLite file
(or memory) of the responses clients asked to keep, each owned by the API key that
created it, bounded by age, by a quota per key and by a total.

Bounds without scans: the bytes and rows of each key, and of all keys, are counters
kept by triggers in the transaction of each write (``usage``, ``totals``); eviction
reads a key's oldest rows through an ``(owner, created)`` index. One key never evicts
another key's responses: a write over the key's quota, or over the total, removes that
key's oldest; a response that still does not fit is refused (:class:`StoreFullError`).

A ``background`` + ``stream`` response's events (docs/resumable-streams.md, "Across a
restart") are kept beside it in ``response_events``, a row per batch of consecutive
events (``first_seq`` to ``last_seq``, their SSE blocks as readers received them): their
bytes are counted in the response's ``size`` (so in its key's quota, the total and its
eviction), and they go with it (a trigger).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._wire import encode_json

__all__ = [
    "ChainError",
    "EventBatch",
    "ResponseStore",
    "StoreFullError",
    "StoredEvents",
    "StoredResponse",
    "event_type",
    "terminal_event",
]

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
CREATE INDEX IF NOT EXISTS responses_owner_created ON responses (owner, created);
CREATE TABLE IF NOT EXISTS usage (
    owner TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL,
    rows INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS totals (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    bytes INTEGER NOT NULL,
    rows INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS responses_counted_in AFTER INSERT ON responses BEGIN
    INSERT INTO usage (owner, bytes, rows) VALUES (NEW.owner, NEW.size, 1)
        ON CONFLICT (owner) DO UPDATE SET bytes = bytes + NEW.size, rows = rows + 1;
    UPDATE totals SET bytes = bytes + NEW.size, rows = rows + 1;
END;
CREATE TRIGGER IF NOT EXISTS responses_counted_out AFTER DELETE ON responses BEGIN
    UPDATE usage SET bytes = bytes - OLD.size, rows = rows - 1 WHERE owner = OLD.owner;
    DELETE FROM usage WHERE owner = OLD.owner AND rows <= 0;
    UPDATE totals SET bytes = bytes - OLD.size, rows = rows - 1;
END;
CREATE TRIGGER IF NOT EXISTS responses_recounted AFTER UPDATE OF owner, size ON responses BEGIN
    UPDATE usage SET bytes = bytes - OLD.size, rows = rows - 1 WHERE owner = OLD.owner;
    DELETE FROM usage WHERE owner = OLD.owner AND rows <= 0;
    INSERT INTO usage (owner, bytes, rows) VALUES (NEW.owner, NEW.size, 1)
        ON CONFLICT (owner) DO UPDATE SET bytes = bytes + NEW.size, rows = rows + 1;
    UPDATE totals SET bytes = bytes - OLD.size + NEW.size;
END;
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    note TEXT,
    PRIMARY KEY (response_id, first_seq)
);
CREATE TRIGGER IF NOT EXISTS responses_events_go AFTER DELETE ON responses BEGIN
    DELETE FROM response_events WHERE response_id = OLD.id;
END;
"""

#: a database made before the counters: counted once, at open
_COUNT_ONCE = """
INSERT INTO usage (owner, bytes, rows) SELECT owner, SUM(size), COUNT(*) FROM responses GROUP BY owner;
INSERT INTO totals (one, bytes, rows) SELECT 1, COALESCE(SUM(size), 0), COUNT(*) FROM responses;
"""

_UPSERT = (
    "INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
    "owner = excluded.owner, created = excluded.created, model = excluded.model, "
    "previous_id = excluded.previous_id, status = excluded.status, instructions = excluded.instructions, "
    "input_items = excluded.input_items, output_items = excluded.output_items, body = excluded.body, "
    "size = excluded.size + (SELECT COALESCE(SUM(LENGTH(data)), 0) FROM response_events "
    "WHERE response_id = excluded.id)"
)


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


#: ``response_events.note``: the first row of a response that streams (no events, its
#: range empty), a final event a restart appended, and why its events stopped being kept
STREAM, RESTART = "stream", "restart"
STOPPED = frozenset({"quota", "error"})

#: the events that end a Responses stream
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

_EVENT_LINE = re.compile(rb"^event: ([^\n]*)$", re.MULTILINE)


def event_type(block: bytes) -> str | None:
    """The ``event:`` of one SSE block."""
    found = _EVENT_LINE.search(block)
    return found.group(1).decode() if found is not None else None


def terminal_event(kind: str, response: dict[str, Any], sequence: int) -> bytes:
    """A ``response.*`` event block (``id:`` = its ``sequence_number``) carrying
    ``response``, as the live stream writes one."""
    payload = encode_json({"type": kind, "response": response, "sequence_number": sequence})
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (sequence, kind.encode(), payload)


@dataclass(slots=True)
class EventBatch:
    """A row of ``response_events``: events ``first`` to ``last`` (their SSE blocks, in
    ``data``), or a note with no events."""

    first: int
    last: int
    data: bytes
    note: str | None

    def blocks(self) -> list[bytes]:
        """Its events' blocks, one per sequence number (each ends with a blank line, and
        no data line holds a raw newline: ``_wire.number_events``)."""
        return [block + b"\n\n" for block in self.data.split(b"\n\n")[:-1]]


@dataclass(slots=True)
class StoredEvents:
    """A stored response and the rows of its events a replay after a sequence number
    needs: those past it, the last events row, and the notes."""

    response: StoredResponse
    batches: list[EventBatch]


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


class StoreFullError(RuntimeError):
    """A response that does not fit: larger than its key's quota, or the total is full
    of other keys' responses (which it never evicts)."""


class ResponseStore:
    """The database. ``path``: a file (it survives a restart) or ``None`` (in memory).
    ``max_age`` seconds, ``max_key_bytes`` per key (of the stored JSON; ``None``: the
    total) and ``max_bytes`` in all bound it: after each write the expired go, then the
    writing key's oldest until both fit (another key's never). Thread-safe (one lock)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        max_age: float = 30 * 86400.0,
        max_bytes: int = 512 << 20,
        max_key_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        if path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
        with self._db:
            self._db.executescript(_SCHEMA)
            if self._db.execute("SELECT 1 FROM totals").fetchone() is None:
                self._db.executescript(_COUNT_ONCE)
        self._lock = threading.Lock()
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.max_key_bytes = max_bytes if max_key_bytes is None else min(max_key_bytes, max_bytes)
        self._clock = clock

    def close(self) -> None:
        """Close the database (a second call does nothing)."""
        with self._lock:
            self._db.close()

    def quota(self, owner: str) -> int:
        """The bytes ``owner`` may keep: the per-key quota, or the total for ``""`` (the
        one user of a server without keys)."""
        return self.max_bytes if owner == "" else self.max_key_bytes

    def usage(self, owner: str | None = None) -> tuple[int, int]:
        """(bytes, rows) that ``owner`` keeps (``None``: every key): counters, no scan."""
        with self._lock:
            return self._usage(owner)

    def _usage(self, owner: str | None) -> tuple[int, int]:
        if owner is None:
            row = self._db.execute("SELECT bytes, rows FROM totals").fetchone()
        else:
            row = self._db.execute("SELECT bytes, rows FROM usage WHERE owner = ?", (owner,)).fetchone()
        return (int(row[0]), int(row[1])) if row is not None else (0, 0)

    def put(self, response: StoredResponse, *, streamed: bool = False) -> None:
        """Store (or replace: a background response's status moves on) ``response``;
        the expired go, then its key's oldest until its quota and the total are kept.
        :class:`StoreFullError` (nothing changed) if it cannot fit that way. ``streamed``:
        its events will be kept (:meth:`append_events`); its size keeps theirs."""
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
        owner = response.owner
        if size > self.quota(owner):
            raise StoreFullError(
                f"a response of {size} bytes is larger than the {self.quota(owner)} bytes one key may store"
            )
        with self._lock, self._db:
            self._db.execute(_UPSERT, (*values, size))
            if streamed:
                self._db.execute(
                    "INSERT OR IGNORE INTO response_events VALUES (?, ?, -1, -1, x'', ?)",
                    (response.id, owner, STREAM),
                )
            self._db.execute("DELETE FROM responses WHERE created < ?", (self._clock() - self.max_age,))
            self._evict(owner, response.id)

    def append_events(self, response_id: str, owner: str, first: int, last: int, data: bytes) -> bool:
        """Keep events ``first`` to ``last`` of a streamed response (their blocks, in
        ``data``), counted in its size: its key's oldest others go while the key is over
        its quota or the total over its bound. :class:`StoreFullError` (nothing changed)
        if they cannot fit; ``False`` (nothing written) if the response is gone."""
        with self._lock, self._db:
            row = self._db.execute(
                "SELECT size FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
            if row is None:
                return False
            if row[0] + len(data) > self.quota(owner):
                raise StoreFullError(
                    f"the response and its events would be larger than the {self.quota(owner)} bytes "
                    "one key may store"
                )
            self._db.execute(
                "INSERT INTO response_events VALUES (?, ?, ?, ?, ?, NULL)",
                (response_id, owner, first, last, data),
            )
            self._db.execute("UPDATE responses SET size = size + ? WHERE id = ?", (len(data), response_id))
            self._evict(owner, response_id)
        return True

    def stop_events(self, response_id: str, owner: str, next_seq: int, reason: str) -> None:
        """Note that a streamed response's events from ``next_seq`` on are not kept, and
        why (``quota``, ``error``): a replay ends there with an error that says so."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR IGNORE INTO response_events SELECT id, owner, ?, ?, x'', ? FROM responses "
                "WHERE id = ? AND owner = ?",
                (next_seq, next_seq - 1, reason, response_id, owner),
            )

    def events(self, response_id: str, owner: str, after: int = -1) -> StoredEvents | None:
        """A stored response and the rows a replay of its events after sequence number
        ``after`` needs (ordered; none: it does not stream), or ``None``."""
        response = self.get(response_id, owner)
        if response is None:
            return None
        with self._lock:
            rows = self._db.execute(
                "SELECT first_seq, last_seq, data, note FROM response_events WHERE response_id = ? "
                "AND owner = ? AND (last_seq > ? OR note IS NOT NULL OR first_seq = (SELECT MAX(first_seq) "
                "FROM response_events WHERE response_id = ? AND data != x'')) ORDER BY first_seq",
                (response_id, owner, after, response_id),
            ).fetchall()
        return StoredEvents(response, [EventBatch(r[0], r[1], bytes(r[2]), r[3]) for r in rows])

    def _evict(self, owner: str, keep: str) -> None:
        """The writing key's oldest responses (never ``keep``, never another key's) until
        the key is within its quota and the total within ``max_bytes``."""
        key_bytes, _ = self._usage(owner)
        total, _ = self._usage(None)
        over = max(key_bytes - self.quota(owner), total - self.max_bytes)
        if over <= 0:
            return
        rows = self._db.execute(
            "SELECT id, size FROM responses WHERE owner = ? AND id != ? ORDER BY created", (owner, keep)
        )
        doomed: list[str] = []
        for row_id, row_size in rows:
            if over <= 0:
                break
            doomed.append(row_id)
            over -= row_size
        rows.close()
        if over > 0:
            # the total is full of other keys' responses: this one is not kept (the
            # transaction is rolled back, the key's older responses stay)
            raise StoreFullError(
                f"the response store is full ({total} of {self.max_bytes} bytes, mostly other keys'); "
                "this response is not stored"
            )
        self._db.executemany("DELETE FROM responses WHERE id = ?", [(row_id,) for row_id in doomed])

    def settle_unfinished(self) -> int:
        """Background responses a killed process left ``queued`` or ``in_progress``:
        stored ``incomplete`` with cause ``shutdown`` (a client polling them must see
        an end), a streamed one's events ended by a ``response.incomplete`` event (a
        client resuming it must too); how many."""
        cause = json.dumps(
            {"end_cause": "shutdown", "message": "the server stopped before this response was complete"}
        )
        with self._lock, self._db:
            # (its size follows its body: the counters stay true)
            settled = self._db.execute(
                "UPDATE responses SET status = 'incomplete', body = json_set(body, '$.status', "
                "'incomplete', '$.trioserve', json(?1)), size = size - LENGTH(body) + LENGTH(json_set("
                "body, '$.status', 'incomplete', '$.trioserve', json(?1))) "
                "WHERE status IN ('queued', 'in_progress') RETURNING id, body",
                (cause,),
            ).fetchall()
            for response_id, body in settled:
                self._end_events(response_id, json.loads(body))
        return len(settled)

    def _end_events(self, response_id: str, body: dict[str, Any]) -> None:
        """A streamed response the restart cut: its events end with a final
        ``response.incomplete`` (the settled object, the next sequence number), unless
        they ended already or stopped being kept."""
        last = self._db.execute(
            "SELECT owner, last_seq, data, note FROM response_events WHERE response_id = ? "
            "ORDER BY first_seq DESC LIMIT 1",
            (response_id,),
        ).fetchone()
        if last is None or last[3] in STOPPED:
            return  # (not a stream, or its events stopped: a replay says why)
        blocks = EventBatch(0, 0, bytes(last[2]), None).blocks()
        if blocks and event_type(blocks[-1]) in TERMINAL:
            return  # (its end was kept before the process died)
        sequence = last[1] + 1
        data = terminal_event("response.incomplete", body, sequence)
        self._db.execute(
            "INSERT INTO response_events VALUES (?, ?, ?, ?, ?, ?)",
            (response_id, last[0], sequence, sequence, data, RESTART),
        )
        self._db.execute("UPDATE responses SET size = size + ? WHERE id = ?", (len(data), response_id))

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
