"""``--ctx-size auto``'s choice (docs/long-context.md, "The default context")."""

from __future__ import annotations

from trioserve._backends._llama._auto_context import FLOOR, pick

GIB = 1 << 30
CELL = (9216, 9216)  # the default model's bytes a cell, K and V (18 layers, f16)


def test_the_training_length_when_every_slot_of_it_fits_a_quarter_of_the_memory() -> None:
    picked = pick(32768, CELL, 8, 20 * GIB)  # 8 × 32768 cells: 4.5 GiB ≤ 5
    assert picked.n_ctx == 32768
    assert "the model's training length" in picked.reason
    assert "8 × 32768 cells of KV cache take 4.50 GiB of a quarter of the 20.0 GiB available" in picked.reason


def test_the_most_that_fits_in_steps_of_256_when_the_training_length_does_not() -> None:
    picked = pick(32768, CELL, 8, 8 * GIB)  # a quarter: 2 GiB → 14,563 cells a slot
    assert picked.n_ctx == 14336
    assert picked.n_ctx * 8 * sum(CELL) <= 2 * GIB < (picked.n_ctx + 256) * 8 * sum(CELL)
    assert "the most that fits" in picked.reason
    assert "would need 4.50 GiB" in picked.reason


def test_never_below_4096_and_never_above_the_training_length() -> None:
    small = pick(32768, CELL, 8, GIB)
    assert small.n_ctx == FLOOR
    assert "pass --ctx-size or fewer --slots" in small.reason
    assert pick(2048, CELL, 8, GIB).n_ctx == 2048  # (trained for less: that)
    assert pick(2048, CELL, 1, 64 * GIB).n_ctx == 2048


def test_what_cannot_be_computed_falls_back_to_4096_and_says_why() -> None:
    assert pick(0, CELL, 8, GIB).n_ctx == FLOOR
    unknown_cache = pick(131072, None, 8, 64 * GIB)
    assert unknown_cache.n_ctx == FLOOR
    assert "its cache's size cannot be computed" in unknown_cache.reason
    assert "the memory available is unknown" in pick(131072, CELL, 8, None).reason
