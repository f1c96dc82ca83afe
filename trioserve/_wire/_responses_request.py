"""OpenAI's Responses API's request bodies, sans-IO: ``POST /v1/responses`` and
``/v1/responses/input_tokens`` decoded (and peeked at for what they ask of the response
store), and checked — the fields refused by name, what needs the store, the sizes. The
conversation they ask for: :mod:`._responses`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from ._codec import decode as _decode
from ._limits import RequestLimits
from ._openai import Priority
from ._refusals import Refusal, check_refused

__all__ = [
    "InputContent",
    "InputItem",
    "InputTokensRequest",
    "ResponsesRequest",
    "ResponsesTool",
    "StoredAsk",
    "StoredContext",
    "TextConfig",
    "TextFormat",
    "ToolChoiceFunction",
    "decode_input_tokens_request",
    "decode_responses_request",
    "peek_stored",
]


@dataclass(frozen=True, slots=True)
class StoredContext:
    """What the server's response store gives a Responses request (docs/dialects.md,
    "Stored responses"): the conversation a ``previous_response_id`` continues, and a
    background response's id (given before it runs)."""

    #: the earlier turns, oldest first: each stored response's input items, then its
    #: output items, as a client would have sent them back
    history: tuple[dict[str, Any], ...] = ()
    #: a background response's id; ``None``: a foreground request
    response_id: str | None = None
    #: the ``previous_response_id`` whose conversation ``history`` is (the body must
    #: name the same one: else 400, never a prompt without its history)
    previous_id: str | None = None


@dataclass(frozen=True, slots=True)
class StoredAsk:
    """What a Responses body asks of the store, read before the body is decoded in
    full: the response it continues, whether it runs in the background (and, then,
    whether it streams: a resumable stream, docs/resumable-streams.md)."""

    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    stream: bool | None = None


class InputContent(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    # input_image (docs/vision.md)
    image_url: str | None = None
    detail: str | None = None
    file_id: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One ``input`` item: a message (``type`` ``message`` or absent), a
    ``function_call``, a ``function_call_output``, a ``reasoning`` item…"""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[InputContent] | None = None
    id: str | None = None
    status: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    #: "medium" is OpenAI's default
    verbosity: Literal["low", "medium", "high"] | None = None


class _ResponsesFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Any = None
    truncation: Literal["disabled", "auto"] | None = None
    #: a stored response this one continues (needs the server's response store)
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    background: bool | None = None
    # known, not honoured: refused (_REFUSED)
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None


class InputTokensRequest(_ResponsesFields, kw_only=True):
    pass


class ResponsesRequest(_ResponsesFields, kw_only=True):
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    #: echoed in the response (up to 16 string pairs, as OpenAI)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: trioserve's (vLLM's meaning): the request's priority, lower first
    priority: Priority | None = None
    #: llama-server's: ``false``: this request's reasoning cannot be ended on request
    #: (``POST /v1/chat/completions/control``); absent or ``true``: it can
    reasoning_control: bool | None = None
    stream_options: Any = None
    # identifiers: accepted, not used
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


_responses_decoder = msgspec.json.Decoder(ResponsesRequest)
_input_tokens_decoder = msgspec.json.Decoder(InputTokensRequest)

_REFUSED: tuple[Refusal, ...] = (
    ("conversation", (None,), "conversations are not stored here; send the whole conversation in input"),
    ("prompt", (None,), "there are no stored prompt templates here; send instructions and input"),
    ("context_management", (None,), "this server does not compact the context; send the input to use"),
    ("moderation", (None,), "this server runs no moderation"),
)
#: ``include`` values that are honoured trivially: no reasoning is ever encrypted here
#: (a reasoning model's reasoning is sent as text, in a ``reasoning`` item)
_INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content"})
#: ``metadata`` pairs, at most (OpenAI's limit; they are echoed in every response)
_MAX_METADATA = 16


#: why a stored-response field is refused on a server that stores none
_NO_STORE = "this server stores no responses (start it with --responses-db)"


def _check_stored(request: _ResponsesFields, stored: StoredContext | None) -> None:
    """``store``, ``previous_response_id`` and ``background``: each needs the store."""
    full = request if isinstance(request, ResponsesRequest) else None
    if stored is None:
        if request.previous_response_id is not None:
            raise InvalidRequestError(
                f"previous_response_id is not supported: {_NO_STORE}; send the whole conversation in input",
                param="previous_response_id",
            )
        if request.background:
            raise InvalidRequestError(
                f"background is not supported: {_NO_STORE}; stream to see progress", param="background"
            )
        if full is not None and full.store:
            raise InvalidRequestError(
                f"store is not supported: {_NO_STORE}; send store: false", param="store"
            )
        return
    if full is None or not request.background:
        return
    if full.store is False:
        raise InvalidRequestError(
            "background needs store: a background response is read back by its id (send store: true "
            "or leave it out)",
            param="store",
        )


def _check(request: _ResponsesFields, stored: StoredContext | None = None) -> None:
    check_refused(request, _REFUSED)
    _check_stored(request, stored)
    if request.reasoning is not None and request.reasoning not in ({}, {"effort": None}, {"effort": "none"}):
        raise InvalidRequestError(
            "reasoning is not supported: this server does not control reasoning effort "
            "(send reasoning: {effort: none} to ask a reasoning model not to reason)",
            param="reasoning",
        )
    text = request.text
    if text is not None and text.verbosity not in (None, "medium"):
        raise InvalidRequestError(
            "text.verbosity is not supported: the model has no verbosity control", param="text.verbosity"
        )
    if not isinstance(request, ResponsesRequest):
        return
    for value in request.include or ():
        if value not in _INCLUDE_NOTHING:
            raise InvalidRequestError(
                f"include is not supported: {value!r} cannot be included here "
                "(reasoning.encrypted_content can: nothing is encrypted)",
                param="include",
            )
    if request.top_logprobs:
        raise InvalidRequestError(
            "top_logprobs is not supported: use /v1/chat/completions for log-probabilities",
            param="top_logprobs",
        )


def _check_sizes(request: _ResponsesFields, limits: RequestLimits) -> None:
    """Refuse more input items or content parts than ``limits`` allow, and more
    ``metadata`` than OpenAI's 16 pairs."""
    items = request.input
    if isinstance(items, list):
        limits.check_count("input", len(items), limits.max_messages, "--max-messages", "input")
        parts = sum(
            len(content)
            for item in items
            for content in (item.content, item.output)
            if isinstance(content, list)
        )
        if parts > limits.max_content_parts:
            raise InvalidRequestError(
                f"input holds {parts} content parts; this server accepts at most {limits.max_content_parts} "
                "(--max-content-parts)",
                param="input",
            )
    metadata = request.metadata if isinstance(request, ResponsesRequest) else None
    if metadata is not None and len(metadata) > _MAX_METADATA:
        raise InvalidRequestError(
            f"metadata holds {len(metadata)} pairs; at most {_MAX_METADATA} are allowed (OpenAI's limit)",
            param="metadata",
        )


_peek_decoder = msgspec.json.Decoder(StoredAsk)


def peek_stored(body: bytes) -> StoredAsk:
    """What ``body`` asks of the response store, read before it is decoded in full
    (a body that is not JSON, or whose fields have the wrong types, asks nothing: its
    full decode reports it)."""
    if b'"previous_response_id"' not in body and b'"background"' not in body:
        return StoredAsk()
    try:
        return _peek_decoder.decode(body)
    except msgspec.DecodeError:
        return StoredAsk()


def decode_responses_request(body: bytes) -> ResponsesRequest:
    return _decode(_responses_decoder, body)


def decode_input_tokens_request(body: bytes) -> InputTokensRequest:
    return _decode(_input_tokens_decoder, body)
