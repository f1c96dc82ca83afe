"""What trioserve says to an upstream and reads back: tables, no I/O."""

from __future__ import annotations

import pytest

from trioserve._core._types import GenerationRequest, SamplingParams
from trioserve._wire._upstream import (
    CompletionEvent,
    NotJSON,
    base_url,
    completion_event,
    completion_payload,
    error_fields,
    models_answer,
    props_answer,
)


@pytest.mark.parametrize(
    ("given", "base"),
    [
        ("http://h:1/v1/", "http://h:1"),
        (" h:1 ", "http://h:1"),
        ("https://h/v1", "https://h"),
    ],
)
def test_base_url(given: str, base: str) -> None:
    assert base_url(given) == base


def test_the_payload_sends_only_what_was_asked_for() -> None:
    request = GenerationRequest(prompt="<s>hi", max_tokens=5, add_bos=False, stop=("a", "b", "c", "d", "e"))
    assert completion_payload(request, bos_token="<s>", extra_body={"repeat_penalty": 1.0}) == {
        "prompt": "hi",
        "max_tokens": 5,
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["a", "b", "c", "d"],
        "repeat_penalty": 1.0,
    }


def test_the_payload_forwards_penalties_seed_and_bias() -> None:
    sampling = SamplingParams(seed=3, top_k=40, repeat_penalty=1.2, repeat_last_n=32, logit_bias={7: -1.0})
    payload = completion_payload(
        GenerationRequest(prompt="<s>hi", sampling=sampling), bos_token="<s>", extra_body={}
    )
    assert payload["prompt"] == "<s>hi"  # add_bos: the upstream adds none, the text keeps its own
    assert (payload["seed"], payload["top_k"], payload["repeat_penalty"], payload["repeat_last_n"]) == (
        3,
        40,
        1.2,
        32,
    )
    assert payload["logit_bias"] == {"7": -1.0}
    assert "min_p" not in payload


@pytest.mark.parametrize(
    ("data", "event"),
    [
        ('{"choices": [{"index": 0, "text": "a"}]}', CompletionEvent(texts=("a",))),
        ('{"choices": [{"index": 1, "text": "a", "finish_reason": "stop"}]}', CompletionEvent()),
        (
            '{"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}',
            CompletionEvent(finish_reason="stop"),
        ),
        (
            '{"choices": [{"text": "", "finish_reason": "length"}],'
            ' "trioserve": {"end_cause": "deadline", "message": "late"}}',
            CompletionEvent(finish_reason="deadline", message="late", has_extension=True),
        ),
        (
            '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}',
            CompletionEvent(usage=(3, 4)),
        ),
        ('{"error": {"message": "boom"}}', CompletionEvent(error="boom")),
        ('{"error": "plain"}', CompletionEvent(error="plain")),
        ("[1, 2]", CompletionEvent()),
    ],
)
def test_completion_events(data: str, event: CompletionEvent) -> None:
    assert completion_event(data) == event


def test_an_event_that_is_not_json() -> None:
    with pytest.raises(NotJSON):
        completion_event("{nope")


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        (b'{"error": {"message": "m", "param": "p", "code": "c"}}', ("m", "p", "c")),
        (b'{"error": {"message": "m", "code": 400}}', ("m", None, None)),
        (b'{"error": "s"}', ("s", None, None)),
        (b'{"message": "vllm"}', ("vllm", None, None)),
        (b'{"detail": "fastapi"}', ("fastapi", None, None)),
        (b'{"detail": [{"loc": ["body", "messages", 0], "msg": "bad"}]}', ("bad", "messages.0", None)),
        (b"plain text", ("plain text", None, None)),
        (b"", ("HTTP 502", None, None)),
    ],
)
def test_error_fields(body: bytes, fields: tuple[str, str | None, str | None]) -> None:
    assert error_fields(body, 502) == fields


def test_a_model_description_from_models_and_props() -> None:
    assert models_answer({"data": []}) == "GET /v1/models listed no model"
    description = models_answer({"data": [{"id": "m", "max_model_len": 512}]})
    assert not isinstance(description, str)
    assert (description.id, description.context_length) == ("m", 512)
    description = models_answer({"data": [{"id": "m"}]})
    assert not isinstance(description, str)
    props_answer(
        description,
        {"default_generation_settings": {"n_ctx": 2048}, "chat_template": "{{x}}", "bos_token": "<s>"},
    )
    assert (description.context_length, description.chat_template, description.bos_token) == (
        2048,
        "{{x}}",
        "<s>",
    )
    assert description.request_fields == {"return_progress": True}
