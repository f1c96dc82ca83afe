"""``POST /v1/audio/transcriptions`` at the ASGI level (docs/audio.md; speech:
``_speech.py``).

A transcription's multipart body is read here, bounded before a byte of it is read
(``Content-Length`` against ``--max-audio-bytes`` and the form fields' allowance: 413),
counted as it arrives (a chunked body cut at the same bound), within
``--body-timeout``, parsed by ``python-multipart`` as it arrives (at most
:data:`MAX_FIELDS` fields of :data:`MAX_FIELD_BYTES` each, one file). The form becomes
the chat request llama-server builds (``_wire/_transcriptions.py``), run by the
generation handler as the ``transcription`` dialect: the same request scope, queue,
deadline, disconnect watcher and cancellation as a chat."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import trio

from .._core._exceptions import (
    InvalidRequestError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    TrioserveError,
)
from .._wire import TranscriptionForm, chat_body
from ._exchange import Exchange, Message, Receive, Scope, Send, _ClientGone, _header, body_timeout_error
from ._state import ServerState

__all__ = ["TRANSCRIPTIONS_PATH", "TranscriptionsHandler"]


TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
#: form fields besides the file, and the bytes of each
MAX_FIELDS, MAX_FIELD_BYTES = 16, 64 * 1024
#: what the form may add to the clip's bytes: its fields and every part's headers
FORM_ALLOWANCE = MAX_FIELDS * MAX_FIELD_BYTES


class _Form:
    """python-multipart's callbacks, collecting one file and the text fields."""

    def __init__(self, max_file: int) -> None:
        self.max_file = max_file
        self.fields: list[tuple[str, str]] = []
        self.file: bytearray | None = None
        self.filename = ""
        self.content_type = ""
        self._headers: dict[bytes, bytes] = {}
        self._field = b""
        self._value = b""
        self._part: bytearray | None = None
        self._name = ""
        self._is_file = False

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._grow("_field", data[start:end]),
            "on_header_value": lambda data, start, end: self._grow("_value", data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _grow(self, which: str, data: bytes) -> None:
        value = getattr(self, which) + data
        if len(value) > MAX_FIELD_BYTES:
            raise InvalidRequestError("a form part's header is too long", param="file")
        setattr(self, which, value)

    def _begin(self) -> None:
        self._headers, self._field, self._value = {}, b"", b""

    def _header_end(self) -> None:
        self._headers[self._field.strip().lower()] = self._value.strip()
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        from python_multipart.multipart import parse_options_header

        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        if name is None:
            raise InvalidRequestError(
                "a form part has no name (Content-Disposition: form-data; name=…)", param="file"
            )
        self._name = name.decode("utf-8", "replace")
        self._is_file = b"filename" in options or self._name == "file"
        if self._is_file:
            if self._name != "file":
                raise InvalidRequestError(
                    f"the form's file goes in the field 'file', not {self._name!r}", param="file"
                )
            if self.file is not None:
                raise InvalidRequestError("the form holds more than one file; send one", param="file")
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
            self.content_type = self._headers.get(b"content-type", b"").decode("latin-1")
        elif len(self.fields) >= MAX_FIELDS:
            raise InvalidRequestError(f"the form holds more than {MAX_FIELDS} fields", param=self._name)
        self._part = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        assert self._part is not None
        self._part += data[start:end]
        limit = self.max_file if self._is_file else MAX_FIELD_BYTES
        if len(self._part) > limit:
            if self._is_file:
                raise InvalidRequestError(
                    f"the audio file is larger than {limit} bytes, this server's limit for one clip "
                    "(--max-audio-bytes)",
                    param="file",
                    code="audio_too_large",
                )
            raise InvalidRequestError(
                f"the form field {self._name!r} exceeds {limit} bytes", param=self._name
            )

    def _end(self) -> None:
        part, self._part = self._part or bytearray(), None
        if self._is_file:
            self.file = part
        else:
            try:
                self.fields.append((self._name, part.decode()))
            except UnicodeDecodeError:
                raise InvalidRequestError(
                    f"the form field {self._name!r} is not UTF-8", param=self._name
                ) from None


async def read_form(scope: Scope, receive: Receive, state: ServerState) -> TranscriptionForm:
    """The request's multipart form, bounded (module docstring)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    settings = state.settings
    media_type, options = parse_options_header(_header(scope, b"content-type") or "")
    boundary = options.get(b"boundary")
    if media_type.lower() != b"multipart/form-data" or not boundary:
        raise InvalidRequestError(
            "a transcription is sent as multipart/form-data (a file field and text fields), as "
            "OpenAI's SDK sends it",
            param="file",
        )
    max_file = settings.request_limits.max_audio_bytes
    bound = max_file + FORM_ALLOWANCE
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > bound:
        raise PayloadTooLargeError(
            f"the request body is {declared} bytes; a transcription's form may have at most {bound} "
            f"(--max-audio-bytes {max_file} and {FORM_ALLOWANCE} of fields)"
        )
    form = _Form(max_file)
    try:
        parser = MultipartParser(boundary, form.callbacks(), max_size=bound)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequestError(f"the form's boundary is not usable: {exc}", param="file") from None
    received = 0
    timeout = settings.body_timeout or float("inf")
    with trio.move_on_after(timeout) as waited:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > bound:
                raise PayloadTooLargeError(
                    f"the request body exceeds {bound} bytes, a transcription form's limit "
                    "(--max-audio-bytes)"
                )
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise InvalidRequestError(f"the multipart body is malformed: {exc}", param="file") from None
            if not message.get("more_body", False):
                break
    if waited.cancelled_caught:
        raise body_timeout_error(timeout)
    try:
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequestError(f"the multipart body is malformed: {exc}", param="file") from None
    if form.file is None:
        raise InvalidRequestError("the form has no file: send the audio in the field 'file'", param="file")
    return TranscriptionForm(bytes(form.file), form.filename, form.content_type, tuple(form.fields))


class TranscriptionsHandler:
    """Reads the form, then hands the request to the generation handler."""

    def __init__(self, state: ServerState, generation: Any) -> None:
        self.state = state
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = uuid.uuid4().hex
        if scope["method"] != "POST":
            await Exchange(send, request_id).error(
                MethodNotAllowedError(f"{scope['path']} accepts POST only")
            )
            return
        try:
            form = await read_form(scope, receive, self.state)
            body = (
                await trio.to_thread.run_sync(chat_body, form)
                if len(form.file) > 1 << 16
                else chat_body(form)
            )
        except _ClientGone:
            return
        except TrioserveError as exc:
            await Exchange(send, request_id).error(exc)
            return
        text = b'"transcription_format":"text"' in body[:64]
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        inner = {**scope, "headers": headers, "trioserve.body_limit": len(body)}
        given = False

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def plain(message: Message) -> None:
            # (response_format text: the body is the transcript, text/plain)
            if text and message["type"] == "http.response.start" and message["status"] == 200:
                message = {
                    **message,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8") if k == b"content-type" else (k, v)
                        for k, v in message["headers"]
                    ],
                }
            await send(message)

        await self.generation(inner, replay, plain, "transcription")
