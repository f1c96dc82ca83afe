"""The relay reads an upstream trioserve's end: its finish_reason is OpenAI's ("length"
for a stream it cut short), and why it ended is its ``trioserve.end_cause``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from trioserve._backends._relay import Retry, UpstreamUnavailable, _event, _finish, _StreamState

UPSTREAM: Any = SimpleNamespace(url="http://upstream")


def _final(reason: str, cause: str | None = None) -> str:
    chunk: dict[str, object] = {"choices": [{"index": 0, "text": "", "finish_reason": reason}]}
    if cause is not None:
        chunk["trioserve"] = {"end_cause": cause, "message": "why"}
    return json.dumps(chunk)


async def _ended(data: str) -> _StreamState:
    state = _StreamState()
    await _event(UPSTREAM, data, state, None)  # type: ignore[arg-type]
    return state


async def test_an_upstream_shutting_down_is_unavailable_not_a_short_success() -> None:
    with pytest.raises(UpstreamUnavailable, match="shutting down"):
        await _finish(UPSTREAM, await _ended(_final("length", "shutdown")))


async def test_plain_ends_stay_as_they_are() -> None:
    assert await _finish(UPSTREAM, await _ended(_final("length"))) == "length"
    assert await _finish(UPSTREAM, await _ended(_final("stop"))) == "stop"


async def test_an_upstream_error_event_is_retried_elsewhere() -> None:
    with pytest.raises(Retry, match="failed"):
        await _ended(json.dumps({"error": {"message": "boom", "type": "server_error"}}))
