"""Memory that goes back to the system when a sequence's state is dropped.

glibc's allocator keeps what a thread frees in that thread's arena, and raises its mmap
threshold to the largest block freed so far (up to 32 MiB): after the first saved
sequence state (megabytes) is freed, every later state, logits copy and sampler buffer
of that size comes from the arena's heap and stays resident when freed. Measured on
the model soak (docs/benchmarks.md, "Soak"): +161–221 MiB of RSS after 120–300 requests,
in two per-thread arenas, none in llama.cpp's own buffers. Two changes bring it back:

* :class:`StateBuffer`: a sequence state (a host-tier entry, a choice's copy of its
  leader's prompt) lives in an anonymous mapping of its own, never in the heap: dropping
  it unmaps it, whatever the thread;
* :func:`trim_heap`: ``malloc_trim(0)`` gives the free pages of every arena back; the
  scheduler thread calls it when it goes idle after sequences ended (never on the
  per-token path).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Any

__all__ = ["StateBuffer", "trim_heap"]


class StateBuffer:
    """``size`` bytes in an anonymous mapping, for llama.cpp to fill
    (``llama_state_seq_get_data``) or read (``llama_state_seq_set_data``).

    ``len()`` is the bytes in use (``used``, set after a fill); pages past it are never
    touched, so they cost no memory. The mapping goes when the last reference does."""

    __slots__ = ("_map", "array", "used")

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        #: the ctypes view llama.cpp reads or writes
        self.array: Any = (ctypes.c_uint8 * max(size, 1)).from_buffer(self._map)
        self.used = size

    @classmethod
    def of(cls, data: bytes) -> StateBuffer:
        """A buffer holding a copy of ``data`` (tests, a state read from elsewhere)."""
        buffer = cls(len(data))
        buffer._map[: len(data)] = data
        return buffer

    def __len__(self) -> int:
        return self.used

    def __bytes__(self) -> bytes:
        return self._map[: self.used]


def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the free pages of every malloc arena back to the system (glibc's
    ``malloc_trim(0)``; a no-op elsewhere). Returns whether memory was released.
    Takes each arena's lock in turn: call it from a thread that is idle anyway."""
    return bool(_TRIM(0)) if _TRIM is not None else False
