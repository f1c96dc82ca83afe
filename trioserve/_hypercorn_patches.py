"""A fix for hypercorn's HTTP/2 send buffer, applied when trioserve serves.

hypercorn (0.17, 0.18) buffers each HTTP/2 response stream in a ``StreamBuffer`` that
should pause the application once 32 KiB are waiting. ``StreamBuffer.pop`` resumes the
writer when the *chunk it popped* is under the low-water mark, rather than when the
*buffer* has drained under it. When a client stops granting flow-control window, the
send task pops zero bytes — on every push, since each push wakes it — and so lets the
writer straight back in: the buffer grows without bound and inference never pauses
(measured: 1,244 tokens buffered in 3 s for a client that read nothing). The same fix
was merged in the anycorn fork (davidbrochart/anycorn#61).

The patch replaces ``pop`` with the corrected rule and nothing else; it checks that
the class still looks as expected, and leaves it alone otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["patch_hypercorn_h2_backpressure"]

logger = logging.getLogger("trioserve.server")


def patch_hypercorn_h2_backpressure() -> bool:
    """Apply the fix once; return whether it is in place."""
    try:
        from hypercorn.protocol import h2 as hypercorn_h2
    except ImportError:  # pragma: no cover
        return False
    buffer_class: Any = getattr(hypercorn_h2, "StreamBuffer", None)
    low_water = getattr(hypercorn_h2, "BUFFER_LOW_WATER", None)
    if buffer_class is None or low_water is None or not hasattr(buffer_class, "pop"):
        logger.warning("hypercorn's HTTP/2 StreamBuffer changed; its backpressure fix is not applied")
        return False
    if getattr(buffer_class.pop, "_trioserve_fixed", False):
        return True

    async def pop(self: Any, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < low_water:  # what has drained, not what was taken
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data

    pop._trioserve_fixed = True  # type: ignore[attr-defined]
    buffer_class.pop = pop
    return True
