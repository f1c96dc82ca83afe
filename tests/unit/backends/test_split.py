"""How the batch-invariant mode splits a step's decoders into llama_decode calls."""

from __future__ import annotations

import pytest

from trioserve._backends._llama import split


@pytest.mark.parametrize(
    ("n", "width", "sizes"),
    [
        (0, 7, []),
        (1, 7, [1]),
        (7, 7, [7]),
        (8, 7, [4, 4]),  # not 7 + 1: two 4-wide calls are faster
        (9, 4, [3, 3, 3]),
        (15, 7, [5, 5, 5]),
        (3, 1, [1, 1, 1]),
    ],
)
def test_split_uses_few_calls_of_near_equal_width(n: int, width: int, sizes: list[int]) -> None:
    items = list(range(n))
    groups = split(items, width)
    assert [len(g) for g in groups] == sizes
    assert [x for g in groups for x in g] == items  # order kept: seq-id order matters
