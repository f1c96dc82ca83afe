"""How llama.cpp work is stopped from outside its thread: the abort callback a context
checks between graph nodes (``_abort.c``, or a Python fallback), and the error a load
stopped that way raises. Below the llama engine and retrieval alike (both make
contexts that a cancel stops)."""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Any

from .._core._exceptions import BackendError

__all__ = ["LoadAborted", "make_abort_callback"]

logger = logging.getLogger("trioserve.llama")


def _abort_requested(data: int) -> bool:
    """The pure-Python abort callback, used only if the C one (``_abort.c``) was not
    built: reads the flag byte at ``data``. Called from C; it must never raise."""
    return bool(ctypes.c_ubyte.from_address(data).value)


def make_abort_callback(lib: Any) -> tuple[Any, bool]:
    """The abort callback, and whether it is the C one."""
    try:
        # (by name: the C extension is no module the import graph's scanner sees)
        abort = importlib.import_module("trioserve._backends._abort")
    except ImportError:  # pragma: no cover - the extension is built on install
        logger.warning(
            "trioserve._backends._abort (C) is not built: using a Python abort callback, which "
            "costs ~10%% of decode speed; reinstall trioserve with a C compiler"
        )
        return lib.ggml_abort_callback(_abort_requested), False
    return lib.ggml_abort_callback(abort.ABORT_CHECK_ADDRESS), True


class LoadAborted(BackendError):
    """A load stopped because nobody wanted it any more (``aload``'s cancel)."""
