"""Stored Responses at the wire (docs/dialects.md, "Stored responses"): a continuation
renders the same prompt as the whole conversation sent statelessly, the turn that is
stored, and the fields that need the store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve._core._exceptions import InvalidRequestError
from trioserve._wire import RESPONSES, ReadOptions, StoredAsk, StoredContext, responses_reply
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._limits import RequestLimits
from trioserve._wire._responses import peek_stored

GEMMA = GemmaFormat()


def _options(stored: StoredContext | None) -> ReadOptions:
    return ReadOptions(limits=RequestLimits(), model_name=lambda name: name or "m", stored=stored)


_EMPTY = StoredContext()


def _read(body: dict[str, Any], stored: StoredContext | None = _EMPTY) -> Any:
    read = RESPONSES.read
    assert read is not None
    return read(json.dumps({"model": "m", **body}).encode(), GEMMA, _options(stored))


def _body(parsed: Any, usage_text: str = "done") -> dict[str, Any]:
    from trioserve._core._types import Usage
    from trioserve._wire import finished_choice

    result = finished_choice(usage_text, "stop", parsed.tool_mode, parsed.tool_names)
    return json.loads(parsed.dialect.body([result], Usage(prompt_tokens=3, completion_tokens=1)))


def test_a_continuation_renders_the_prompt_of_the_whole_conversation() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    first = _read({"instructions": "Be brief.", "input": "Weather in Rome?", "tools": tools})
    turn = first.turn
    assert turn is not None
    body = _body(first, "It is sunny.")
    history = (*turn.input_items, *body["output"])
    # the next turn: a function call came back, answered; the model's message in between
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "21C"}
    own = [call, answer, {"role": "user", "content": "And tomorrow?"}]
    continued = _read(
        {"instructions": "Be brief.", "input": own, "previous_response_id": turn.id, "tools": tools},
        StoredContext(history=history, previous_id=turn.id),
    )
    whole = [{"role": "user", "content": "Weather in Rome?"}, *body["output"], *own]
    stateless = _read({"instructions": "Be brief.", "input": whole, "tools": tools, "store": False})
    assert continued.generation.prompt == stateless.generation.prompt
    assert "Weather in Rome?" in continued.generation.prompt
    assert "It is sunny." in continued.generation.prompt
    assert stateless.turn is None  # store: false
    assert continued.turn.previous_id == turn.id


def test_the_previous_instructions_are_not_carried_over() -> None:
    first = _read({"instructions": "Speak French.", "input": "Hi"})
    history = (*first.turn.input_items, *_body(first)["output"])
    asked = {"input": "Again", "previous_response_id": first.turn.id}
    continued = _read(asked, StoredContext(history=history, previous_id=first.turn.id))
    assert "Speak French." not in continued.generation.prompt
    assert "Hi" in continued.generation.prompt


def test_the_stored_turn_and_the_response_object() -> None:
    asked = {"input": "Hello", "metadata": {"k": "v"}, "previous_response_id": "resp_0"}
    parsed = _read(asked, StoredContext(previous_id="resp_0"))
    turn = parsed.turn
    assert turn is not None
    (item,) = turn.input_items
    assert item["id"].startswith("msg_")
    assert item == {
        "id": item["id"],
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Hello"}],
    }
    body = _body(parsed)
    assert body["id"] == turn.id
    assert body["store"] is True  # OpenAI's default, where the server has a store
    assert body["previous_response_id"] == "resp_0"
    assert body["background"] is False
    assert turn.dialect.final == body
    items = _read({"input": [{"type": "message", "role": "user", "content": "x", "id": "msg_mine"}]}).turn
    text = [{"type": "input_text", "text": "x"}]
    assert items.input_items == [{"type": "message", "role": "user", "content": text, "id": "msg_mine"}]


def test_without_a_store_the_stored_fields_are_refused_by_name() -> None:
    for extra, named in (
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            _read({"input": "x", **extra}, stored=None)
        assert caught.value.param == named
        assert "--responses-db" in caught.value.message
    parsed = _read({"input": "x"}, stored=None)
    assert parsed.turn is None
    assert _body(parsed)["store"] is False


def test_background_needs_store_and_may_stream() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _read({"input": "x", "background": True, "store": False})
    assert caught.value.param == "store"
    # with stream: a resumable stream (the HTTP layer keys it by the response id)
    parsed = _read({"input": "x", "background": True, "stream": True})
    assert parsed.stream
    assert parsed.turn is not None
    assert parsed.turn.background
    assert peek_stored(b'{"input": "x", "background": true, "stream": true}') == StoredAsk(
        background=True, stream=True
    )


def test_a_background_reply_is_checked_and_queued_at_once() -> None:
    stored = StoredContext(response_id="resp_bg")
    body = json.dumps({"model": "m", "input": "x", "background": True}).encode()
    turn, queued = responses_reply(body, _options(stored))
    assert turn.id == queued["id"] == "resp_bg"
    assert queued["status"] == "queued"
    assert queued["background"] is True
    assert queued["output"] == []
    bad = json.dumps({"model": "m", "input": "x", "background": True, "tools": [{"type": "web_search"}]})
    with pytest.raises(InvalidRequestError) as caught:
        responses_reply(bad.encode(), _options(stored))
    assert caught.value.param == "tools[0].type"


def test_a_bad_stored_item_is_named_as_stored_not_as_the_request_s() -> None:
    history = ({"type": "message", "content": "no role"},)
    with pytest.raises(InvalidRequestError) as caught:
        _read({"input": "x"}, StoredContext(history=history))
    assert "stored conversation" in caught.value.message


def test_peek_reads_only_what_the_store_needs() -> None:
    peek = RESPONSES.peek_stored
    assert peek is not None
    assert peek(b'{"input": "x"}') == StoredAsk()
    assert peek(b'{"previous_response_id": "resp_1", "background": true}') == StoredAsk("resp_1", True)
    # (the full decode reports it)
    assert peek(b'{"previous_response_id": 5, "background": true') == StoredAsk()
    # a null background still reads the id: the conversation is never dropped
    assert peek(b'{"previous_response_id": "resp_1", "background": null}') == StoredAsk("resp_1", None)


def test_a_body_that_names_another_id_than_the_store_read_is_refused() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _read({"input": "x", "previous_response_id": "resp_2"}, StoredContext(previous_id=None))
    assert caught.value.param == "previous_response_id"
