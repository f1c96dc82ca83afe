"""The prompt cache's disk tier under faults (docs/prompt-cache.md, "On disk"), without a
model: a write that fails leaves nothing behind; a full filesystem makes room (the least
recently used entries) and the write is tried once more, or fails alone when the disk is
full of other files, and writes work again once space frees; moved-aside entries count
under the budget and go first; a directory nothing can be written to is refused when the
store opens; entries are 0600 in a 0700 tree whatever the umask. The full and read-only
filesystems are a real tmpfs where the test can mount one (tests/_small_disk.py)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from trioserve._backends._cache import DiskStore, DiskTier, _disk_format
from trioserve._backends._cache._disk_format import write_atomic

from ..._small_disk import SmallDisk

FP = "f" * 32
CUTS = [16, 32, 48, 64]
#: a state of 192 KiB: a 1 MiB filesystem holds four entries, not five
STATE = bytes(range(256)) * 768


def _tokens(i: int) -> list[int]:
    return [1000 + i] * 64


def _put(store: DiskStore, tier: DiskTier, i: int, state: bytes = STATE) -> None:
    assert tier.put(_tokens(i), CUTS, state, start=0, salt="")
    assert store.flush(timeout=10)


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallDisk]:
    small = SmallDisk(tmp_path / "small", 1 << 20, monkeypatch)
    try:
        yield small
    finally:
        small.close()


def test_entries_are_0600_in_a_0700_tree_whatever_the_umask(tmp_path: Path) -> None:
    # an earlier version's tree: world-readable
    old = tmp_path / "old" / "v1"
    old.mkdir(parents=True, mode=0o755)
    os.chmod(old, 0o755)
    for umask in (0o000, 0o022, 0o277):
        was = os.umask(umask)
        try:
            root = tmp_path / "new" / f"{umask:o}" / "cache"  # (its parents missing too)
            for where in (root, tmp_path / "old"):
                store = DiskStore(where, 1 << 30)
                _put(store, store.tier(FP, made_of={"gguf_sha256": "x"}), 1)
                store.close()
                write_atomic(where / "v1" / "digests" / "stamp", b"0" * 64)
        finally:
            os.umask(was)
        for path in [*root.parent.parent.rglob("*"), root.parent.parent]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o700 if path.is_dir() else 0o600), (oct(umask), path, oct(mode))
    assert stat.S_IMODE(old.stat().st_mode) == 0o700  # tightened: its files are out of reach


class _Failing:
    """A file that writes half of the first write, then fails with ``error``."""

    def __init__(self, f: BinaryIO, error: BaseException) -> None:
        self._f = f
        self._error = error

    def write(self, data: Any) -> int:
        self._f.write(memoryview(data).cast("B")[: len(memoryview(data).cast("B")) // 2])
        self._f.flush()
        raise self._error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Failing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._f.close()


def _leftovers(root: Path) -> list[Path]:
    return [p for p in (root / "v1" / "tmp").iterdir()] + [p for p in root.rglob(".*") if p.is_file()]


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.EIO, "Input/output error"),
        OSError(errno.ENOSPC, "No space left on device"),  # (nothing to evict: fails once)
        RuntimeError("a bug"),
    ],
    ids=["EIO", "ENOSPC", "not an OSError"],
)
def test_a_write_that_fails_leaves_no_temp_file_and_the_next_one_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    real = _disk_format.create
    monkeypatch.setattr(_disk_format, "create", lambda path: _Failing(real(path), error))
    store = DiskStore(tmp_path / "cache", 1 << 30)
    tier = store.tier(FP)
    _put(store, tier, 1)
    assert store.failed_writes == 1
    assert store.writes == 0
    assert _leftovers(tmp_path / "cache") == []
    stats = tier.stats()
    assert stats["state"] == "failing"
    assert str(error) in str(stats["error"])
    # the small files written beside the entries leave nothing either
    with pytest.raises(type(error)):
        write_atomic(tmp_path / "cache" / "v1" / "digests" / "stamp", b"0" * 64)
    assert _leftovers(tmp_path / "cache") == []
    monkeypatch.setattr(_disk_format, "create", real)
    _put(store, tier, 2)
    assert store.writes == 1
    assert tier.stats()["state"] == "ok"
    assert len(tier) == 1
    store.close()


def test_a_full_disk_evicts_the_least_recently_used_and_writes_again(disk: SmallDisk) -> None:
    """The budget (1 GiB) is larger than the filesystem (1 MiB): each write past what it
    holds evicts the oldest entries and is tried once more — the disk never stays full."""
    store = DiskStore(disk.path, 1 << 30)
    tier = store.tier(FP)
    for i in range(10):
        _put(store, tier, i)
    assert (store.writes, store.failed_writes) == (10, 0)
    assert store.evictions >= 6
    assert disk.temp_files() == []
    # the newest entries are the ones kept, and they read back whole
    found = tier.best(_tokens(9), CUTS, 64)
    assert found is not None
    assert bytes(tier.read(found[1]) or b"") == STATE
    assert tier.best(_tokens(0), CUTS, 64) is None
    assert tier.stats()["state"] == "ok"
    store.close()


def test_a_disk_full_of_other_files_fails_the_write_alone_and_writes_again_once_space_frees(
    disk: SmallDisk,
) -> None:
    store = DiskStore(disk.path, 1 << 30)
    tier = store.tier(FP)
    _put(store, tier, 1)
    disk.fill()
    _put(store, tier, 2)
    # evicting entry 1 would not make room: it is kept, the write fails alone
    assert (store.writes, store.failed_writes, store.evictions) == (1, 1, 0)
    assert disk.temp_files() == []
    assert len(disk.entries()) == 1
    stats = tier.stats()
    assert stats["state"] == "failing"
    assert "No space left on device" in str(stats["error"])
    disk.free()
    _put(store, tier, 3)
    assert (store.writes, store.failed_writes) == (2, 1)
    assert tier.stats()["state"] == "ok"
    assert tier.best(_tokens(3), CUTS, 64) is not None
    assert disk.temp_files() == []
    store.close()


def test_moved_aside_entries_count_under_the_budget_and_go_first(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "cache", 3 * (len(STATE) + 1024))
    tier = store.tier(FP)
    for i in range(3):
        _put(store, tier, i)
    # entry 2 (the newest) is damaged: its read moves it aside, where it still counts
    found = tier.best(_tokens(2), CUTS, 64)
    assert found is not None
    data = bytearray(found[1].path.read_bytes())
    data[-100] ^= 1
    found[1].path.write_bytes(bytes(data))
    assert tier.read(found[1]) is None
    bad = list((tmp_path / "cache" / "v1" / "bad").iterdir())
    assert len(bad) == 1
    assert store.bytes == 3 * bad[0].stat().st_size
    # the next write needs room: the moved-aside entry goes before any usable one
    _put(store, tier, 3)
    assert list((tmp_path / "cache" / "v1" / "bad").iterdir()) == []
    assert [i for i in range(4) if tier.best(_tokens(i), CUTS, 64)] == [0, 1, 3]
    store.close()


@pytest.mark.parametrize("before", ["empty", "an earlier run's tree"])
def test_a_read_only_directory_is_refused_when_the_store_opens(disk: SmallDisk, before: str) -> None:
    """(Root ignores a directory's mode bits: only a read-only filesystem — or the
    injected EROFS — stops it.) The model runs without the tier then
    (tests/e2e/test_disk_cache.py)."""
    if before != "empty":
        store = DiskStore(disk.path, 1 << 30)
        _put(store, store.tier(FP), 1)
        store.close()
    disk.read_only()
    with pytest.raises(OSError, match="Read-only file system") as caught:
        DiskStore(disk.path, 1 << 30)
    assert caught.value.errno == errno.EROFS


def test_a_temp_file_a_crash_left_does_not_block_the_next_write(tmp_path: Path) -> None:
    """A server restarted under the same pid (a container's pid 1) finds the temp file
    its crashed predecessor left: the write still succeeds (files are created
    ``O_EXCL``, so a fixed temp name would fail every later write)."""
    import threading

    target = tmp_path / "model.json"
    left = tmp_path / f".model.json.{os.getpid()}.{threading.get_ident()}"
    left.write_bytes(b"half")
    write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}"
