"""The native glue of a load: llama.cpp's abort callback (from :mod:`.._aborting`) and
its log lines forwarded to Python logging, with the errors of the load
running in this thread kept to say why a GGUF cannot be used."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

from .._aborting import LoadAborted, make_abort_callback

__all__ = [
    "LoadAborted",
    "LoadLog",
    "capture_errors",
    "load_errors",
    "make_abort_callback",
    "make_log_callback",
    "meta_value",
]

logger = logging.getLogger("trioserve.llama")


_llama_cpp_logger = logging.getLogger("trioserve.llama_cpp")


def _forward_log(level: int, text: bytes, _data: object) -> None:
    """llama.cpp's log lines → Python logging, at DEBUG — except errors while a model
    loads, which go to WARNING (they say why a GGUF cannot be used). After loading,
    llama.cpp's errors come back as return codes, which trioserve reports itself (an
    aborted decode logs three error lines that are not errors here)."""
    if level == 4 and LoadLog.loading:  # GGML_LOG_LEVEL_ERROR (NONE, DEBUG, INFO, WARN, ERROR, CONT)
        line = text.decode("utf-8", errors="replace").rstrip()
        _llama_cpp_logger.warning("%s", line)
        errors = getattr(load_errors, "lines", None)
        if errors is not None and len(errors) < 8:
            errors.append(line)  # this thread's load: its error names the cause
    elif LoadLog.loading and text.startswith(b"llama_kv_cache: size ="):
        # (a context being made: the KV cache's size as llama.cpp counts it, per cache)
        sizes = getattr(load_errors, "kv_sizes", None)
        if sizes is not None and len(sizes) < 8:
            sizes.append(text.decode("utf-8", errors="replace").rstrip())
        _llama_cpp_logger.debug("%s", text.decode("utf-8", errors="replace").rstrip())
    elif _llama_cpp_logger.isEnabledFor(logging.DEBUG):
        _llama_cpp_logger.debug("%s", text.decode("utf-8", errors="replace").rstrip())


def make_log_callback() -> Any:
    import llama_cpp

    return llama_cpp.llama_log_callback(_forward_log)


#: the llama.cpp error lines of the load running in this thread
load_errors = threading.local()


class LoadLog:
    callback: Any = None
    loading = 0


@contextlib.contextmanager
def capture_errors() -> Iterator[list[str]]:
    """llama.cpp's error lines in this thread while the block runs (a context being
    made, at load: its error line says why it cannot be), as during a model's load
    (whose :func:`~._loading.load` installed the forwarder)."""
    before = getattr(load_errors, "lines", None), getattr(load_errors, "kv_sizes", None)
    lines: list[str] = []
    load_errors.lines = lines
    load_errors.kv_sizes = []
    LoadLog.loading += 1
    try:
        yield lines
    finally:
        LoadLog.loading -= 1
        load_errors.lines, load_errors.kv_sizes = before


def kv_size_lines() -> list[str]:
    """llama.cpp's ``llama_kv_cache: size = …`` lines of the context made in this
    thread's :func:`capture_errors` block (read inside it): one per cache (two for a
    sliding-window model's cells kept to the window)."""
    return list(getattr(load_errors, "kv_sizes", None) or [])


def meta_value(lib: Any, model: Any, key: str) -> str | None:
    """A GGUF metadata value of a loaded ``model`` as text (``None``: no such key)."""
    size = 1 << 16
    buffer = ctypes.create_string_buffer(size)
    n = lib.llama_model_meta_val_str(model, key.encode(), buffer, size)
    if n < 0:
        return None
    if n >= size:  # a huge chat template: ask again with room for it
        buffer = ctypes.create_string_buffer(n + 1)
        lib.llama_model_meta_val_str(model, key.encode(), buffer, n + 1)
    return buffer.value.decode("utf-8", errors="replace")
