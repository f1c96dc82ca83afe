"""The memory a dropped sequence state gives back (trioserve/_backends/_cache/_memory.py)."""

from __future__ import annotations

import gc

from trioserve._backends._cache import StateBuffer, trim_heap


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_a_state_buffer_holds_what_is_written_and_reports_the_bytes_in_use() -> None:
    buffer = StateBuffer(4096)
    buffer.array[0:5] = list(b"state")
    buffer.used = 5
    assert len(buffer) == 5
    assert bytes(buffer) == b"state"
    assert bytes(StateBuffer.of(b"copied")) == b"copied"


def test_a_dropped_state_buffer_gives_its_memory_back_at_once() -> None:
    size = 64 * 2**20
    before = _resident_kib()
    buffer = StateBuffer(size)
    buffer.array[0:size:4096] = [1] * (size // 4096)  # touch every page
    assert _resident_kib() - before >= size // 1024 * 3 // 4
    del buffer
    gc.collect()
    assert _resident_kib() - before < size // 1024 // 4  # unmapped, not kept in a heap


def test_trim_heap_runs_and_says_whether_it_released_anything() -> None:
    assert trim_heap() in (True, False)
