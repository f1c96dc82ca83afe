"""A small filesystem for the prompt cache's disk tier under faults (a full disk, a
read-only one): a real tmpfs mounted by the test where it can mount one (root with
CAP_SYS_ADMIN, as on the CI machine), else a plain directory where the disk tier's file
writes raise ``OSError(ENOSPC)`` past the size (and ``OSError(EROFS)`` when made
read-only) — injected by wrapping ``_disk_format.create``, the one place the tier
creates files. Which of the two a test ran on is printed; it runs either way, never
skipped."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from trioserve._backends._cache import _disk_format

__all__ = ["SmallDisk"]

_BALLAST = "ballast"


class SmallDisk:
    """``size`` bytes at ``path``; :meth:`fill` puts another program's file there (the
    ballast) leaving ``leave`` bytes free, :meth:`free` removes it, :meth:`read_only`
    turns the filesystem read-only."""

    def __init__(self, path: Path, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        self.size = size
        self._patch = monkeypatch
        path.mkdir(parents=True, exist_ok=True)
        try:
            mount = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                capture_output=True,
                text=True,
            )
            why = (mount.stderr or mount.stdout).strip() or f"exit {mount.returncode}"
            self.mounted = mount.returncode == 0
        except OSError as e:  # (no mount program)
            why, self.mounted = str(e), False
        self._ballast = 0  # (injected: the bytes another program holds)
        self._read_only = False
        if self.mounted:
            print(f"small disk: a tmpfs of {size} bytes mounted at {path}")
        else:
            print(
                f"small disk: no mount here ({why}, uid {os.getuid()}): OSError(ENOSPC) past {size} "
                f"bytes and OSError(EROFS) injected into the disk tier's writes under {path}"
            )
            self._real_create = _disk_format.create
            monkeypatch.setattr(_disk_format, "create", self._create)

    # ------------------------------------------------------------ the faults

    def fill(self, leave: int = 0) -> None:
        """Another program's file takes all the space but ``leave`` bytes."""
        if not self.mounted:
            self._ballast = max(0, self.size - self.used() - leave)
            return
        fd = os.open(self.path / _BALLAST, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            chunk = b"\0" * (1 << 20)
            while True:
                try:
                    os.write(fd, chunk)  # (a short write, then ENOSPC)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))  # (tmpfs gives the pages back)
        finally:
            os.close(fd)

    def free(self) -> None:
        """That program's file is removed."""
        self._ballast = 0
        if self.mounted:
            (self.path / _BALLAST).unlink(missing_ok=True)

    def read_only(self) -> None:
        if self.mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)
        else:
            self._read_only = True

    def close(self) -> None:
        if self.mounted and subprocess.run(["umount", str(self.path)]).returncode:
            subprocess.run(["umount", "-l", str(self.path)], check=True)  # (still held: detach)

    # ------------------------------------------------------------ what the tier left

    def temp_files(self) -> list[Path]:
        """Files being written or left behind: ``v1/tmp/`` and the atomic writes' ``.*``."""
        tmp = [p for p in (self.path / "v1" / "tmp").glob("*") if p.is_file()]
        return tmp + [p for p in self.path.rglob(".*") if p.is_file()]

    def entries(self) -> list[Path]:
        return sorted(self.path.glob("v1/*/*.kv"))

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file()) + self._ballast

    # ------------------------------------------------------------ the injection

    def _create(self, path: Path) -> BinaryIO:
        if self._read_only and path.is_relative_to(self.path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        f = self._real_create(path)
        return _Limited(f, self) if path.is_relative_to(self.path) else f  # type: ignore[return-value]


class _Limited:
    """A file whose writes fail with ENOSPC once the small disk would hold more than its
    size (part of what was asked is written first, as a real full disk does)."""

    def __init__(self, f: BinaryIO, disk: SmallDisk) -> None:
        self._f = f
        self._disk = disk

    def write(self, data: Any) -> int:
        self._f.flush()
        room = self._disk.size - self._disk.used()
        size = memoryview(data).nbytes
        if size > room:
            self._f.write(memoryview(data).cast("B")[: max(0, room)])
            self._f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Limited:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._f.close()
