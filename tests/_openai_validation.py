"""Every generation response a test receives, checked against the openai SDK's own types.

The openai SDK builds its response objects with ``construct`` (no validation) unless a
client asks for strict validation, so a client never notices a ``finish_reason`` that
is not one of OpenAI's, or a chunk without its ``created``. This module checks what the
server *sends*, whatever client a test uses (httpx, the openai SDK, raw sockets, h2):

* :func:`validating_app` wraps an ASGI app; every ``POST /v1/completions`` and
  ``POST /v1/chat/completions`` answered 200 is checked as it goes out (each event
  before its bytes reach the transport, so a violation is recorded before the client
  can have read it):

  - a JSON body with ``openai.types.Completion`` / ``openai.types.chat.ChatCompletion``;
  - each SSE ``data:`` event with ``openai.types.Completion`` (the legacy completions
    stream uses the response type; ``finish_reason`` may be null until the last chunk,
    as OpenAI sends it: :data:`CompletionStreamChunk`) /
    ``openai.types.chat.ChatCompletionChunk``, except
    ``[DONE]`` and an error object (``{"error": {"message": ...}}``, the form a failure
    after the stream started takes: openai-python raises ``APIError`` on it), whose
    ``message`` must be a non-empty string;

  each with ``model_validate(payload, strict=False)`` — validation mode, not
  ``construct``. The types accept extra fields (the ``trioserve`` extension is one), so
  every field the types declare as a ``Literal`` (``finish_reason``, ``object``,
  ``role``, a tool call's ``type``) is also checked explicitly against the values the
  type declares (read from the type, not written here). And the stream as a whole: a
  body that ends normally ends with ``data: [DONE]``, nothing follows ``[DONE]``,
  nothing but ``[DONE]`` follows an error event, every choice of a stream that ended
  without an error got a ``finish_reason``, a choice gets no chunk after its
  ``finish_reason``, no event has an ``event:`` name (openai-python reads named events
  differently), and an app that raises after the response started is a truncated
  stream that openai-python would take as complete.

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
import re
import sys
import types
import typing
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pydantic

if __name__ == "__main__":  # run as a script: make the repository importable (benchmarks, tests)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# imported at once: importing openai takes ~0.5 s, too long for the event loop mid-test
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk

__all__ = [
    "MARKER",
    "Collector",
    "CompletionStreamChunk",
    "ResponseCheck",
    "Violation",
    "check_payload",
    "declared_literals",
    "install_in_process",
    "validating_app",
]

#: the opt-out marker (registered in pyproject.toml)
MARKER = "no_openai_validation"

Kind = Literal["text", "chat"]
GENERATION_PATHS: dict[str, Kind] = {"/v1/completions": "text", "/v1/chat/completions": "chat"}

# The legacy completions stream's chunks are ``Completion`` objects, but OpenAI sends
# ``"finish_reason": null`` in every chunk before the last, and openai-python's
# ``CompletionChoice`` declares it required and not nullable (the SDK builds stream
# chunks with ``construct``, so it never notices). The stream's type is ``Completion``
# with that one field nullable (still required): the same Literal values, read from the
# type, plus null, as ``ChatCompletionChunk``'s choices declare it.
_StreamChoice = pydantic.create_model(
    "CompletionStreamChoice",
    __base__=CompletionChoice,
    finish_reason=(CompletionChoice.model_fields["finish_reason"].annotation | None, ...),
)
CompletionStreamChunk = pydantic.create_model(
    "CompletionStreamChunk", __base__=Completion, choices=(list[_StreamChoice], ...)
)

#: (non-streamed response type, stream chunk type) per endpoint
TYPES: dict[Kind, tuple[type[pydantic.BaseModel], type[pydantic.BaseModel]]] = {
    "text": (Completion, CompletionStreamChunk),
    "chat": (ChatCompletion, ChatCompletionChunk),
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
    """One response (or event of a stream) that an OpenAI client would not accept."""

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


#: checks ``value`` (raw JSON) at ``path``: the problems found
Checker = Callable[[object, str], list[str]]


def _literal_problems(annotation: Any, value: object, path: str) -> list[str]:
    """Where ``value`` (raw JSON) holds a value a ``Literal`` of ``annotation`` does not
    allow. Unions of several types are left to pydantic."""
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
            return None  # a union of several types: pydantic decides
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
            return [f"{path} is {value!r}; the openai type allows only {shown}"]

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
                if (checker := _checker(info.annotation)) is not None
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


def check_payload(model: type[pydantic.BaseModel], payload: object) -> list[str]:
    """What is wrong with ``payload`` (parsed JSON) as a ``model``: pydantic's errors in
    validation mode, and every declared ``Literal`` field checked explicitly."""
    problems = _literal_problems(model, payload, model.__name__)
    try:
        model.model_validate(payload, strict=False)
    except pydantic.ValidationError as exc:
        problems.append(f"{model.__name__}.model_validate: {exc}")
    return problems


# --- one response -------------------------------------------------------------------


def _joined(problems: list[str]) -> str:
    """One message for the problems of one event or body (each on its own lines)."""
    return "\n      ".join(line for problem in problems for line in problem.splitlines())


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


class ResponseCheck:
    """Checks one generation response, fed the ASGI messages the app sends.

    Args:
        kind: ``"text"`` (``/v1/completions``) or ``"chat"``.
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
        self.mode: Literal["json", "sse", "other", "skip"] | None = None
        self.ended = False
        self.send_failed = False
        self.violations: list[Violation] = []
        self.events = 0
        self._body = bytearray()
        # SSE state, as openai-python's SSEDecoder reads a stream
        self._pending = b""  # bytes after the last line end
        self._last_cr = False
        self._event_lines: list[bytes] = []
        self._data: list[str] | None = None
        self._event_name: str | None = None
        self._done = False
        self._errored = False
        self._choices_seen: set[int] = set()
        self._choices_finished: set[int] = set()

    # the ASGI side

    def observe(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.status = int(message.get("status", 0))
            if self.status != 200:
                self.mode = "skip"
                return
            headers = list(message.get("headers", []))
            if request_id := _header(headers, b"x-request-id"):
                self.where += f" (x-request-id {request_id})"
            media = _header(headers, b"content-type").split(";")[0].strip().lower()
            if media == "text/event-stream":
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
            elif self.mode == "json":
                self._body += body
            if not more:
                self.finish()

    def closed(self) -> None:
        """The app has returned (or raised)."""
        if self.mode in ("json", "sse", "other"):
            self._complete()

    def _complete(self) -> None:
        callback, self._done_callback = self._done_callback, None
        if callback is not None:
            callback(self)

    def app_raised(self, exc: BaseException) -> None:
        """The app raised (not a cancel, and no send failed): a started stream without
        its end is a truncated stream that openai-python takes as complete."""
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
        elif self.mode == "sse":
            if self._pending or self._event_lines:
                self._flag("the body ends inside an event (no blank line after it)", self._pending)
            if not self._done:
                self._flag("the stream ended without data: [DONE]", b"")
            elif not self._errored:
                missing = sorted(self._choices_seen - self._choices_finished)
                if missing:
                    self._flag(f"choice(s) {missing} never got a finish_reason before [DONE]", b"")

    def check_json(self, body: bytes) -> None:
        model = TYPES[self.kind][0]
        try:
            payload = json.loads(body)
        except ValueError as exc:
            self._flag(f"the body is not JSON: {exc}", body)
            return
        if problems := check_payload(model, payload):
            self._flag(_joined(problems), body)

    def feed_sse(self, data: bytes) -> None:
        """Split into lines as the SSE spec (and openai-python) does: ``\\r\\n``, ``\\r``
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
        where = f"event {self.events}"
        if name is not None:
            self._flag(f"{where} has an event name {name!r} (openai-python reads named events apart)", raw)
        if self._done:
            self._flag(f"{where} comes after data: [DONE]", raw)
            return
        text = "\n".join(data or [])
        if text == "[DONE]":
            self._done = True
            return
        if self._errored:
            self._flag(f"{where} follows an error event: only data: [DONE] may", raw)
        try:
            payload = json.loads(text)
        except ValueError as exc:
            self._flag(f"{where} is not JSON: {exc}", raw)
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
        if problems := check_payload(TYPES[self.kind][1], payload):
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
        if kind not in TYPES:
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
            f"{len(self.violations)} generation response(s) or event(s) an OpenAI client would not accept "
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
        self.app = validating_app(self.app, _report, _checked_response)  # type: ignore[assignment, arg-type]

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
        self.app = validating_app(  # type: ignore[assignment]
            self.app,  # type: ignore[arg-type]
            lambda violation: write({"violation": violation.to_json()}),
            lambda check: write({"response": check.where}),
        )

    Server.__init__ = __init__  # type: ignore[method-assign]
    return main(argv[2:])


if __name__ == "__main__":
    raise SystemExit(_serve_checked(sys.argv[1:]))
