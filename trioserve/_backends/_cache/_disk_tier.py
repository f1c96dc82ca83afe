"""One model's entries in the prompt cache's disk tier (docs/prompt-cache.md, "On
disk"): the index of its fingerprint's directory, lookups and restores. The directory,
the budget and the writer are the store's (:mod:`._disk_cache`). Pure Python."""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ._disk_format import CRC, HEAD, MAGIC, PIECE, DiskEntry, chain, read_header, salt_tag


class DiskStore(Protocol):
    """What a tier reads and asks of the :class:`~._disk_cache.DiskStore` it belongs to
    (its budget and counters, the write queue, quarantine): a protocol, so that the
    tier names no class of the module that makes it."""

    @property
    def budget(self) -> int: ...

    @property
    def held_bytes(self) -> int: ...

    @property
    def writes(self) -> int: ...

    @property
    def write_bytes(self) -> int: ...

    @property
    def dropped_writes(self) -> int: ...

    @property
    def failed_writes(self) -> int: ...

    @property
    def pending_writes(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    @property
    def bad_entries(self) -> int: ...

    @property
    def failing(self) -> str | None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def quarantine(self, path: Path, why: str) -> None: ...

    def submit(
        self, tier: DiskTier, tokens: tuple[int, ...], cuts: list[int], start: int, tag: str, state: Any
    ) -> bool: ...


__all__ = ["DiskTier"]


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
