"""Counting a limited field's entries before it is decoded (trioserve/_wire/_limits.py)."""

from __future__ import annotations

import json

import pytest

from trioserve import InvalidRequestError
from trioserve._wire._limits import RequestLimits, top_level_entries
from trioserve._wire._openai import decode_chat_request


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        ({}, 0),
        ([], 0),
        ({"1": 2}, 1),
        ({"1": 2, "2": -3.5}, 2),
        (["a,b", 'c"d,', {"x": [1, 2]}, "\\", "]"], 5),
        ({"a\\": 1, "b": [1, {"c": 2}], "{": "}"}, 3),
    ],
)
def test_top_level_entries_counts_as_a_decoder_would(value: object, entries: int) -> None:
    for raw in (json.dumps(value), json.dumps(value, indent=2)):
        assert top_level_entries(raw.encode()) == entries == len(value)  # type: ignore[arg-type]


def test_a_huge_logit_bias_is_refused_by_its_count_and_a_bad_value_by_its_path() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {str(i): 1 for i in range(5000)}}
    with pytest.raises(InvalidRequestError, match=r"holds 5000 entries; .* at most 1024") as caught:
        decode_chat_request(json.dumps(body).encode(), RequestLimits())
    assert caught.value.param == "logit_bias"
    body["logit_bias"] = {"5": 200}
    with pytest.raises(InvalidRequestError, match=r"Expected `float` <= 100.0 at `logit_bias\[\.\.\.\]`"):
        decode_chat_request(json.dumps(body).encode(), RequestLimits())
    body["logit_bias"] = {"5": 2, "7": -1}
    assert decode_chat_request(json.dumps(body).encode(), RequestLimits()).logit_bias
