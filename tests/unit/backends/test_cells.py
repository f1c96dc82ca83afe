"""Which sequence ids are free (``_llama._cells``): pure bookkeeping, no model."""

from __future__ import annotations

import pytest

from trioserve._backends._llama import Cells


def test_every_id_starts_free() -> None:
    cells = Cells(3)
    assert cells.free == [0, 1, 2]
    assert len(cells) == 3
    assert cells.busy == 0


def test_taking_and_giving_back_keeps_the_order_freed() -> None:
    # the policy breaks ties by least recent use: the order ids come back is its input
    cells = Cells(3)
    cells.take(0)
    cells.take(2)
    assert cells.free == [1]
    assert cells.busy == 2
    cells.give_back(2)
    cells.give_back(0)
    assert cells.free == [1, 2, 0]
    assert cells.is_free(0)


def test_free_returns_a_copy() -> None:
    cells = Cells(2)
    cells.free.remove(0)
    assert cells.free == [0, 1]


def test_an_id_taken_twice_is_refused() -> None:
    cells = Cells(2)
    cells.take(1)
    with pytest.raises(ValueError, match="not free"):
        cells.take(1)


def test_giving_back_a_free_id_changes_nothing() -> None:
    cells = Cells(2)
    cells.give_back(1)
    assert cells.free == [0, 1]


def test_an_id_of_another_context_is_refused() -> None:
    cells = Cells(2)
    with pytest.raises(ValueError, match="not one of"):
        cells.give_back(2)
    with pytest.raises(ValueError, match="at least 1"):
        Cells(0)
