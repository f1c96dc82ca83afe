"""Every generation response a test receives, checked against the SDKs' own types.

The openai and anthropic SDKs build their response objects with ``construct`` (no
validation) unless a client asks for strict validation, so a client never notices a
``finish_reason`` that is not one of OpenAI's, or a chunk without its ``created``. This
module checks what the server *sends*, whatever client a test uses (httpx, the SDKs,
raw sockets, h2):

* :func:`validating_app` wraps an ASGI app; every ``POST /v1/completions``,
  ``POST /v1/chat/completions``, ``POST /v1/messages`` (Anthropic) and
  ``POST /v1/responses`` (OpenAI Responses) answered 200 is checked as it goes out
  (each event before its bytes reach the transport, so a violation is recorded before
  the client can have read it). Each JSON body or event is checked with
  ``model_validate(payload, strict=False)`` (validation mode, not ``construct``), and,
  since the types accept extra fields (the ``trioserve`` extension is one), every field
  the types declare as a ``Literal`` (``finish_reason``, ``object``, ``role``,
  ``stop_reason``, a content block's or output item's ``type``: a union of models is
  told apart by its members' ``type`` Literals) is also checked explicitly against the
  values the type declares (read from the type, not written here).

  OpenAI chat and completions:

  - a JSON body with ``openai.types.Completion`` / ``openai.types.chat.ChatCompletion``;
  - each SSE ``data:`` event with ``openai.types.Completion`` (the legacy completions
    stream uses the response type; ``finish_reason`` may be null until the last chunk,
    as OpenAI sends it: :data:`CompletionStreamChunk`) /
    ``openai.types.chat.ChatCompletionChunk``, except
    ``[DONE]`` and an error object (``{"error": {"message": ...}}``, the form a failure
    after the stream started takes: openai-python raises ``APIError`` on it), whose
    ``message`` must be a non-empty string;
  - the stream as a whole: a body that ends normally ends with ``data: [DONE]``,
    nothing follows ``[DONE]``, nothing but ``[DONE]`` follows an error event, every
    choice of a stream that ended without an error got a ``finish_reason``, a choice
    gets no chunk after its ``finish_reason``, no event has an ``event:`` name
    (openai-python reads named events differently).

  Anthropic Messages (``anthropic.types``):

  - a JSON body with ``Message``; a 4xx/5xx body is Anthropic's error shape
    ``{"type": "error", "error": {"type": str, "message": non-empty str}}``;
  - each SSE event has an ``event:`` name (the anthropic SDK skips an event without
    one), the name is its data's ``type``, and the data is one of
    ``RawMessageStreamEvent``'s members (``message_start``, ``content_block_start`` /
    ``_delta`` / ``_stop``, ``message_delta``, ``message_stop``), ``ping`` or ``error``
    (the error shape above);
  - the order: ``message_start`` first; one content block open at a time, their
    indices 0, 1, 2, …; a delta's index is the open block's and its type fits the
    block's (``text_delta`` in ``text``, ``input_json_delta`` in ``tool_use``);
    ``message_delta`` once every block is closed, then ``message_stop``, last; nothing
    after an ``error`` event; a stream without an error ends with ``message_stop``;
    ``stop_reason: "tool_use"`` when and only when a turn that ended normally holds a
    ``tool_use`` block, whose joined ``partial_json`` is then a JSON object.

  OpenAI Responses (``openai.types.responses``):

  - a JSON body with ``Response``;
  - each SSE event with ``ResponseStreamEvent`` (its members told apart by ``type``,
    a pydantic ``TypeAdapter``), its ``event:`` name its data's ``type``, its
    ``sequence_number`` 0, 1, 2, … with no gap;
  - the order: ``response.created`` first; ``response.output_item.added`` at
    ``output_index`` 0, 1, 2, …, each once the one before is done, and its
    ``output_item.done`` once (the same id and type); every event about an item (content
    parts, text and argument deltas) names an open item at its ``output_index`` by its
    ``item_id``; a content part's text deltas join to its ``output_text.done`` text,
    and to the text of its ``content_part.done`` and ``output_item.done``; a call's
    argument deltas join to its ``function_call_arguments.done`` and its item's
    arguments; the terminal event (``response.completed`` / ``.incomplete`` /
    ``.failed``, its response's status said so) once and last, every item done before a
    completed or incomplete one, whose ``output`` is the items done, in order.

  And an app that raises after the response started is a truncated stream that a
  client would take as complete.

* In process (``tests/conftest.py``): :func:`install_in_process` wraps the app of every
  :class:`trioserve.Server` at construction (``Server.app``, the app the server hands
  to hypercorn), so ``start_server``, ``trioserve.testing.open_test_server`` and tests
  that build a ``Server`` are all covered. Violations go to the running test's
  :class:`Collector`; an autouse fixture fails the test at teardown.

* Out of process (``tests/_helpers.py``'s ``ServerProcess``): this file run as a script,
  ``python tests/_openai_validation.py --violations FILE serve ...``, installs the same
  wrapper and runs ``trioserve``'s own ``main``; each violation (written before the
  bytes it is about are sent) and each checked response is a JSON line in ``FILE``,
  which the running test's collector reads at teardown (a module-scoped server's last
  lines, written after its last test, fail that test from ``ServerProcess.__exit__``).

A test that receives invalid responses on purpose opts out with
``@pytest.mark.no_openai_validation("why")``.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import sys
import types
import typing
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic

if __name__ == "__main__":  # run as a script: make the repository importable (benchmarks, tests)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# imported at once: importing the SDKs takes seconds, too long for the event loop mid-test
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from openai.types import Completion, CompletionChoice, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

__all__ = [
    "ANTHROPIC_EVENTS",
    "MARKER",
    "RESPONSES_EVENTS",
    "Collector",
    "CompletionStreamChunk",
    "EventTypes",
    "ResponseCheck",
    "Violation",
    "anthropic_error_problems",
    "check_event",
    "check_payload",
    "declared_literals",
    "install_in_process",
    "validating_app",
]

#: the opt-out marker (registered in pyproject.toml)
MARKER = "no_openai_validation"

Kind = Literal["text", "chat", "messages", "responses", "embeddings"]
GENERATION_PATHS: dict[str, Kind] = {
    "/v1/completions": "text",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    # (never streamed: its 200 body is checked)
    "/v1/embeddings": "embeddings",
}

# The legacy completions stream's chunks are ``Completion`` objects, but OpenAI sends
# ``"finish_reason": null`` in every chunk before the last, and openai-python's
# ``CompletionChoice`` declares it required and not nullable (the SDK builds stream
# chunks with ``construct``, so it never notices). The stream's type is ``Completion``
# with that one field nullable (still required): the same Literal values, read from the
# type, plus null, as ``ChatCompletionChunk``'s choices declare it.
_finish_reason: Any = CompletionChoice.model_fields["finish_reason"].annotation
_StreamChoice: Any = pydantic.create_model(
    "CompletionStreamChoice", __base__=CompletionChoice, finish_reason=(_finish_reason | None, ...)
)
CompletionStreamChunk = pydantic.create_model(
    "CompletionStreamChunk", __base__=Completion, choices=(list[_StreamChoice], ...)
)

#: (non-streamed response type, stream chunk type) of the OpenAI chat and completions endpoints
TYPES: dict[Kind, tuple[type[pydantic.BaseModel], type[pydantic.BaseModel]]] = {
    "text": (Completion, CompletionStreamChunk),
    "chat": (ChatCompletion, ChatCompletionChunk),
}
#: the non-streamed response type of each endpoint
BODY_TYPES: dict[Kind, type[pydantic.BaseModel]] = {
    "text": Completion,
    "chat": ChatCompletion,
    "messages": AnthropicMessage,
    "responses": Response,
    "embeddings": CreateEmbeddingResponse,
}

_SHOWN_BYTES = 1500
_LINE_END = re.compile(rb"\r\n|\r|\n")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Violation:
    """One response (or event of a stream) that a client of its API would not accept."""

    where: str
    problem: str
    data: bytes

    def __str__(self) -> str:
        shown = self.data if len(self.data) <= _SHOWN_BYTES else self.data[:_SHOWN_BYTES] + b"..."
        return f"{self.where}: {self.problem}\n    bytes: {shown!r}"

    def to_json(self) -> dict[str, str]:
        return {"where": self.where, "problem": self.problem, "data": self.data.decode("latin-1")}

    @classmethod
    def from_json(cls, raw: dict[str, str]) -> Violation:
        return cls(raw["where"], raw["problem"], raw["data"].encode("latin-1"))


# --- the types' declared literals -------------------------------------------------------


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def declared_literals(model: type[pydantic.BaseModel], name: str) -> tuple[object, ...]:
    """The values ``model``'s field ``name`` is declared to take (its ``Literal``;
    ``None`` included when the field is optional)."""
    annotation = _unwrap(model.model_fields[name].annotation)
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    values: list[object] = []
    for option in map(_unwrap, options):
        if option is type(None):
            values.append(None)
        elif typing.get_origin(option) is Literal:
            values.extend(typing.get_args(option))
        else:
            raise TypeError(f"{model.__name__}.{name} is not a Literal: {annotation!r}")
    return tuple(values)


def _tagged(options: list[Any]) -> dict[str, type[pydantic.BaseModel]] | None:
    """The members of a union of models by their ``type`` tag (each member's ``type``
    a ``Literal`` of strings, no tag twice); ``None`` if it is not such a union."""
    members: dict[str, type[pydantic.BaseModel]] = {}
    for option in options:
        if not (isinstance(option, type) and issubclass(option, pydantic.BaseModel)):
            return None
        info = option.model_fields.get("type")
        if info is None or (info.alias or "type") != "type":
            return None
        tags = typing.get_args(_unwrap(info.annotation))
        if typing.get_origin(_unwrap(info.annotation)) is not Literal or not tags:
            return None
        for tag in tags:
            if not isinstance(tag, str) or tag in members:
                return None
            members[tag] = option
    return members


#: checks ``value`` (raw JSON) at ``path``: the problems found
Checker = Callable[[object, str], list[str]]


def _literal_problems(annotation: Any, value: object, path: str) -> list[str]:
    """Where ``value`` (raw JSON) holds a value a ``Literal`` of ``annotation`` does not
    allow. Unions of several types are left to pydantic, but for a union of models told
    apart by their ``type``."""
    checker = _checker(annotation)
    return checker(value, path) if checker is not None else []


_compiling: set[type] = set()


@functools.cache
def _checker(annotation: Any) -> Checker | None:
    """The literal check of ``annotation``, compiled once per type (``None``: it holds
    no Literal to check)."""
    annotation = _unwrap(annotation)
    if _is_union(annotation):
        options = [_unwrap(a) for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) != 1:
            return _tagged_checker(options)
        inner = _checker(options[0])
        if inner is None:
            return None
        return lambda value, path: [] if value is None else inner(value, path)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        shown = ", ".join(map(repr, allowed))

        def literal(value: object, path: str) -> list[str]:
            if any(type(value) is type(a) and value == a for a in allowed):
                return []
            return [f"{path} is {value!r}; the type allows only {shown}"]

        return literal
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        each = _checker(item)
        if each is None:
            return None

        def items(value: object, path: str) -> list[str]:
            if not isinstance(value, list):
                return []
            return [p for i, v in enumerate(value) for p in each(v, f"{path}[{i}]")]

        return items
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        if annotation in _compiling:  # a model that holds itself: look it up when used
            return lambda value, path: _literal_problems(annotation, value, path)
        _compiling.add(annotation)
        try:
            fields = [
                (info.alias or name, checker)
                for name, info in annotation.model_fields.items()
                if (checker := _checker(typing.cast(Any, info.annotation))) is not None
            ]
        finally:
            _compiling.discard(annotation)
        if not fields:
            return None

        def model(value: object, path: str) -> list[str]:
            if not isinstance(value, dict):
                return []
            return [p for key, check in fields if key in value for p in check(value[key], f"{path}.{key}")]

        return model
    return None


def _tagged_checker(options: list[Any]) -> Checker | None:
    """A union of models told apart by ``type`` (a content block, an output item): the
    member the value's ``type`` names, checked; a ``type`` no member has, flagged."""
    members = _tagged(options)
    if members is None:
        return None  # a union of several types: pydantic decides
    checkers = {tag: _checker(model) for tag, model in members.items()}
    shown = ", ".join(map(repr, members))

    def tagged(value: object, path: str) -> list[str]:
        if not isinstance(value, dict):
            return []
        tag = value.get("type")
        if not isinstance(tag, str) or tag not in checkers:
            return [f"{path}.type is {tag!r}; the type allows only {shown}"]
        check = checkers[tag]
        return check(value, path) if check is not None else []

    return tagged


def check_payload(model: type[pydantic.BaseModel], payload: object) -> list[str]:
    """What is wrong with ``payload`` (parsed JSON) as a ``model``: pydantic's errors in
    validation mode, and every declared ``Literal`` field checked explicitly."""
    problems = _literal_problems(model, payload, model.__name__)
    try:
        model.model_validate(payload, strict=False)
    except pydantic.ValidationError as exc:
        problems.append(f"{model.__name__}.model_validate: {exc}")
    return problems


@dataclass(frozen=True)
class EventTypes:
    """An SDK's union of stream events (``union``), its members by their ``type``; a
    ``TypeAdapter`` of the members as a union discriminated by ``type`` (the SDKs mark
    theirs with their own ``PropertyInfo``, which pydantic does not read: it would try
    every member and report every member's errors)."""

    name: str
    members: dict[str, type[pydantic.BaseModel]]
    adapter: pydantic.TypeAdapter[Any]

    @classmethod
    def of(cls, name: str, union: Any) -> EventTypes:
        members = _tagged([_unwrap(m) for m in typing.get_args(_unwrap(union))])
        if members is None:
            raise TypeError(f"{name}'s members are not told apart by their type: {union!r}")
        tagged: Any = functools.reduce(operator.or_, dict.fromkeys(members.values()))
        discriminated = typing.cast(Any, Annotated)[tagged, pydantic.Discriminator("type")]
        return cls(name, members, pydantic.TypeAdapter(discriminated, config=pydantic.ConfigDict(title=name)))


def check_event(events: EventTypes, payload: object) -> list[str]:
    """What is wrong with ``payload`` as one of ``events``: the member its ``type``
    names, validated, and its Literals checked."""
    tag = payload.get("type") if isinstance(payload, dict) else None
    model = events.members.get(tag) if isinstance(tag, str) else None
    problems = _literal_problems(model, payload, model.__name__) if model is not None else []
    try:
        events.adapter.validate_python(payload, strict=False)
    except pydantic.ValidationError as exc:
        problems.append(f"TypeAdapter({events.name}).validate_python: {exc}")
    return problems


#: ``anthropic.types.RawMessageStreamEvent``: message_start, content_block_*, message_delta, message_stop
ANTHROPIC_EVENTS = EventTypes.of("RawMessageStreamEvent", RawMessageStreamEvent)
#: ``openai.types.responses.ResponseStreamEvent``
RESPONSES_EVENTS = EventTypes.of("ResponseStreamEvent", ResponseStreamEvent)

for _model in (
    *BODY_TYPES.values(),
    CompletionStreamChunk,
    ChatCompletionChunk,
    *ANTHROPIC_EVENTS.members.values(),
    *RESPONSES_EVENTS.members.values(),
):
    _checker(_model)  # compiled at import, not mid-test


def anthropic_error_problems(payload: object) -> list[str]:
    """What is wrong with ``payload`` as Anthropic's error body (or ``error`` event):
    ``{"type": "error", "error": {"type": str, "message": non-empty str}}``."""
    if not isinstance(payload, dict):
        return [f"an Anthropic error is a JSON object, not {type(payload).__name__}"]
    problems = []
    if payload.get("type") != "error":
        problems.append(f"an Anthropic error's type is 'error', not {payload.get('type')!r}")
    error = payload.get("error")
    if not isinstance(error, dict):
        return [*problems, f"an Anthropic error's error is an object, not {error!r}"]
    if not isinstance(error.get("type"), str) or not error["type"]:
        problems.append(f"an Anthropic error's error.type is a non-empty string, not {error.get('type')!r}")
    if not isinstance(error.get("message"), str) or not error["message"]:
        problems.append(
            f"an Anthropic error's error.message is a non-empty string, not {error.get('message')!r}"
        )
    return problems


def _tool_use_problems(blocks: list[tuple[str | None, object]], stop_reason: object) -> list[str]:
    """A turn that ended normally (``end_turn``, ``stop_sequence``, ``tool_use``) says
    ``tool_use`` when and only when it holds a ``tool_use`` block (``blocks``: each
    block's type and input); a ``tool_use`` turn's inputs are JSON objects."""
    calls = [value for kind, value in blocks if kind == "tool_use"]
    if stop_reason == "tool_use":
        if not calls:
            return ["stop_reason is 'tool_use', but no content block is a tool_use"]
        bad = [value for value in calls if not isinstance(value, dict)]
        return [f"a tool_use block's input is not a JSON object: {value!r}" for value in bad]
    if calls and stop_reason in ("end_turn", "stop_sequence"):
        return [
            f"a turn with a tool_use block ended with stop_reason {stop_reason!r}, not 'tool_use' "
            "(a client runs the tools of a tool_use turn)"
        ]
    return []


# --- one response -------------------------------------------------------------------


def _joined(problems: list[str]) -> str:
    """One message for the problems of one event or body (each on its own lines)."""
    return "\n      ".join(line for problem in problems for line in problem.splitlines())


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


#: reports one problem, with the bytes it is about
Flag = Callable[[str, bytes], None]

_INVALID = object()


def _json(flag: Flag, where: str, text: str | bytes, raw: bytes) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        flag(f"{where} is not JSON: {exc}", raw)
        return _INVALID


def _is_int(value: object) -> typing.TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _decoded_embeddings(flag: Flag, payload: Any, body: bytes) -> Any:
    """An embeddings body with each base64 vector (``encoding_format: base64``: what the
    openai SDK asks for by default and decodes itself) decoded as little-endian float32,
    so that the type checks the numbers; a string that is not such a vector is flagged."""
    import base64
    import binascii
    import struct

    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return payload
    data = []
    for i, item in enumerate(payload["data"]):
        if isinstance(item, dict) and isinstance(item.get("embedding"), str):
            try:
                raw = base64.b64decode(item["embedding"], validate=True)
            except binascii.Error:
                flag(f"data[{i}].embedding is a string that is not base64", body)
                raw = b""
            if len(raw) % 4:
                flag(f"data[{i}].embedding: {len(raw)} bytes is not a float32 vector", body)
                raw = raw[: len(raw) - len(raw) % 4]
            item = {**item, "embedding": list(struct.unpack(f"<{len(raw) // 4}f", raw))}
        data.append(item)
    return {**payload, "data": data}


class _OpenAIStream:
    """The chat and completions streams: chunks, ``[DONE]``, error objects."""

    def __init__(self, kind: Kind, flag: Flag) -> None:
        self._model = TYPES[kind][1]
        self._flag = flag
        self._done = False
        self._errored = False
        self._choices_seen: set[int] = set()
        self._choices_finished: set[int] = set()

    def event(self, where: str, name: str | None, text: str, raw: bytes) -> None:
        if name is not None:
            self._flag(f"{where} has an event name {name!r} (openai-python reads named events apart)", raw)
        if self._done:
            self._flag(f"{where} comes after data: [DONE]", raw)
            return
        if text == "[DONE]":
            self._done = True
            return
        if self._errored:
            self._flag(f"{where} follows an error event: only data: [DONE] may", raw)
        payload = _json(self._flag, where, text, raw)
        if payload is _INVALID:
            return
        if isinstance(payload, dict) and payload.get("error"):
            self._errored = True
            error = payload["error"]
            message = error.get("message") if isinstance(error, dict) else None
            if not isinstance(message, str) or not message:
                self._flag(
                    f"{where} is an error object without a message (openai-python would raise "
                    "'An error occurred during streaming')",
                    raw,
                )
            return
        if problems := check_payload(self._model, payload):
            self._flag(f"{where}: {_joined(problems)}", raw)
        self._track_choices(payload, where, raw)

    def _track_choices(self, payload: object, where: str, raw: bytes) -> None:
        choices = payload.get("choices") if isinstance(payload, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or not isinstance(choice.get("index"), int):
                continue
            index = choice["index"]
            if index in self._choices_finished:
                self._flag(f"{where}: choice {index} has a chunk after its finish_reason", raw)
            self._choices_seen.add(index)
            if choice.get("finish_reason") is not None:
                self._choices_finished.add(index)

    def end(self) -> None:
        if not self._done:
            self._flag("the stream ended without data: [DONE]", b"")
        elif not self._errored:
            missing = sorted(self._choices_seen - self._choices_finished)
            if missing:
                self._flag(f"choice(s) {missing} never got a finish_reason before [DONE]", b"")


#: the delta types each content block type takes
_BLOCK_DELTAS: dict[str, tuple[str, ...]] = {
    "text": ("text_delta", "citations_delta"),
    "tool_use": ("input_json_delta",),
    "server_tool_use": ("input_json_delta",),
    "thinking": ("thinking_delta", "signature_delta"),
}


class _AnthropicStream:
    """A Messages stream: named events, one content block open at a time."""

    def __init__(self, flag: Flag) -> None:
        self._flag = flag
        self._events = 0
        self._started = False
        #: the open block's index and type
        self._open: tuple[object, str | None] | None = None
        self._next_index = 0
        #: each block's type and, for a tool_use block, its partial_json fragments
        self._blocks: list[tuple[str | None, list[str]]] = []
        self._delta_seen = False
        self._ended: str | None = None  # "message_stop" or "an error event"

    def event(self, where: str, name: str | None, text: str, raw: bytes) -> None:
        self._events += 1
        if self._ended is not None:
            self._flag(f"{where} follows {self._ended}: nothing may", raw)
            return
        if name is None:
            self._flag(f"{where} has no event: name (the anthropic SDK skips an event without one)", raw)
        payload = _json(self._flag, where, text, raw)
        if payload is _INVALID:
            return
        if not isinstance(payload, dict):
            self._flag(f"{where} is not a JSON object", raw)
            return
        kind = payload.get("type")
        if name is not None and name != kind:
            self._flag(f"{where}: its event: name {name!r} is not its data's type {kind!r}", raw)
        if self._events == 1 and kind != "message_start":
            self._flag(f"{where} is {kind!r}: a stream starts with message_start", raw)
        if kind == "ping":
            return
        if kind == "error" or name == "error":  # (the SDK raises on the name)
            self._ended = "an error event"
            if problems := anthropic_error_problems(payload):
                self._flag(f"{where}: {_joined(problems)}", raw)
            return
        if problems := check_event(ANTHROPIC_EVENTS, payload):
            self._flag(f"{where}: {_joined(problems)}", raw)
        self._order(kind, payload, where, raw)

    def _order(self, kind: object, payload: dict[str, Any], where: str, raw: bytes) -> None:
        index = payload.get("index")
        if kind == "message_start":
            if self._started:
                self._flag(f"{where} is a second message_start", raw)
            self._started = True
        elif kind == "content_block_start":
            if self._delta_seen:
                self._flag(f"{where} starts a block after message_delta", raw)
            if self._open is not None:
                self._flag(
                    f"{where} starts block {index!r} while block {self._open[0]!r} is open: "
                    "one block at a time",
                    raw,
                )
            if index != self._next_index:
                self._flag(
                    f"{where} starts block {index!r}; the next block's index is {self._next_index}", raw
                )
            self._next_index += 1
            block = payload.get("content_block")
            block_type = block.get("type") if isinstance(block, dict) else None
            self._open = (index, block_type if isinstance(block_type, str) else None)
            self._blocks.append((self._open[1], []))
        elif kind == "content_block_delta":
            if self._open is None:
                self._flag(f"{where} is a delta for block {index!r}, but no block is open", raw)
                return
            open_index, block_type = self._open
            if index != open_index:
                self._flag(f"{where} is a delta for block {index!r}; the open block is {open_index!r}", raw)
            delta = payload.get("delta")
            delta_type = delta.get("type") if isinstance(delta, dict) else None
            allowed = _BLOCK_DELTAS.get(block_type or "")
            if allowed is not None and delta_type not in allowed:
                self._flag(
                    f"{where} is a {delta_type!r} in a {block_type!r} block "
                    f"(which takes {', '.join(allowed)})",
                    raw,
                )
            if delta_type == "input_json_delta" and isinstance(delta, dict):
                fragment = delta.get("partial_json")
                self._blocks[-1][1].append(fragment if isinstance(fragment, str) else "")
        elif kind == "content_block_stop":
            if self._open is None:
                self._flag(f"{where} stops block {index!r}, but no block is open", raw)
            elif index != self._open[0]:
                self._flag(f"{where} stops block {index!r}; the open block is {self._open[0]!r}", raw)
            self._open = None
        elif kind == "message_delta":
            if self._open is not None:
                self._flag(f"{where} is message_delta while block {self._open[0]!r} is open", raw)
            if self._delta_seen:
                self._flag(f"{where} is a second message_delta", raw)
            self._delta_seen = True
            delta = payload.get("delta")
            stop_reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            if problems := _tool_use_problems(self._inputs(), stop_reason):
                self._flag(f"{where}: {_joined(problems)}", raw)
        elif kind == "message_stop":
            if self._open is not None:
                self._flag(f"{where} is message_stop while block {self._open[0]!r} is open", raw)
            if not self._delta_seen:
                self._flag(f"{where} is message_stop with no message_delta before it", raw)
            self._ended = "message_stop"

    def _inputs(self) -> list[tuple[str | None, object]]:
        """Each block's type and, for a tool_use block, its input as the SDK joins it."""
        inputs: list[tuple[str | None, object]] = []
        for block_type, fragments in self._blocks:
            joined = "".join(fragments)
            try:
                value = json.loads(joined) if joined else {}
            except ValueError:
                value = joined
            inputs.append((block_type, value))
        return inputs

    def end(self) -> None:
        if self._ended is None:
            self._flag("the stream ended without message_stop (or an error event)", b"")


_TERMINAL = {
    "response.completed": "completed",
    "response.incomplete": "incomplete",
    "response.failed": "failed",
}


@dataclass
class _Item:
    """One output item of a Responses stream."""

    type: object
    id: object
    done: bool = False
    #: content_index → (its text deltas, done)
    parts: dict[object, tuple[list[str], list[bool]]] = field(default_factory=dict)
    arguments: list[str] = field(default_factory=list)


class _ResponsesStream:
    """A Responses stream: numbered named events, output items one after another."""

    def __init__(self, flag: Flag) -> None:
        self._flag = flag
        self._events = 0
        self._sequence = 0
        self._created = False
        self._id: object = None
        self._items: dict[object, _Item] = {}
        self._order: list[_Item] = []
        self._ended: str | None = None

    def event(self, where: str, name: str | None, text: str, raw: bytes) -> None:
        self._events += 1
        if self._ended is not None:
            self._flag(f"{where} follows {self._ended}: nothing may", raw)
            return
        payload = _json(self._flag, where, text, raw)
        if payload is _INVALID:
            return
        if not isinstance(payload, dict):
            self._flag(f"{where} is not a JSON object", raw)
            return
        kind = payload.get("type")
        if name != kind:
            self._flag(f"{where}: its event: name {name!r} is not its data's type {kind!r}", raw)
        if problems := check_event(RESPONSES_EVENTS, payload):
            self._flag(f"{where}: {_joined(problems)}", raw)
        sequence = payload.get("sequence_number")
        if sequence != self._sequence or not _is_int(sequence):
            self._flag(f"{where}: sequence_number {sequence!r}; the next is {self._sequence}", raw)
        self._sequence = sequence + 1 if _is_int(sequence) else self._sequence + 1
        if self._events == 1 and kind != "response.created":
            self._flag(f"{where} is {kind!r}: a stream starts with response.created", raw)
        self._check_order(kind, payload, where, raw)

    def _response_id(self, payload: dict[str, Any], where: str, raw: bytes) -> dict[str, Any]:
        response = payload.get("response")
        response = response if isinstance(response, dict) else {}
        if self._created and response.get("id") != self._id:
            self._flag(
                f"{where}: response id {response.get('id')!r}; response.created's is {self._id!r}", raw
            )
        return response

    def _check_order(self, kind: object, payload: dict[str, Any], where: str, raw: bytes) -> None:
        if kind == "response.created":
            if self._created:
                self._flag(f"{where} is a second response.created", raw)
            response = payload.get("response")
            self._id = response.get("id") if isinstance(response, dict) else None
            self._created = True
        elif kind == "response.in_progress":
            self._response_id(payload, where, raw)
        elif kind in _TERMINAL or kind == "error":
            self._ended = str(kind)
            if kind != "error":
                self._terminal(str(kind), payload, where, raw)
        elif kind == "response.output_item.added":
            self._added(payload, where, raw)
        elif kind == "response.output_item.done":
            self._item_done(payload, where, raw)
        elif kind in ("response.content_part.added", "response.content_part.done"):
            self._part(kind, payload, where, raw)
        elif kind in ("response.output_text.delta", "response.output_text.done"):
            self._text(kind, payload, where, raw)
        elif kind in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
            self._arguments(kind, payload, where, raw)

    def _terminal(self, kind: str, payload: dict[str, Any], where: str, raw: bytes) -> None:
        response = self._response_id(payload, where, raw)
        status = _TERMINAL[kind]
        if response.get("status") != status:
            self._flag(f"{where} is {kind}, but its response's status is {response.get('status')!r}", raw)
        if kind == "response.failed":
            return  # (an item may be left open: the stream failed)
        open_items = [index for index, item in self._items.items() if not item.done]
        if open_items:
            self._flag(f"{where} is {kind} while output item(s) {open_items} are not done", raw)
        output = response.get("output")
        ids = (
            [o.get("id") if isinstance(o, dict) else None for o in output]
            if isinstance(output, list)
            else None
        )
        done = [item.id for item in self._order if item.done]
        if ids != done:
            self._flag(f"{where}: its response's output is the items {ids}; the items done are {done}", raw)

    def _open_item(
        self, payload: dict[str, Any], where: str, raw: bytes, item_type: str | None = None
    ) -> _Item | None:
        """The open item an event names by ``output_index`` and ``item_id``."""
        index = payload.get("output_index")
        item = self._items.get(index)
        if item is None or item.done:
            state = "done" if item is not None else "never added"
            self._flag(f"{where} is about output item {index!r}, which is {state}", raw)
            return None
        if "item_id" in payload and payload["item_id"] != item.id:
            self._flag(f"{where}: item_id {payload['item_id']!r}; output item {index!r} is {item.id!r}", raw)
        if item_type is not None and item.type != item_type:
            self._flag(f"{where} is about output item {index!r}, a {item.type!r}, not a {item_type!r}", raw)
            return None
        return item

    def _added(self, payload: dict[str, Any], where: str, raw: bytes) -> None:
        index = payload.get("output_index")
        if index in self._items:
            self._flag(f"{where} adds output item {index!r} a second time", raw)
            return
        if index != len(self._order):
            self._flag(
                f"{where} adds output item {index!r}; the next item's index is {len(self._order)}", raw
            )
        if open_items := [i for i, item in self._items.items() if not item.done]:
            self._flag(f"{where} adds output item {index!r} while item {open_items[0]!r} is not done", raw)
        added = payload.get("item")
        added = added if isinstance(added, dict) else {}
        item = _Item(added.get("type"), added.get("id"))
        self._items[index] = item
        self._order.append(item)

    def _item_done(self, payload: dict[str, Any], where: str, raw: bytes) -> None:
        item = self._open_item(payload, where, raw)
        if item is None:
            return
        item.done = True
        final = payload.get("item")
        final = final if isinstance(final, dict) else {}
        index = payload.get("output_index")
        if (final.get("type"), final.get("id")) != (item.type, item.id):
            self._flag(
                f"{where}: output item {index!r} is done as {final.get('type')!r} {final.get('id')!r}; "
                f"it was added as {item.type!r} {item.id!r}",
                raw,
            )
        if item.type == "message":
            content = final.get("content")
            content = content if isinstance(content, list) else []
            for content_index, (texts, part_done) in item.parts.items():
                if not part_done[0]:
                    self._flag(f"{where}: content part {content_index!r} of item {index!r} is not done", raw)
                part = (
                    content[content_index]
                    if _is_int(content_index) and 0 <= content_index < len(content)
                    else None
                )
                got = part.get("text") if isinstance(part, dict) else None
                if got != "".join(texts):
                    self._flag(
                        f"{where}: content part {content_index!r}'s text is {got!r}; "
                        f"its deltas join to {''.join(texts)!r}",
                        raw,
                    )
        elif item.type == "function_call" and final.get("arguments") != "".join(item.arguments):
            self._flag(
                f"{where}: the call's arguments are {final.get('arguments')!r}; "
                f"its deltas join to {''.join(item.arguments)!r}",
                raw,
            )

    def _part(self, kind: object, payload: dict[str, Any], where: str, raw: bytes) -> None:
        item = self._open_item(payload, where, raw, "message")
        if item is None:
            return
        content_index = payload.get("content_index")
        if kind == "response.content_part.added":
            if content_index != len(item.parts):
                self._flag(f"{where} adds content part {content_index!r}; the next is {len(item.parts)}", raw)
            item.parts[content_index] = ([], [False])
            return
        entry = self._open_part(item, content_index, where, raw)
        if entry is None:
            return
        entry[1][0] = True
        part = payload.get("part")
        got = part.get("text") if isinstance(part, dict) else None
        if got != "".join(entry[0]):
            self._flag(f"{where}: the part's text is {got!r}; its deltas join to {''.join(entry[0])!r}", raw)

    def _open_part(
        self, item: _Item, content_index: object, where: str, raw: bytes
    ) -> tuple[list[str], list[bool]] | None:
        entry = item.parts.get(content_index)
        if entry is None or entry[1][0]:
            state = "done" if entry is not None else "never added"
            self._flag(f"{where} is about content part {content_index!r}, which is {state}", raw)
            return None
        return entry

    def _text(self, kind: object, payload: dict[str, Any], where: str, raw: bytes) -> None:
        item = self._open_item(payload, where, raw, "message")
        if item is None:
            return
        entry = self._open_part(item, payload.get("content_index"), where, raw)
        if entry is None:
            return
        if kind == "response.output_text.delta":
            delta = payload.get("delta")
            entry[0].append(delta if isinstance(delta, str) else "")
        elif payload.get("text") != "".join(entry[0]):
            self._flag(
                f"{where}: output_text.done's text is {payload.get('text')!r}; "
                f"the deltas join to {''.join(entry[0])!r}",
                raw,
            )

    def _arguments(self, kind: object, payload: dict[str, Any], where: str, raw: bytes) -> None:
        item = self._open_item(payload, where, raw, "function_call")
        if item is None:
            return
        if kind == "response.function_call_arguments.delta":
            delta = payload.get("delta")
            item.arguments.append(delta if isinstance(delta, str) else "")
        elif payload.get("arguments") != "".join(item.arguments):
            self._flag(
                f"{where}: function_call_arguments.done's arguments are {payload.get('arguments')!r}; "
                f"the deltas join to {''.join(item.arguments)!r}",
                raw,
            )

    def end(self) -> None:
        if self._ended is None:
            self._flag(
                "the stream ended without response.completed, response.incomplete or response.failed", b""
            )


_Stream = _OpenAIStream | _AnthropicStream | _ResponsesStream


class ResponseCheck:
    """Checks one generation response, fed the ASGI messages the app sends.

    Args:
        kind: ``"text"`` (``/v1/completions``), ``"chat"``, ``"messages"`` or
            ``"responses"``.
        where: names the request in the violations (method, path, request id).
        report: receives each violation.
        done: called once the response is checked: when its last body message is
            observed (before it is sent), or when the app returns without one.
    """

    def __init__(
        self,
        kind: Kind,
        where: str,
        report: Callable[[Violation], None],
        done: Callable[[ResponseCheck], None] = lambda check: None,
    ) -> None:
        self.kind = kind
        self.where = where
        self._report = report
        self._done_callback: Callable[[ResponseCheck], None] | None = done
        self.status = 0
        #: ``error``: a 4xx/5xx body (checked for the Anthropic endpoint only)
        self.mode: Literal["json", "sse", "error", "other", "skip"] | None = None
        self.ended = False
        self.send_failed = False
        self.violations: list[Violation] = []
        self.events = 0
        self._body = bytearray()
        # SSE state, as the SDKs' SSE decoders read a stream
        self._pending = b""  # bytes after the last line end
        self._last_cr = False
        self._event_lines: list[bytes] = []
        self._data: list[str] | None = None
        self._event_name: str | None = None
        self._stream: _Stream
        if kind == "messages":
            self._stream = _AnthropicStream(self._flag)
        elif kind == "responses":
            self._stream = _ResponsesStream(self._flag)
        elif kind != "embeddings":
            self._stream = _OpenAIStream(kind, self._flag)

    # the ASGI side

    def observe(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.status = int(message.get("status", 0))
            if self.status != 200 and not (self.kind == "messages" and 400 <= self.status < 600):
                self.mode = "skip"
                return
            headers = list(message.get("headers", []))
            if request_id := _header(headers, b"x-request-id"):
                self.where += f" (x-request-id {request_id})"
            media = _header(headers, b"content-type").split(";")[0].strip().lower()
            if self.status != 200:
                self.mode = "error"
            elif media == "text/event-stream" and self.kind == "embeddings":
                self.mode = "other"
                self._flag("an embeddings response streamed as server-sent events", b"")
            elif media == "text/event-stream":
                self.mode = "sse"
            elif media == "application/json":
                self.mode = "json"
            else:
                self.mode = "other"
                self._flag(f"a 200 generation response with Content-Type {media!r}", b"")
        elif kind == "http.response.body":
            if self.mode in (None, "skip"):
                return
            body = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            if self.mode == "sse":
                self.feed_sse(body)
            elif self.mode in ("json", "error"):
                self._body += body
            if not more:
                self.finish()

    def closed(self) -> None:
        """The app has returned (or raised)."""
        if self.mode in ("json", "sse", "error", "other"):
            self._complete()

    def _complete(self) -> None:
        callback, self._done_callback = self._done_callback, None
        if callback is not None:
            callback(self)

    def app_raised(self, exc: BaseException) -> None:
        """The app raised (not a cancel, and no send failed): a started stream without
        its end is a truncated stream that a client takes as complete."""
        if self.mode in ("json", "sse") and not self.ended and not self.send_failed:
            self._flag(
                f"the app raised {type(exc).__name__}: {exc} after the response started, without "
                "an error event: the client sees a truncated response",
                b"",
            )

    # the checks

    def finish(self) -> None:
        """The body's last message is going out."""
        if self.ended:
            return
        self.ended = True
        try:
            self._finish_checks()
        finally:
            self._complete()

    def _finish_checks(self) -> None:
        if self.mode == "json":
            self.check_json(bytes(self._body))
        elif self.mode == "error":
            self.check_error(bytes(self._body))
        elif self.mode == "sse":
            if self._pending or self._event_lines:
                self._flag("the body ends inside an event (no blank line after it)", self._pending)
            self._stream.end()

    def check_json(self, body: bytes) -> None:
        model = BODY_TYPES[self.kind]
        payload = _json(self._flag, "the body", body, body)
        if payload is _INVALID:
            return
        if self.kind == "embeddings":
            payload = _decoded_embeddings(self._flag, payload, body)
        problems = check_payload(model, payload)
        if self.kind == "messages" and isinstance(payload, dict) and isinstance(payload.get("content"), list):
            blocks = [
                (b.get("type"), b.get("input")) if isinstance(b, dict) else (None, None)
                for b in payload["content"]
            ]
            problems += _tool_use_problems(blocks, payload.get("stop_reason"))
        if problems:
            self._flag(_joined(problems), body)

    def check_error(self, body: bytes) -> None:
        """A 4xx/5xx body of the Anthropic endpoint."""
        payload = _json(self._flag, f"the {self.status} body", body, body)
        if payload is _INVALID:
            return
        if problems := anthropic_error_problems(payload):
            self._flag(f"the {self.status} body: {_joined(problems)}", body)

    def feed_sse(self, data: bytes) -> None:
        """Split into lines as the SSE spec (and the SDKs) does: ``\\r\\n``, ``\\r``
        or ``\\n``; a blank line dispatches the event."""
        buffer = self._pending + data
        if self._last_cr and buffer.startswith(b"\n"):
            buffer = buffer[1:]  # the \n of a \r\n split between two sends
        self._last_cr = False
        start = 0
        for end in _LINE_END.finditer(buffer):
            self._line(buffer[start : end.start()])
            start = end.end()
            if start == len(buffer) and end.group() == b"\r":
                self._last_cr = True
        self._pending = buffer[start:]

    def _line(self, raw: bytes) -> None:
        if not raw:
            self._dispatch()
            return
        self._event_lines.append(raw)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._flag(f"an SSE line is not UTF-8: {exc}", raw)
            return
        if line.startswith(":"):
            return  # a comment (the heartbeat)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data = [*(self._data or []), value]
        elif name == "event":
            self._event_name = value
        elif name in ("id", "retry"):
            pass
        else:
            self._flag(f"an SSE line with an unknown field {name!r}", raw)

    def _dispatch(self) -> None:
        raw = b"\n".join(self._event_lines)
        data, name = self._data, self._event_name
        self._event_lines, self._data, self._event_name = [], None, None
        if data is None and name is None:
            return  # comments only, or an empty line: clients skip it
        self.events += 1
        self._stream.event(f"event {self.events}", name, "\n".join(data or []), raw)

    def _flag(self, problem: str, data: bytes) -> None:
        violation = Violation(self.where, problem, data)
        self.violations.append(violation)
        self._report(violation)


def _checked(check: ResponseCheck, message: Message) -> None:
    try:
        check.observe(message)
    except Exception as exc:  # a bug here must not change what the server does
        check._flag(f"the validation layer failed: {type(exc).__name__}: {exc}", b"")


def validating_app(
    app: ASGIApp,
    report: Callable[[Violation], None],
    done: Callable[[ResponseCheck], None] = lambda check: None,
) -> ASGIApp:
    """``app``, with every generation response checked (``report`` gets each violation,
    ``done`` each finished check)."""

    async def wrapped(scope: Scope, receive: Any, send: Any) -> None:
        kind = None
        if scope.get("type") == "http" and scope.get("method") == "POST":
            kind = GENERATION_PATHS.get(scope.get("path", "").rstrip("/") or "/")
        if kind is None:
            await app(scope, receive, send)
            return
        check = ResponseCheck(kind, f"POST {scope['path']}", report, done)

        async def checked_send(message: Message) -> None:
            _checked(check, message)  # before the bytes leave: recorded before a client sees them
            try:
                await send(message)
            except BaseException:
                check.send_failed = True
                raise

        try:
            await app(scope, receive, checked_send)
        except Exception as exc:
            check.app_raised(exc)
            raise
        finally:
            check.closed()

    return wrapped


# --- who gets the violations --------------------------------------------------------


@dataclass
class Collector:
    """The violations of one test (``exempt``: the test opted out; kept, not failed)."""

    name: str
    exempt: bool = False
    violations: list[Violation] = field(default_factory=list)
    #: generation responses checked (in process and in the test's server processes)
    responses: int = 0

    def report(self, violation: Violation) -> None:
        self.violations.append(violation)

    def checked(self, check: ResponseCheck) -> None:
        self.responses += 1

    def failure(self) -> str | None:
        if self.exempt or not self.violations:
            return None
        lines = [
            f"{len(self.violations)} generation response(s) or event(s) a client of its API would not accept "
            f"(tests/_openai_validation.py; opt out with @pytest.mark.{MARKER}):"
        ]
        lines += [f"  {v}" for v in self.violations]
        return "\n".join(lines)


#: the running test's collector (None between tests)
current: Collector | None = None
#: violations seen while no test was running
unattributed: list[Violation] = []


def _report(violation: Violation) -> None:
    (current.violations if current is not None else unattributed).append(violation)


def _checked_response(check: ResponseCheck) -> None:
    if current is not None:
        current.checked(check)


def install_in_process(patch: Callable[[object, str, object], None]) -> None:
    """Wrap the app of every :class:`trioserve.Server` built from now on (``patch``:
    ``monkeypatch.setattr``)."""
    from trioserve import Server

    original = Server.__init__

    def __init__(self: Server, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.app = validating_app(self.app, _report, _checked_response)

    patch(Server, "__init__", __init__)


# --- server processes ---------------------------------------------------------------


class ProcessLog:
    """The file a server process writes its checks to (one JSON line per violation, one
    per finished response), read on from where the last drain stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def drain(self) -> tuple[int, list[Violation]]:
        """(responses checked, violations) since the last drain."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return 0, []
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        responses, violations = 0, []
        for line in complete.splitlines():
            entry = json.loads(line)
            if "violation" in entry:
                violations.append(Violation.from_json(entry["violation"]))
            else:
                responses += 1
        return responses, violations


#: the logs of the server processes alive now
process_logs: list[ProcessLog] = []


def drain_processes(into: Collector) -> None:
    for log in process_logs:
        responses, violations = log.drain()
        into.responses += responses
        into.violations += violations


def script_command(violations: Path) -> list[str]:
    """The start of a command that runs ``trioserve`` (its arguments follow) with every
    generation response checked, into ``violations``."""
    return [sys.executable, str(Path(__file__).resolve()), "--violations", str(violations)]


def _serve_checked(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--violations":
        raise SystemExit("usage: _openai_validation.py --violations FILE <trioserve arguments>")
    out = Path(argv[1]).open("a", encoding="utf-8")  # noqa: SIM115 - open for the process's life

    def write(entry: dict[str, object]) -> None:
        out.write(json.dumps(entry) + "\n")
        out.flush()  # on disk before the bytes it is about reach the client

    from trioserve import Server
    from trioserve._cli import main

    original = Server.__init__

    def __init__(self: Server, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.app = validating_app(
            self.app,
            lambda violation: write({"violation": violation.to_json()}),
            lambda check: write({"response": check.where}),
        )

    Server.__init__ = __init__  # type: ignore[method-assign]
    return main(argv[2:])


if __name__ == "__main__":
    raise SystemExit(_serve_checked(sys.argv[1:]))
