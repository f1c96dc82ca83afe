"""The prompt cache's disk tier (docs/prompt-cache.md, "On disk"): sequence states that
outlive the process — a restart, a crash, a model swapped out beyond the host budget.

One :class:`DiskStore` per server (``--cache-dir``, ``--cache-disk`` bytes): a directory
several processes may share. Each loaded model reads and writes its own subdirectory
through a :class:`DiskTier`, named by the model's *fingerprint* (:func:`fingerprint`:
the GGUF's content, the settings that change cells, the llama.cpp build), so an entry
is only ever offered to a model that computes the same cells:

    <root>/v1/<fingerprint>/<name>.kv     an entry: header, tokens, state, checksum
    <root>/v1/<fingerprint>/model.json    what the fingerprint is made of (for people)
    <root>/v1/tmp/                        entries being written (``<name>.<pid>.<n>``)
    <root>/v1/bad/                        entries that failed their check, moved aside
    <root>/v1/digests/                    GGUF content digests, by (device, inode, size, mtime)

An entry is published by ``rename`` after ``fsync`` (readers never see half of one);
its checksum (CRC-32 of everything before it) is verified before a restore; a bad one
is a logged miss, moved aside. The budget holds for the whole directory, whoever
wrote it, ``bad/`` included: before each write the entries that leave no room for it go
(moved-aside ones first, then the least recently used: by mtime; a restore touches it).
A write that fails leaves nothing behind (its temporary file removed); on a full
filesystem (ENOSPC) the least recently used entries that make room for it go and it is
tried once more. A failed write is counted and logged (once, until a write succeeds
again), never an error of a request. Entries hold users' prompts: files are 0600 in
directories 0700, whatever the umask. A directory where no file can be created (a
read-only filesystem, another user's) is refused when the store opens (``OSError``):
the model runs without the disk tier.
Writes run on one thread of the store (a bounded queue: a full queue drops the write,
counted), never on the scheduler's path; reads run on the scheduler thread, in pieces,
checking between them whether the request was cancelled.

Pure Python (no llama.cpp, numpy or Trio): the state is bytes to this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from ._disk_format import (
    STALE_SECONDS,
    DiskEntry,
    alive,
    fingerprint,
    gguf_digest,
    private_dir,
    probe_writable,
    write_atomic,
    write_entry,
)
from ._disk_tier import DiskTier

__all__ = ["DiskEntry", "DiskStore", "DiskTier", "fingerprint", "gguf_digest"]

logger = logging.getLogger("trioserve.cache")

#: the errors of a filesystem (or a quota) without room: evict, then try once more
FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
#: what a file takes beyond its bytes (blocks, an inode), when room is made for it
SLACK = 64 << 10


class DiskStore:
    """The server's disk tier: one directory, one byte budget (every model's entries,
    and every process's that shares the directory), one writer thread.

    Thread-safe. ``close()`` waits for the writes queued (a graceful shutdown's spill).
    ``OSError``: no file can be created under ``root`` (read-only, not ours): the caller
    runs without a disk tier."""

    def __init__(self, root: str | Path, budget: int, *, queue_bytes: int = 256 << 20) -> None:
        if budget < 0:
            raise ValueError(f"the disk budget must be at least 0, got {budget}")
        self.root = Path(root)
        self.budget = budget
        self.base = self.root / "v1"
        private_dir(self.root, tighten=False)  # (the operator's directory: made, not changed)
        for directory in (self.base, *(self.base / sub for sub in ("tmp", "bad", "digests"))):
            private_dir(directory)
        try:
            probe_writable(self.base / "tmp")
        except OSError as e:
            if e.errno not in FULL:
                raise
            # full, not read-only: writes make room for themselves (or fail, counted)
            logger.warning("the disk cache's filesystem is full (%s): writes evict to make room", e)
        self._queue: queue.Queue[tuple[DiskTier, tuple[int, ...], list[int], int, str, Any] | None] = (
            queue.Queue()
        )
        self._queued_bytes = 0
        self._queue_limit = queue_bytes
        self._lock = threading.Lock()
        self._counter = 0
        #: counters (``/health``, ``/metrics``)
        self.writes = 0
        self.write_bytes = 0
        self.dropped_writes = 0
        self.failed_writes = 0
        self.evictions = 0
        self.bad_entries = 0
        #: why the last write failed, while writes fail (``None``: the last one succeeded)
        self.failing: str | None = None
        self.swept = self._sweep()
        #: the directory's bytes, as of the last write (or the start)
        self.held_bytes = self.bytes
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trioserve-disk-cache", daemon=True)
        self._thread.start()

    _shared: ClassVar[dict[Path, DiskStore]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def shared(cls, root: str | Path, budget: int) -> DiskStore:
        """The process's one store of ``root`` (every model of a server shares its
        budget and its writer); the latest ``budget`` given holds."""
        key = Path(root).expanduser().resolve()
        with cls._shared_lock:
            store = cls._shared.get(key)
            if store is None or store._closed:
                store = cls._shared[key] = cls(key, budget)
            store.budget = budget
            return store

    # ------------------------------------------------------------ lifecycle

    def _sweep(self) -> int:
        """Remove what a killed process left in tmp/ (its pid gone, or old)."""
        swept = 0
        now = time.time()
        for tmp in (self.base / "tmp").iterdir():
            try:
                pid = int(tmp.name.rsplit(".", 2)[-2])
            except (ValueError, IndexError):
                pid = -1
            running = pid > 0 and alive(pid)
            try:
                old = now - tmp.stat().st_mtime > STALE_SECONDS
            except OSError:
                continue
            if pid == os.getpid() or not running or old:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                    swept += 1
        if swept:
            logger.info("the disk cache swept %d unfinished entries a stopped process left", swept)
        return swept

    def tier(
        self, fingerprint: str, *, window: int = 0, made_of: Mapping[str, object] | None = None
    ) -> DiskTier:
        """The tier of the model whose cells' identity is ``fingerprint``; it reads what
        the directory already holds for it (an earlier run's, another process's)."""
        directory = self.base / fingerprint
        private_dir(directory)
        if made_of is not None and not (directory / "model.json").exists():
            with contextlib.suppress(OSError):
                write_atomic(
                    directory / "model.json", json.dumps(dict(made_of), indent=1, default=str).encode()
                )
        return DiskTier(self, directory, window=window)

    def made_of(self, content: str) -> list[tuple[str, dict[str, Any]]]:
        """``(fingerprint, what it is made of)`` of every directory of the GGUF whose
        digest is ``content`` (the same model under other settings or builds)."""
        found = []
        for directory in self.base.iterdir():
            try:
                made = json.loads((directory / "model.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(made, dict) and made.get("gguf_sha256") == content:
                found.append((directory.name, made))
        return found

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; whether it was before ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._queued_bytes == 0 and self._queue.unfinished_tasks == 0:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def close(self) -> None:
        """Finish the queued writes, then stop the writer (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    @property
    def bytes(self) -> int:
        """The bytes of every entry in the directory (every model's, every process's,
        and the moved-aside ones in ``bad/``)."""
        return sum(size for _, size, _ in self._entries())

    # ------------------------------------------------------------ writing

    def submit(
        self, tier: DiskTier, tokens: tuple[int, ...], cuts: list[int], start: int, tag: str, state: Any
    ) -> bool:
        """Queue a write of ``state`` (bytes, or an object with ``__bytes__`` and
        ``len()``: the host tier's buffer, kept alive until written). False: dropped
        (closed, larger than the budget, or the queue is full)."""
        size = len(state)
        with self._lock:
            if self._closed or not self.budget or size > self.budget:
                return False
            if self._queued_bytes + size > self._queue_limit:
                self.dropped_writes += 1
                return False
            self._queued_bytes += size
        self._queue.put((tier, tokens, cuts, start, tag, state))
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                tier, tokens, cuts, start, tag, state = job
                try:
                    self._write(tier, tokens, cuts, start, tag, state)
                except Exception as e:
                    self._failed(e)
                finally:
                    with self._lock:
                        self._queued_bytes -= len(state)
            finally:
                self._queue.task_done()

    def _failed(self, e: Exception) -> None:
        """A write that failed: counted; logged when writes start failing (a full disk
        fails every write until space frees: one warning, not one a request)."""
        self.failed_writes += 1
        first = self.failing is None
        self.failing = str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        if not isinstance(e, OSError):
            logger.exception("could not write a cached prefix to the disk cache; it is dropped")
        elif first:
            logger.warning(
                "could not write a cached prefix to the disk cache (%s): it is dropped, and so is "
                "every write until one succeeds; requests are answered as without the disk tier",
                e,
            )
        else:
            logger.debug("the disk cache's write failed again: %s", e)

    @property
    def pending_writes(self) -> int:
        """Writes queued or running."""
        return self._queue.unfinished_tasks

    def _write(
        self, tier: DiskTier, tokens: tuple[int, ...], cuts: list[int], start: int, tag: str, state: Any
    ) -> None:
        if tier.covers_tag(tokens, cuts, tag):
            return
        self._fit(len(state))  # (the budget holds with the new entry in it, not only after)

        def write() -> tuple[Path, int]:
            with self._lock:
                self._counter += 1
                n = self._counter
            return write_entry(
                self.base / "tmp",
                tier.directory,
                n,
                fingerprint=tier.fingerprint,
                tokens=tokens,
                cuts=cuts,
                start=start,
                tag=tag,
                state=state,
            )

        try:
            final, size = write()
        except OSError as e:
            if e.errno not in FULL or not self._make_room(len(state) + SLACK):
                raise
            logger.info("the disk cache's filesystem is full (%s): evicted to make room, writing again", e)
            final, size = write()  # (once: a second failure is the write's)
        self.writes += 1
        self.write_bytes += size
        self.held_bytes += size
        if self.failing is not None:
            logger.info("the disk cache writes again (%d write(s) failed so far)", self.failed_writes)
            self.failing = None
        tier.add(DiskEntry(final, tokens, start, tag, size), cuts)

    def _entries(self) -> Iterable[tuple[Path, int, float]]:
        """``(path, size, mtime)`` of every entry the budget counts: moved-aside ones
        (``bad/``) first, then every model's, least recently used first."""
        bad: list[tuple[Path, int, float]] = []
        kept: list[tuple[Path, int, float]] = []
        for directory in self.base.iterdir():
            if directory.name in ("tmp", "digests") or not directory.is_dir():
                continue
            into = bad if directory.name == "bad" else kept
            for entry in os.scandir(directory):
                if entry.name.endswith(".kv") or into is bad:
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        into.append((Path(entry.path), st.st_size, st.st_mtime))
        return [*sorted(bad, key=lambda e: e[2]), *sorted(kept, key=lambda e: e[2])]

    def _fit(self, room: int = 0) -> None:
        """Over the budget (with ``room`` bytes more): the directory's moved-aside entries
        go, then its least recently used."""
        entries = list(self._entries())
        total = sum(size for _, size, _ in entries)
        for path, size, _ in entries:
            if total + room <= self.budget:
                break
            self._evict(path)
            total -= size
        self.held_bytes = total

    def _make_room(self, room: int) -> bool:
        """The filesystem is full: evict (moved-aside entries first, then the least
        recently used) what leaves ``room`` bytes free; False, evicting nothing, when the
        whole directory's entries could not (the filesystem is full of other files)."""
        try:
            st = os.statvfs(self.base)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        # (a quota, or a filesystem that says it has room and has none: free ``room``)
        need = room - free if free < room else room
        entries = list(self._entries())
        if sum(size for _, size, _ in entries) < need:
            return False
        freed = 0
        for path, size, _ in entries:
            if freed >= need:
                break
            self._evict(path)
            freed += size
        self.held_bytes = max(0, self.held_bytes - freed)
        return True

    def _evict(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
            self.evictions += 1

    def quarantine(self, path: Path, why: str) -> None:
        """Move a bad entry aside (``bad/``), logged: a miss, never a crash."""
        self.bad_entries += 1
        logger.warning(
            "the disk cache entry %s is unusable (%s): moved aside; the prompt is evaluated", path, why
        )
        with contextlib.suppress(OSError):
            os.replace(path, self.base / "bad" / f"{path.parent.name}-{path.name}")
