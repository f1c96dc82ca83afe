"""Where ``trioserve serve`` keeps files: ``--cache-dir``, ``--blobs-dir``,
``--responses-db`` (``auto``: the per-user cache or data directory)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["blobs_dir", "cache_dir", "responses_db"]


def cache_dir(value: str | None) -> Path | None:
    """``--cache-dir``: a directory, ``auto`` (the per-user cache directory) or none."""
    if value is None or value in ("", "off", "none"):
        return None
    if value == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "trioserve" / "prompt-cache"
    return Path(value).expanduser()


def blobs_dir(value: str) -> Path | None:
    """``--blobs-dir``: a directory, ``auto`` (the per-user data directory) or ``off``."""
    if value in ("", "off", "none"):
        return None
    if value == "auto":
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return Path(base) / "trioserve" / "blobs"
    return Path(value).expanduser()


def responses_db(value: str) -> str | None:
    """``--responses-db``: a file, ``auto`` (the per-user data directory), ``memory`` or
    ``off``."""
    if value in ("", "off", "none"):
        return None
    if value == "memory":
        return value
    if value == "auto":
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        return str(Path(base) / "trioserve" / "responses.sqlite3")
    return str(Path(value).expanduser())
