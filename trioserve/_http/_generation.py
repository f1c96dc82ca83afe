"""The generation endpoints (``POST /v1/completions``, ``/v1/chat/completions``), served
at the ASGI level: one request's whole life in one cancel scope.

:class:`GenerationHandler` runs each request inside its
:class:`~trioserve._http._request.InFlightRequest`'s scope, with a disconnect watcher, a
stall timer (shielded until the body is done) and, for streams, a heartbeat until the
first event. Every cause cancels that scope (the first recorded wins); when the handler
returns, the request's inference has returned and its slot is free. A response that
ended on its own is sent in full (shielded, bounded by the stall timeout); a deadline or
shutdown gets a final event within ``FINAL_EVENT_TIMEOUT``. Why the ASGI level, and
every bound: ``docs/architecture.md``, ``docs/cancellation.md``.
"""

import uuid

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._registry import ModelEntry
from .._wire import SPECS, DialectSpec, decode
from ._access import key_salt, presented_key
from ._detached_jobs import DetachedJobs
from ._direct_route import read_json_body, refuse_large_headers, refuse_unless_post
from ._errors import renderer
from ._exchange import (
    Exchange,
    Receive,
    Scope,
    Send,
    _header,
    _peek_head,
    _request_timeout,
)
from ._lifecycle import FINAL_EVENT_TIMEOUT, INLINE_PARSE_BYTES, off_the_loop_if
from ._prepare_run import cache_salt
from ._request import InFlightRequest, Kind
from ._request_scope import RunPlan

__all__ = [
    "FINAL_EVENT_TIMEOUT",
    "GENERATION_PATHS",
    "GenerationHandler",
    "cache_salt",
    "key_salt",
    "presented_key",
    "valid_id",
]

GENERATION_PATHS: dict[str, Kind] = {
    "/v1/completions": "text",
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/infill": "infill",
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
}

#: each generation route's dialect, picked once per request at the route
_SPECS: dict[Kind, DialectSpec] = {kind: SPECS[path] for path, kind in GENERATION_PATHS.items()}
_SPECS["transcription"] = SPECS["/v1/audio/transcriptions"]  # (reached through its form's reader)


class _StreamField(msgspec.Struct):
    stream: bool | None = None


_stream_decoder = msgspec.json.Decoder(_StreamField)


#: a client's request and session ids: what they may hold
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
_ID_RULE = "{name} must be 1 to 128 letters, digits, '.', '_', ':' or '-'"


def valid_id(value: str) -> bool:
    """Whether ``value`` may be a request's or a session's id."""
    return 0 < len(value) <= 128 and set(value) <= _ID_CHARS


class GenerationHandler(DetachedJobs):
    """Serves one generation request from parse to final byte. Its parts, one module
    each: the request's entry and checks (here); the jobs no connection holds
    (:class:`~trioserve._http._detached_jobs.DetachedJobs`); the request's life in its
    cancel scope (:class:`~trioserve._http._request_scope.RequestScope`); the request
    on its model's engine (:class:`~trioserve._http._prepare_run.PrepareAndRun`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        spec = _SPECS[kind]
        given = _header(scope, b"x-request-id")
        valid = given is not None and valid_id(given)
        exchange = Exchange(send, given if given is not None and valid else uuid.uuid4().hex, renderer(spec))
        request = InFlightRequest(scope, exchange, kind)
        request.owner = self.owner(scope)

        async def serve() -> None:
            refuse_large_headers(scope, self.state.settings.max_header_bytes)
            if given is not None and not valid:
                raise InvalidRequestError(_ID_RULE.format(name="X-Request-Id"), param="X-Request-Id")
            session = _header(scope, b"x-session-id")
            if session is not None and not valid_id(session):
                raise InvalidRequestError(_ID_RULE.format(name="X-Session-Id"), param="X-Session-Id")
            request.session = session
            refuse_unless_post(scope)
            await self._serve(request, receive, spec)

        await self._handle(request, serve)

    async def _serve(self, request: InFlightRequest, receive: Receive, spec: DialectSpec) -> None:
        state = self.state
        scope = request.asgi
        # (a transcription's form, read and bounded already: its own limit)
        body = await read_json_body(scope, receive, state.settings, scope.get("trioserve.body_limit"))
        # which model: refused (404, 503 shutting down) before any work
        # (a large body's depth check and decode: off the event loop)
        large = len(body) > INLINE_PARSE_BYTES
        head = await off_the_loop_if(large, _peek_head, body)
        resolve_model = spec.resolve_model
        if resolve_model is None:
            entry, _ = state.resolve_adapter(head.model)  # (a LoRA adapter's name: its base's)
        else:  # (the dialect's names: Ollama's name:latest)
            entry = resolve_model(head.model, state.resolve)
        request.model = entry.name
        request.set_timeout(_request_timeout(scope, state.settings))
        conversation = self._conversation_id(request, body, spec)
        self._admit(request, entry, head.priority)
        ask = None
        if state.responses is not None and spec.peek_stored is not None:
            peek = spec.peek_stored
            ask = await off_the_loop_if(large, peek, body)
            if ask.background and conversation is not None:
                raise InvalidRequestError(
                    "a background response is resumed by its id (GET /v1/responses/{id}?stream=true): "
                    "send it without X-Conversation-Id",
                    param="X-Conversation-Id",
                )
        plan = RunPlan(spec, body, entry, ask)
        if ask is not None and ask.background:
            await self._start_background(request, receive, plan)
            return
        if conversation is not None:
            await self._start_detached(request, receive, plan, conversation)
            return
        await self._run(request, receive, plan)

    def _conversation_id(self, request: InFlightRequest, body: bytes, spec: DialectSpec) -> str | None:
        """A detachable stream's id (llama-server's ``X-Conversation-Id``), checked:
        a valid id, on a streaming request, on a server that keeps them (400s naming
        the header)."""
        scope = request.asgi
        if _header(scope, b"last-event-id") is not None:
            raise InvalidRequestError(
                "Last-Event-ID resumes a stream on GET /v1/stream or GET /v1/responses/{id}?stream=true; "
                "a POST starts a new one",
                param="Last-Event-ID",
            )
        conversation = _header(scope, b"x-conversation-id")
        if conversation is None:
            return None
        if not valid_id(conversation):
            raise InvalidRequestError(_ID_RULE.format(name="X-Conversation-Id"), param="X-Conversation-Id")
        if not spec.resumable:
            raise InvalidRequestError(
                f"X-Conversation-Id makes a server-sent-events stream resumable; {request.asgi['path']} "
                "streams NDJSON, which cannot be resumed: send the request without it",
                param="X-Conversation-Id",
            )
        if self.state.detached is None:
            raise InvalidRequestError(
                "this server keeps no detachable streams (--detach-max 0): send the request without "
                "X-Conversation-Id",
                param="X-Conversation-Id",
            )
        if not decode(_stream_decoder, body).stream:
            raise InvalidRequestError(
                'X-Conversation-Id makes a stream resumable: it needs "stream": true (a whole answer '
                "cannot be resumed; send it without the header)",
                param="X-Conversation-Id",
            )
        return conversation

    def _admit(self, request: InFlightRequest, entry: ModelEntry, priority: int | None) -> None:
        """Its key's bound on priorities (403), its rate limits (429 with
        ``x-ratelimit-*``) and, where the model is loaded, its queue (429 at capacity):
        before any expensive work — a stored conversation's read, a model load, the
        full parse, a background response's record. (The queue is checked again after
        the parse, inside the request's deadline.)"""
        accounts = self.state.accounts
        account = request.account = accounts.account(self._key(request.asgi))
        accounts.ticket(account, request.owner, priority)  # (403 before a rate token is taken)
        request.exchange.extra_headers = accounts.admit(request.owner, account)
        engine = entry.engine
        if engine is not None:
            engine.admission.check()
