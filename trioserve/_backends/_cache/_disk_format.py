"""The disk tier's file format and identities (docs/prompt-cache.md, "On disk"): an
entry's bytes, the digest of a salt, the chained digests of a prompt's prefixes at its
cuts, a GGUF's content digest and a model's cells' fingerprint; how a file is created
(0600, in directories made 0700, whatever the umask: an entry holds a user's prompt) and
published (``rename`` after ``fsync``; the temporary file removed on any failure). Pure
Python."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "CRC",
    "HEAD",
    "MAGIC",
    "PIECE",
    "STALE_SECONDS",
    "DiskEntry",
    "alive",
    "chain",
    "create",
    "fingerprint",
    "gguf_digest",
    "private_dir",
    "probe_writable",
    "read_header",
    "salt_tag",
    "write_atomic",
    "write_entry",
]

MAGIC = b"TSKV\x01\n"
#: magic, then the header's length (u32) and the header (JSON), the tokens (int32 each),
#: the state, and the CRC-32 of everything before it (u32)
HEAD = struct.Struct("<6sI")
CRC = struct.Struct("<I")
#: bytes read per piece of a restore (a cancel is seen between pieces)
PIECE = 4 << 20
#: a temporary file older than this, of a process that is gone, is a leftover
STALE_SECONDS = 3600.0


def salt_tag(salt: str) -> str:
    """What an entry says of its salt: a digest, never the salt (a salt is derived from
    an API key; the file may be read by anyone who can read the directory)."""
    return hashlib.blake2b(salt.encode(), digest_size=16).hexdigest() if salt else ""


def chain(tokens: Sequence[int], cuts: Sequence[int], limit: int, tag: str) -> list[tuple[int, bytes]]:
    """``(cut, digest)`` of ``tokens``' prefixes ending at ``cuts`` (at most ``limit``),
    under the salt ``tag``: each identifies ``tokens[:cut]`` (chained on the one before)."""
    out: list[tuple[int, bytes]] = []
    h = hashlib.blake2b(tag.encode(), digest_size=16).digest()
    start = 0
    for c in cuts:
        if c > limit or c > len(tokens):
            break
        h = hashlib.blake2b(h + struct.pack(f"<{c - start}i", *tokens[start:c]), digest_size=16).digest()
        out.append((c, h))
        start = c
    return out


def gguf_digest(
    path: Path, store_root: Path | None = None, *, check: Callable[[], None] | None = None
) -> str:
    """The SHA-256 of a GGUF's content (every shard of a split model), remembered under
    ``store_root``/v1/digests by (device, inode, size, mtime): a file that changes gets a
    new digest; the same content under another name or path, the same digest.
    ``check`` is called between megabytes (a load's abort: it raises)."""
    files = [path]
    if "-00001-of-" in path.name:
        files = sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
    parts = []
    for file in files:
        st = file.stat()
        stamp = f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
        remembered = store_root / "v1" / "digests" / stamp if store_root is not None else None
        if remembered is not None and remembered.exists():
            with contextlib.suppress(OSError):
                text = remembered.read_text().strip()
                if len(text) == 64:
                    parts.append(text)
                    continue
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(8 << 20):
                if check is not None:
                    check()
                digest.update(chunk)
        text = digest.hexdigest()
        if remembered is not None:
            with contextlib.suppress(OSError):
                private_dir(remembered.parent)
                write_atomic(remembered, text.encode())
        parts.append(text)
    return parts[0] if len(parts) == 1 else hashlib.sha256("".join(parts).encode()).hexdigest()


def fingerprint(content: str, settings: Mapping[str, object], build: str) -> str:
    """A model's cells' identity: its GGUF's content digest, the settings that change
    what a prefix's cells hold (KV types, context size, rope, sliding window, flash
    attention, batch invariance, the cut…), and the llama.cpp build."""
    made_of = json.dumps({"gguf": content, "settings": dict(settings), "build": build}, sort_keys=True)
    return hashlib.sha256(made_of.encode()).hexdigest()[:32]


def private_dir(path: Path, *, tighten: bool = True) -> None:
    """Make ``path`` a directory only its owner can enter or list: it and every missing
    parent created 0700 whatever the umask; an existing one looser than that tightened
    (``tighten``; the operator's own ``--cache-dir`` is left as it is). ``OSError``: it
    cannot be made (a read-only or full filesystem, another user's directory)."""
    missing: list[Path] = []
    at = path
    while not os.path.lexists(at) and at.parent != at:
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (another process made it first)
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)  # (the umask may have taken bits from 0700)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    if tighten and os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)


def create(path: Path) -> BinaryIO:
    """A new file only its owner can read (0600 whatever the umask), open for writing;
    never through a symbolic link, never an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def probe_writable(directory: Path) -> None:
    """Create and remove an empty file in ``directory``: ``OSError`` where a write would
    fail whatever the space (a read-only filesystem, no permission — which ``os.access``
    does not tell for root)."""
    probe = directory / f"probe.{os.getpid()}.{threading.get_ident()}"
    try:
        create(probe).close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _publish(part: Path, final: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``part`` (``write``), ``fsync`` it and rename it to ``final``; on any failure
    (ENOSPC, EIO, a cancel…) ``part`` is removed before the error goes on."""
    try:
        with create(part) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    # a random part too: a file a crash left under the same pid (a container's server
    # is often pid 1 every time) must not make every later write fail (O_EXCL)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}")

    def write(f: BinaryIO) -> None:
        f.write(data)

    _publish(tmp, path, write)


@dataclass(slots=True, frozen=True)
class DiskEntry:
    """One entry on disk, as its tier's index knows it."""

    path: Path
    tokens: tuple[int, ...]
    #: the first position whose sliding-window cells the state holds
    start: int
    #: the salt's tag (:func:`salt_tag`)
    tag: str
    #: the file's size
    size: int


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_entry(
    tmp: Path,
    directory: Path,
    n: int,
    *,
    fingerprint: str,
    tokens: tuple[int, ...],
    cuts: list[int],
    start: int,
    tag: str,
    state: Any,
) -> tuple[Path, int]:
    """Write an entry to ``tmp`` (this process's ``n``-th; removed if the write fails),
    ``fsync`` it, publish it in ``directory`` by ``rename`` and make the rename durable;
    its path and size. The
    layout: magic, the header's length (u32) and the header (JSON: the fingerprint, the
    token count, the cuts, the window start, the salt's tag), the tokens (int32 each),
    the state, the CRC-32 of everything before it (u32). ``state``: bytes, or the host
    tier's buffer (its mapping is written as it is, not copied)."""
    packed = struct.pack(f"<{len(tokens)}i", *tokens)
    name = hashlib.blake2b(tag.encode() + packed, digest_size=20).hexdigest()
    header = json.dumps(
        {"fingerprint": fingerprint, "tokens": len(tokens), "cuts": cuts, "start": start, "salt": tag}
    ).encode()
    array = getattr(state, "array", None)
    blob = memoryview(array).cast("B")[: len(state)] if array is not None else memoryview(state)
    head = b"".join((HEAD.pack(MAGIC, len(header)), header, packed))
    part = tmp / f"{name}.{os.getpid()}.{n}"
    final = directory / f"{name}.kv"

    def write(f: BinaryIO) -> None:
        f.write(head)
        f.write(blob)
        f.write(CRC.pack(zlib.crc32(blob, zlib.crc32(head))))

    _publish(part, final, write)
    with contextlib.suppress(OSError):  # the rename itself, durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return final, len(head) + len(blob) + CRC.size


def read_header(path: Path, fingerprint: str) -> tuple[DiskEntry, list[int]]:
    """An entry's header and tokens (not its state); ``ValueError`` (and the like) for
    a file that is not an entry of this version, of this ``fingerprint``, whole."""
    with open(path, "rb") as f:
        magic, length = HEAD.unpack(f.read(HEAD.size))
        if magic != MAGIC or length > 1 << 24:
            raise ValueError("not an entry of this version")
        header = json.loads(f.read(length))
        if header.get("fingerprint") != fingerprint:
            raise ValueError(f"written for another model or setting ({header.get('fingerprint')})")
        n = int(header["tokens"])
        raw = f.read(4 * n)
        if len(raw) != 4 * n:
            raise ValueError("truncated")
        tokens = struct.unpack(f"<{n}i", raw)
        size = os.fstat(f.fileno()).st_size
    cuts = [int(c) for c in header["cuts"]]
    return DiskEntry(path, tokens, int(header["start"]), str(header["salt"]), size), cuts
