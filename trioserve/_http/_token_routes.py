"""The tokenizer routes: llama-server's ``/tokenize`` and ``/detokenize``, and token
counting (``/v1/messages/count_tokens``, ``/v1/responses/input_tokens``: the prompt
generation would render, counted by the model's tokenizer; docs/dialects.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

from quart import Response
from quart_trio import QuartTrio

from .._core._exceptions import TrioserveError
from .._wire import (
    MESSAGES,
    RESPONSES,
    Conversation,
    DialectSpec,
    ReadOptions,
    StoredContext,
    decode_detokenize_request,
    decode_tokenize_request,
    detokenize_response,
    generation_for,
    tokenize_response,
)
from ._access import AccessPolicy
from ._errors import renderer
from ._exchange import Scope
from ._fetch import resolve_images
from ._generation import key_salt, presented_key
from ._lifecycle import INLINE_PARSE_BYTES, off_the_loop_if
from ._route_io import body_bytes, error_response, json_body, json_response
from ._state import ServerState

__all__ = ["add_token_routes"]


#: /tokenize and /detokenize answers of more tokens than this are JSON-encoded in a
#: worker thread
_INLINE_ENCODE_TOKENS = 16 * 1024


def add_token_routes(app: QuartTrio, state: ServerState, access: AccessPolicy | None) -> None:
    """Add the tokenizer and token-counting routes to ``app``."""

    # llama-server's tokenizer endpoints (docs/api.md, "Tokenizing")
    @app.post("/tokenize")
    async def tokenize() -> Response:
        try:
            registry = state.serving_registry()  # (503 before reading the body)
            request = await json_body(decode_tokenize_request)
            # a lease: the model is not unloaded while its tokenizer runs (in a thread
            # for long texts: the backend's rule)
            async with registry.lease(state.resolve(request.model)) as lease:
                backend = lease.engine.backend
                tokens = await backend.tokenize_text(
                    request.content, add_special=request.add_special, parse_special=request.parse_special
                )
                pieces = await backend.token_pieces(tokens) if request.with_pieces else None
        except TrioserveError as exc:
            return error_response(exc)
        body = await off_the_loop_if(len(tokens) > _INLINE_ENCODE_TOKENS, tokenize_response, tokens, pieces)
        return Response(body, content_type="application/json")

    @app.post("/detokenize")
    async def detokenize() -> Response:
        try:
            registry = state.serving_registry()
            request = await json_body(decode_detokenize_request)
            async with registry.lease(state.resolve(request.model)) as lease:
                pieces = await lease.engine.backend.token_pieces(request.tokens)
        except TrioserveError as exc:
            return error_response(exc)
        body = await off_the_loop_if(len(pieces) > _INLINE_ENCODE_TOKENS, detokenize_response, pieces)
        return Response(body, content_type="application/json")

    # token counting (docs/dialects.md, "Token counting"): the prompt generation would
    # render, counted by the model's tokenizer; nothing is evaluated, and nothing is
    # queued but a request with images, which holds a queue place while they are
    # fetched and decoded
    def admit_count() -> list[tuple[bytes, bytes]]:
        """The key's rate limits, as generation takes them (``GenerationHandler._admit``):
        429 with ``x-ratelimit-*`` before any work (a stored conversation's read, a
        model load, an image's fetch); a count takes a request, never tokens (nothing
        is evaluated). Its ``x-ratelimit-*`` headers."""
        from quart import request

        scope = cast("Scope", request.scope)
        key = presented_key(scope) if access is not None and access.requires_key else None
        accounts = state.accounts
        return accounts.admit(key_salt(scope, access), accounts.account(key))

    async def count(spec: DialectSpec, limits: list[tuple[bytes, bytes]]) -> int:
        """The prompt's tokens, by the named model's template and tokenizer (loading
        the model if it is not: the count is its tokenizer's). A body over 64 KiB is
        decoded and its chat rendered in a worker thread (the tokenizer's own rule puts
        a long prompt in one too), as the generation endpoints do; a cancel waits for
        the thread, inside the lease. A Responses body that continues a stored response
        is counted with the stored conversation before it. ``limits`` gets the key's
        ``x-ratelimit-*`` headers."""
        from quart import request

        registry = state.serving_registry()
        body = await body_bytes()
        limits += admit_count()
        large = len(body) > INLINE_PARSE_BYTES
        stored = None
        if state.responses is not None and spec.peek_stored is not None:
            ask = await off_the_loop_if(large, spec.peek_stored, body)
            owner = key_salt(cast("Scope", request.scope), access)
            stored = await state.responses.context(ask.previous_response_id, owner)
        model, conversation = await off_the_loop_if(large, counter(spec, stored), body)
        async with registry.lease(state.resolve(model)) as lease:
            engine = lease.engine
            generation, _ = await off_the_loop_if(
                large, generation_for, conversation, state.chat_format(engine)
            )
            assert isinstance(generation.prompt, str)
            if generation.images:
                # images count as the tokens they take (docs/vision.md): laid out as for
                # generation, their URLs fetched under the same rules (a model that
                # cannot see images refuses them in prepare, before any fetch). As for
                # generation, a queue place is held first: a full server refuses (429)
                # before any fetch or decode, and at most slots + --max-queue requests
                # fetch and decode images at once
                images = generation.images
                media = engine.backend.info.vision or engine.backend.info.audio
                reservation = engine.admission.reserve() if media else None
                try:
                    if reservation is not None:
                        images = await resolve_images(images, state.settings.media)
                    asked = dataclasses.replace(
                        generation, images=images, max_tokens=1, clamp_max_tokens=True
                    )
                    return len((await engine.backend.prepare(asked)).tokens)
                finally:
                    if reservation is not None:
                        reservation.release()
            return await engine.backend.count_text_tokens(
                generation.prompt, add_special=generation.add_bos, parse_special=True
            )

    def counter(
        spec: DialectSpec, stored: StoredContext | None
    ) -> Callable[[bytes], tuple[str | None, Conversation]]:
        """``spec``'s token-counting decoder, with this server's limits."""
        count = spec.count
        assert count is not None
        keep_billing_header = state.settings.keep_billing_header

        def read(body: bytes) -> tuple[str | None, Conversation]:
            options = ReadOptions(
                limits=state.settings.request_limits,
                model_name=lambda requested: state.resolve(requested).name,
                keep_billing_header=keep_billing_header,
                stored=stored,
            )
            return count(body, options)

        return read

    async def counted(spec: DialectSpec, answer: Callable[[int], dict[str, object]]) -> Response:
        """A token count's answer, or its error in ``spec``'s dialect; the key's
        ``x-ratelimit-*`` headers on either, once its limits were taken."""
        limits: list[tuple[bytes, bytes]] = []
        try:
            tokens = await count(spec, limits)
        except TrioserveError as exc:
            response = error_response(exc, renderer(spec))
        else:
            response = json_response(answer(tokens))
        for name, value in limits:
            response.headers[name.decode()] = value.decode()
        return response

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        return await counted(MESSAGES, lambda tokens: {"input_tokens": tokens})

    @app.post("/v1/responses/input_tokens")
    async def input_tokens() -> Response:
        return await counted(
            RESPONSES, lambda tokens: {"object": "response.input_tokens", "input_tokens": tokens}
        )
