"""``POST /v1/audio/speech`` at the ASGI level (docs/audio.md, "Speech").

The speech model (``--tts-model`` and ``--tts-mmproj``) is held by :class:`SpeechService`:
loaded in a worker thread when the server starts, one generation at a time (its own
queue, an :class:`~trioserve._core._admission.Admission` of one slot and
``--max-queue`` places: 429 past them, a waiting request leaves at once when cancelled),
closed at shutdown once no thread uses it.

A request is the generation endpoints' shape: the body read and checked
(``_wire/_speech.py``), then one cancel scope (its deadline, ``X-Request-Timeout``), a
disconnect watcher and the stall timer in its nursery, the server's drain reaching it
through :class:`~trioserve._http._state.ServerState`. The generation runs in a worker
thread; each window of samples the engine makes goes out at once (the thread waits for
the send: a client that reads slowly slows the generation, never fills memory). Any
cancel of the request's scope — the client gone, the deadline, shutdown, a cancel by id —
raises the engine's stop flag, which it reads before every frame.

Without a speech model the route answers 400 ``speech_not_supported``."""

from __future__ import annotations

import functools
import math
import threading
import uuid

import msgspec
import trio

from .._core._exceptions import (
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    TrioserveError,
)
from .._wire._speech import (
    SpeechRequest,
    decode_speech_request,
    speech_delta_event,
    speech_done_event,
    speech_error_event,
    streaming_wav_header,
)
from ._access import AccessPolicy, key_salt
from ._accounting import log_request_counts
from ._direct_route import errors_answered, read_json_body, refuse_large_headers, refuse_unless_post
from ._errors import render_error
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _header,
    _request_timeout,
)
from ._generation import _ID_RULE, valid_id
from ._lifecycle import FINAL_EVENT_TIMEOUT, end_connection, send_last, watched
from ._request import InFlightRequest, Phase
from ._speech_service import SpeechModel, SpeechService
from ._state import ServerState

__all__ = ["SPEECH_PATH", "SpeechHandler", "not_supported"]

SPEECH_PATH = "/v1/audio/speech"


def not_supported() -> InvalidRequestError:
    return InvalidRequestError(
        "this server generates no speech: it was started without a text-to-speech model "
        '(--tts-model and --tts-mmproj: docs/audio.md, "Speech")',
        param="model",
        code="speech_not_supported",
    )


#: the answer's headers: the audio's media type (PCM: 16-bit little-endian mono at the
#: model's rate, OpenAI's ``pcm``), or the event stream's (``_generation.py``'s); nothing
#: buffers it on the way (it goes out as it is made)
_HEADERS = {
    "wav": [(b"content-type", b"audio/wav")],
    "pcm": [(b"content-type", b"audio/pcm")],
    "sse": [(b"content-type", b"text/event-stream; charset=utf-8")],
}
_UNBUFFERED = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class SpeechHandler:
    """One speech request, from its body to its last byte (module docstring)."""

    def __init__(self, state: ServerState, access: AccessPolicy | None = None) -> None:
        self.state = state
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = _header(scope, b"x-request-id")
        valid = given is not None and valid_id(given)
        exchange = Exchange(send, given if given is not None and valid else uuid.uuid4().hex, render_error)
        request = InFlightRequest(scope, exchange, "speech")
        request.owner = key_salt(scope, self.access)
        usage = [0, 0]  # input tokens, frames
        try:
            async with errors_answered(request):
                refuse_large_headers(scope, self.state.settings.max_header_bytes)
                if given is not None and not valid:
                    raise InvalidRequestError(_ID_RULE.format(name="X-Request-Id"), param="X-Request-Id")
                refuse_unless_post(scope)
                service = self.state.speech
                if service is None:
                    raise not_supported()
                await self._serve(request, receive, service, usage)
        finally:
            self._log(request, *usage)

    async def _serve(
        self, request: InFlightRequest, receive: Receive, service: SpeechService, usage: list[int]
    ) -> None:
        state = self.state
        scope = request.asgi
        body = await read_json_body(scope, receive, state.settings)
        parsed = decode_speech_request(body)  # (≤ 4,096 characters: on the loop)
        if state.shutting_down:
            raise ServiceUnavailableError(
                "the server is shutting down; retry on another instance", retry_after=1
            )
        model = service.serving()
        if parsed.model is not None and parsed.model != service.name:
            raise NotFoundError(
                f"the speech model {parsed.model!r} does not exist on this server; available: {service.name}",
                param="model",
                code="model_not_found",
            )
        request.model = service.name
        request.set_timeout(_request_timeout(scope, state.settings))
        with request.cancel_scope:
            request.advance(Phase.QUEUED)
            state.add_request(request)
            try:
                stall = math.inf if state.stall_timeout is None else state.stall_timeout
                # 429 when the queue is full or the deadline cannot be met
                async with watched(request, receive, stall), service.admission.slot():
                    await self._speak(request, service, model, parsed, usage)
            finally:
                state.remove_request(request)
        if request.cancel_scope.cancelled_caught or request.cause is not None:
            request.note_deadline()
            await self._cut(request, parsed)

    async def _speak(
        self,
        request: InFlightRequest,
        service: SpeechService,
        model: SpeechModel,
        parsed: SpeechRequest,
        usage: list[int],
    ) -> None:
        """Check the input's tokens, answer 200, run the generation; ``usage``: the
        input tokens and the frames made, as they become known."""
        exchange = request.exchange
        # (tokenizing: CPU work; a 400 for too many tokens while nothing has gone out)
        tokens = usage[0] = await trio.to_thread.run_sync(model.check_input, parsed.input)
        sse = parsed.stream_format == "sse"
        headers = _HEADERS["sse" if sse else parsed.response_format]
        request.advance(Phase.STREAMING)
        await exchange.start(200, [*headers, *_UNBUFFERED])
        head = streaming_wav_header(model.sample_rate) if parsed.response_format == "wav" else b""
        if head and not sse:
            await exchange.body(head)
        stop = threading.Event()
        first = [head] if sse and head else []

        async def write(chunk: bytes) -> None:
            if sse:
                if first:
                    chunk = first.pop() + chunk  # (the WAV header rides in the first delta)
                await exchange.body(speech_delta_event(chunk))
            else:
                await exchange.body(chunk)

        def emit(chunk: bytes) -> None:  # (the worker thread)
            if stop.is_set():
                return
            try:
                trio.from_thread.run(write, chunk)
            except (trio.Cancelled, trio.BrokenResourceError, trio.ClosedResourceError):
                stop.set()  # the request's scope was cancelled during the send, or the client went

        async def relay_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop.set()  # any cancel of the request's scope: the engine stops before its next frame

        generate = functools.partial(
            model.generate, parsed.input, emit=emit, cancelled=stop.is_set, seed=parsed.seed
        )
        failure: TrioserveError | None = None
        async with service.busy:
            service.generations += 1
            service.running += 1
            async with trio.open_nursery() as inner:
                inner.start_soon(relay_cancel)
                try:
                    result = await trio.to_thread.run_sync(generate)
                except TrioserveError as exc:  # the engine failed after the answer began
                    failure = exc
                else:
                    # (no checkpoint between the thread's end and here: counted even if
                    # the request was cancelled meanwhile)
                    usage[1] = result.frames
                    service.stopped += result.stopped
                finally:
                    service.running -= 1
                inner.cancel_scope.cancel()
        if failure is not None:
            request.end("error", failure.message)
            await self._fail(request, sse, failure)
            return
        if first:  # (no sound at all: the header still goes out)
            await write(b"")
        request.end("stop")
        last = speech_done_event(tokens, usage[1]) if sse else b""
        bound = math.inf if self.state.stall_timeout is None else self.state.stall_timeout
        request.delivered = await send_last(request, bound, lambda: exchange.body(last, more=False))
        request.watch_scope.cancel()

    async def _fail(self, request: InFlightRequest, sse: bool, exc: TrioserveError) -> None:
        """The engine failed mid-answer: an error event (SSE), or the connection ended
        (audio: a body cut short, never one that looks whole)."""
        exchange = request.exchange
        if sse:
            _, _, body = render_error(exc)
            event = speech_error_event(msgspec.json.decode(body))
            await send_last(request, FINAL_EVENT_TIMEOUT, lambda: exchange.body(event, more=False))
        else:
            end_connection(request.asgi)

    async def _cut(self, request: InFlightRequest, parsed: SpeechRequest) -> None:
        """The request was cancelled: before the answer, its 503/504; after, the reason
        as an error event (SSE), or the connection ended (audio)."""
        exchange = request.exchange
        cause = request.cause
        if cause in ("disconnect", "stall", "stop") or exchange.ended:
            return  # (nobody to tell; or the answer was whole: a cancel after its end)
        if cause == "deadline":
            error: TrioserveError = DeadlineExceededError(
                "the request's deadline passed before the speech was done"
            )
        elif cause == "shutdown":
            error = ServiceUnavailableError("the server is shutting down; retry on another instance")
        else:
            error = ServiceUnavailableError(f"the speech generation was stopped ({cause})", code=str(cause))
        if not exchange.started:
            raise error
        await self._fail(request, parsed.stream_format == "sse", error)

    def _log(self, request: InFlightRequest, tokens: int, frames: int) -> None:
        log_request_counts(
            self.state.metrics, request, SPEECH_PATH, "input_tokens=%d frames=%d", tokens, frames
        )
