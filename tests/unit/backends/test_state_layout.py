"""A restored state's window cells put where a fresh evaluation put them
(``_backends/_llama/_state_layout.py``; docs/prompt-cache.md, "Window cells in their
places"), with the real model and llama.cpp's own state calls.

Measured before the layout was rewritten: restored as llama.cpp writes it, a 1,000-token
state's next logits differed from the fresh sequence's in every run (their texts in one
conversation of 12: ``tests/e2e/test_disk_cache.py``)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import llama_cpp
import numpy
import pytest

from trioserve._backends._cache import StateBuffer
from trioserve._backends._llama._state_layout import aligned

from ...conftest import THREADS

pytestmark = pytest.mark.model

WINDOW = 512  # Gemma 3's sliding window
PIECE = 128


class _Context:
    """Two sequences of a context made as trioserve makes its own (one stream per
    sequence, the window layers keeping every cell)."""

    def __init__(self, model: Any, *, flash: bool) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 4096
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = 2
        params.n_threads = params.n_threads_batch = THREADS
        params.swa_full = True
        params.kv_unified = False
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        assert self.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def decode(self, seq_id: int, tokens: list[int], start: int) -> numpy.ndarray:
        """Evaluate ``tokens`` from position ``start`` in pieces; every row's logits of
        the last piece."""
        rows = numpy.empty(0)
        for at in range(0, len(tokens), PIECE):
            piece = tokens[at : at + PIECE]
            batch = self.batch
            batch.n_tokens = len(piece)
            for i, token in enumerate(piece):
                batch.token[i] = token
                batch.pos[i] = start + at + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 1
            assert llama_cpp.llama_decode(self.ctx, batch) == 0
            logits = llama_cpp.llama_get_logits(self.ctx)
            rows = numpy.ctypeslib.as_array(logits, shape=(len(piece) * self.n_vocab,)).copy()
        return rows

    def state(self, seq_id: int) -> StateBuffer:
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq_id)
        state = StateBuffer(size)
        state.used = llama_cpp.llama_state_seq_get_data(self.ctx, state.array, size, seq_id)
        assert state.used
        return state


@pytest.fixture(scope="module")
def model(model_path: str) -> Iterator[Any]:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    loaded = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    assert loaded
    yield loaded
    llama_cpp.llama_model_free(loaded)


def _tokens(n: int, salt: int) -> list[int]:
    return [200 + (i * 7919 + salt) % 20000 for i in range(n)]


@pytest.mark.parametrize("flash", [True, False], ids=["flash attention", "transposed values"])
def test_a_restored_state_longer_than_the_window_gives_the_fresh_logits_bit_for_bit(
    model: Any, flash: bool
) -> None:
    context = _Context(model, flash=flash)
    try:
        prompt, more = _tokens(1001, 1), _tokens(40, 2)  # (an odd offset: 489)
        context.decode(0, prompt, 0)
        state = context.state(0)
        layout = aligned(state.array, len(state))
        assert layout is not None
        # the window part held the last WINDOW positions; now every position has a cell
        assert layout.start == len(prompt) - WINDOW
        assert layout.size > len(state)
        assert llama_cpp.llama_state_seq_set_data(context.ctx, layout.buffer, layout.size, 1)
        assert llama_cpp.llama_memory_seq_pos_min(context.memory, 1) == 0  # (the zero cells)
        assert llama_cpp.llama_memory_seq_pos_max(context.memory, 1) == len(prompt) - 1
        fresh = context.decode(0, more, len(prompt))
        restored = context.decode(1, more, len(prompt))
        assert numpy.array_equal(fresh, restored)
        # then one token a call, as a reply is decoded (the attention's work is split
        # over the cells: their count decides the split)
        at = len(prompt) + len(more)
        for i, token in enumerate(_tokens(8, 5)):
            fresh = context.decode(0, [token], at + i)
            restored = context.decode(1, [token], at + i)
            assert numpy.array_equal(fresh, restored), f"token {i} of the reply"
    finally:
        context.close()


def test_a_state_within_the_window_is_restored_as_it_is(model: Any) -> None:
    context = _Context(model, flash=True)
    try:
        context.decode(0, _tokens(300, 3), 0)
        state = context.state(0)
        layout = aligned(state.array, len(state))
        assert layout is not None
        assert layout.buffer is state.array
        assert (layout.size, layout.start) == (len(state), 0)
    finally:
        context.close()


def test_what_is_not_a_state_of_this_layout_is_refused(model: Any) -> None:
    context = _Context(model, flash=True)
    try:
        context.decode(0, _tokens(700, 4), 0)
        state = bytes(context.state(0))
    finally:
        context.close()
    assert aligned(bytearray(state), len(state)) is not None
    for damaged in (
        state[: len(state) - 4096],  # truncated
        state + b"\0" * 16,  # longer than its parts
        b"\0" * 4 + state[4:],  # another magic
        b"not a state",
    ):
        buffer = (ctypes.c_uint8 * len(damaged)).from_buffer_copy(damaged)
        assert aligned(buffer, len(damaged)) is None
