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
import mmap
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from ._disk_format import (
    CRC,
    HEAD,
    MAGIC,
    PIECE,
    STALE_SECONDS,
    DiskEntry,
    alive,
    chain,
    fingerprint,
    gguf_digest,
    private_dir,
    probe_writable,
    read_header,
    salt_tag,
    write_atomic,
    write_entry,
)

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


class DiskTier:
    """One model's entries in a :class:`DiskStore` (its fingerprint's directory).

    The index (prefix digests at each entry's cuts, under its salt's tag) is built from
    the files' headers when the tier is made and kept by this process's writes; each
    lookup reads the headers of entries another process wrote since, when the
    directory changed (one ``stat`` per lookup). Thread-safe."""

    def __init__(self, store: DiskStore, directory: Path, *, window: int = 0) -> None:
        self.store = store
        self.directory = directory
        #: the identity of the cells its entries hold (:func:`fingerprint`)
        self.fingerprint = directory.name
        self.window = window
        self._lock = threading.Lock()
        self._entries: dict[Path, DiskEntry] = {}
        self._index: dict[bytes, set[Path]] = {}
        self._seen_mtime = 0
        #: counters
        self.restores = 0
        self.restored_tokens = 0
        self.misses = 0
        self.scan()

    def stats(self) -> dict[str, object]:
        """This tier and its store, for ``/health`` and ``/metrics`` (no directory scan:
        the store's bytes are as of its last write)."""
        store = self.store
        return {
            "directory": str(self.directory),
            "budget_bytes": store.budget,
            "bytes": store.held_bytes,
            "prefixes": len(self),
            "restores": self.restores,
            "restored_tokens": self.restored_tokens,
            "misses": self.misses,
            "writes": store.writes,
            "write_bytes": store.write_bytes,
            "dropped_writes": store.dropped_writes,
            "failed_writes": store.failed_writes,
            "pending_writes": store.pending_writes,
            "evictions": store.evictions,
            "bad_entries": store.bad_entries,
            # "ok", or "failing" while writes fail (a full or broken disk: ``error`` says
            # why); requests are answered either way
            "state": "ok" if store.failing is None else "failing",
            "error": store.failing,
        }

    # ------------------------------------------------------------ the index

    def scan(self) -> None:
        """Read the headers of the directory's entries (those not known yet)."""
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            return
        with self._lock:
            known = set(self._entries)
            self._seen_mtime = mtime
        present: set[Path] = set()
        for item in os.scandir(self.directory):
            if not item.name.endswith(".kv"):
                continue
            path = Path(item.path)
            present.add(path)
            if path in known:
                continue
            read = self._read_header(path)
            if read is not None:
                entry, cuts = read
                self.add(entry, cuts)
        with self._lock:
            for gone in known - present:
                self._remove(gone)

    def _read_header(self, path: Path) -> tuple[DiskEntry, list[int]] | None:
        try:
            return read_header(path, self.fingerprint)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            self.store.quarantine(path, f"header: {e}")
            return None

    def add(self, entry: DiskEntry, cuts: list[int]) -> None:
        digests = chain(entry.tokens, cuts, len(entry.tokens), entry.tag)
        with self._lock:
            self._entries[entry.path] = entry
            for _, h in digests:
                self._index.setdefault(h, set()).add(entry.path)

    def _remove(self, path: Path) -> None:
        self._entries.pop(path, None)
        for h in [h for h, paths in self._index.items() if path in paths]:
            paths = self._index[h]
            paths.discard(path)
            if not paths:
                del self._index[h]

    def __len__(self) -> int:
        return len(self._entries)

    def serves(self, start: int, shared: int) -> bool:
        """As :meth:`HostCache.serves`: cells whose window layers start at ``start`` give
        back their first ``shared`` tokens exactly."""
        return not self.window or start <= max(0, shared - self.window + 1)

    def covers_tag(self, tokens: Sequence[int], cuts: Sequence[int], tag: str) -> bool:
        n = len(tokens)
        digests = chain(tokens, cuts, n, tag)
        if not digests or digests[-1][0] != n:
            return False
        with self._lock:
            for path in self._index.get(digests[-1][1], ()):
                entry = self._entries[path]
                if entry.tokens[:n] == tuple(tokens) and self.serves(entry.start, n) and path.exists():
                    return True
        return False

    def covers(self, tokens: Sequence[int], cuts: Sequence[int], *, salt: str = "") -> bool:
        """Whether an entry of ``salt`` holds ``tokens`` (as itself or as its prefix)."""
        return self.covers_tag(tokens, cuts, salt_tag(salt))

    def put(self, tokens: Sequence[int], cuts: Sequence[int], state: Any, *, start: int, salt: str) -> bool:
        """Queue ``state``, the cells of ``tokens`` (window cells from ``start``), for the
        prompts of ``salt``."""
        return self.store.submit(self, tuple(tokens), list(cuts), start, salt_tag(salt), state)

    def best(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int, *, salt: str = ""
    ) -> tuple[int, DiskEntry] | None:
        """``(shared tokens, entry)`` of the entry of ``salt`` sharing the most whole
        pieces with ``prompt`` (at most ``limit`` tokens), or ``None``."""
        try:
            changed = self.directory.stat().st_mtime_ns != self._seen_mtime
        except OSError:
            changed = False
        if changed:
            # another process wrote (or evicted) since: read the new entries' headers
            # first — a shorter prefix found in the index must not hide a longer one a
            # worker behind the same gateway has just written (docs/deployment.md)
            self.scan()
        return self._best(prompt, cuts, limit, salt_tag(salt))

    def _best(
        self, prompt: Sequence[int], cuts: Sequence[int], limit: int, tag: str
    ) -> tuple[int, DiskEntry] | None:
        best: tuple[int, DiskEntry] | None = None
        with self._lock:
            for c, h in chain(prompt, cuts, limit, tag):
                paths = self._index.get(h)
                if not paths:
                    break
                usable = next(
                    (self._entries[p] for p in paths if self.serves(self._entries[p].start, c)), None
                )
                if usable is not None:
                    best = (c, usable)
        if best is not None and best[1].tokens[: best[0]] != tuple(prompt[: best[0]]):  # pragma: no cover
            return None  # (a 128-bit digest collision)
        return best

    # ------------------------------------------------------------ restoring

    def read(self, entry: DiskEntry, *, cancelled: Callable[[], bool] = lambda: False) -> memoryview | None:
        """The state of ``entry`` (a writable view: llama.cpp reads it in place), its
        checksum verified; ``None``: a miss (gone, bad —
        moved aside, logged — or ``cancelled()`` became true between pieces)."""
        path = entry.path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size or size < HEAD.size + CRC.size:
                    raise ValueError(f"{size} bytes where {entry.size} were written")
                # mapped, not read: the page cache's pages are the state llama.cpp copies
                # into the cells (private: nothing written back; an entry is replaced or
                # unlinked, never truncated in place, so the mapping stays whole)
                mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            self.misses += 1
            with self._lock:
                self._remove(path)
            return None
        except (OSError, ValueError) as e:
            self.misses += 1
            with self._lock:
                self._remove(path)
            self.store.quarantine(path, str(e))
            return None
        view = memoryview(mapped)
        end = size - CRC.size
        crc = 0
        for start in range(0, end, PIECE):
            if cancelled():
                return None
            crc = zlib.crc32(view[start : min(start + PIECE, end)], crc)
        magic, length = HEAD.unpack(view[: HEAD.size])
        if crc != CRC.unpack(view[end:])[0] or magic != MAGIC:
            self.misses += 1
            with self._lock:
                self._remove(path)
            self.store.quarantine(path, "checksum")
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the budget's eviction takes it last
        offset = HEAD.size + length + 4 * len(entry.tokens)
        self.restores += 1
        return view[offset:end]
