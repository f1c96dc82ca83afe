"""Access control, as one ASGI layer in front of everything: API keys, admin keys and
CORS.

With keys configured — or a keys file given, even one that holds none: access never
falls open — every path needs ``Authorization: Bearer <key>`` (or ``x-api-key``; 401
otherwise) except the few open ones: ``/health`` (its details need a key: the route
says only the status without one) and the page. Default-deny: a route added later is
keyed unless it is listed open here. What changes a model's lifetime for everyone —
``POST /models/load``, ``POST /models/unload`` and a request's ``X-Keep-Alive`` header
— needs an *admin* key then (403 otherwise: refused, never silently ignored); an admin
key is a valid API key too. With no key configured and no keys file (one local user),
anyone may. Keys are compared in constant time, always over all keys, and never
logged. Ollama's ``/api/create``, ``/api/copy``, ``/api/delete`` and
``/api/blobs/:digest`` (what changes the models served) are an admin's too, and so is
``keep_alive`` in an Ollama body (its route checks it). CORS (off by default) answers
preflight ``OPTIONS`` for the configured origins.
The table of every route and its rule: ``docs/operations.md``, "Who may call what".
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from .._core._exceptions import AuthenticationError, PermissionDeniedError
from ._accounts import KeysFile
from ._errors import render_for_path

__all__ = [
    "ADMIN_PATHS",
    "OPEN_PATHS",
    "AccessPolicy",
    "check_keep_alive_key",
    "key_salt",
    "presented_key",
    "with_access_control",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]

#: the paths open to anyone, with keys configured too (``/health`` says only its status
#: without a valid key); every other path needs a key
OPEN_PATHS = frozenset({"/", "/health", "/openapi.json"})
#: paths that change a model's lifetime for every client, or the models served (Ollama's
#: create, copy, delete and blob uploads; LoRA adapters loaded, unloaded, rescaled at run
#: time from a path on the server): an admin key's (not for GET)
ADMIN_PATHS = frozenset(
    {
        "/models/load",
        "/models/unload",
        "/api/create",
        "/api/copy",
        "/api/delete",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/lora-adapters",
    }
)
#: paths under which every route is an admin's (not for GET): Ollama's blobs
ADMIN_PREFIXES = ("/api/blobs/",)


class AccessPolicy:
    """Which API keys are valid and which origins may call from a browser."""

    def __init__(
        self,
        api_keys: Iterable[str] = (),
        cors_origins: Iterable[str] = (),
        admin_keys: Iterable[str] = (),
        *,
        keys_file: KeysFile | None = None,
    ) -> None:
        self._given_admin = [hashlib.sha256(key.encode()).digest() for key in admin_keys if key]
        self._given = [hashlib.sha256(key.encode()).digest() for key in api_keys if key]
        self.cors_origins = frozenset(cors_origins)
        #: a keys file is in force: keys are required whatever it holds, none included
        self._closed = keys_file is not None
        self.use(keys_file or KeysFile())

    def use(self, keys_file: KeysFile) -> None:
        """The keys of ``keys_file`` are valid from now on, with the ones given at
        start (a reload: a key removed from the file is refused at once)."""
        self._admin_digests = [*self._given_admin, *keys_file.admin_keys]
        # an admin key is an API key too
        self._digests = [*self._given, *keys_file.keys, *self._admin_digests]

    @property
    def requires_key(self) -> bool:
        """Whether requests need a key: some key is configured, or a keys file is in
        force (one that holds no key lets no request in, never every request)."""
        return self._closed or bool(self._digests)

    @property
    def key_count(self) -> int:
        """How many distinct keys are valid now."""
        return len(set(self._digests))

    def reload_refusal(self, keys_file: KeysFile, *, allow_empty: bool = False) -> str | None:
        """Why a reload to ``keys_file`` must not happen (``None``: it may): it would
        leave no usable key where there are keys now — what an editor leaves for a
        moment while it saves — unless the operator allows it (then every keyed route
        answers 401: still never open)."""
        after = len({*self._given, *self._given_admin, *keys_file.keys})
        if after or not self._digests or allow_empty:
            return None
        return (
            f"it holds no key, and {self.key_count} key(s) are in force: every request would be "
            "refused (an empty or [defaults]-only file, as an editor leaves it while saving?); to "
            "remove every key, run the server with --allow-empty-keys-reload"
        )

    def key_is_valid(self, presented: str) -> bool:
        return _matches(presented, self._digests)

    def key_is_admin(self, presented: str) -> bool:
        return _matches(presented, self._admin_digests)

    def rule(self, path: str, method: str) -> str:
        """The rule for a request to ``path``: ``open``, ``key`` or ``admin`` (an
        admin's action: the lifetime of a model). Default-deny: a path not listed open
        needs a key."""
        path = path.rstrip("/") or "/"
        if path in OPEN_PATHS:
            return "open"
        if (path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)) and method != "GET":
            return "admin"
        return "key"

    def check(self, scope: Scope) -> None:
        """Raise :class:`AuthenticationError` (401) unless the request may proceed, and
        :class:`PermissionDeniedError` (403) for an admin's action without an admin key."""
        if not self.requires_key:
            return
        rule = self.rule(scope["path"], scope["method"])
        if rule == "open":
            return
        presented = self._presented_key(scope)
        if rule == "admin" and not self.key_is_admin(presented):
            path = scope["path"].rstrip("/")
            raise PermissionDeniedError(
                f"{path} changes which models are served or stay loaded for every client: it needs an "
                "admin key (--admin-key, or admin = true in the keys file)"
            )
        if _header(scope, b"x-keep-alive") is not None and not self.key_is_admin(presented):
            raise PermissionDeniedError(
                "X-Keep-Alive sets how long the model stays loaded for every client: it needs an admin "
                "key (--admin-key); send the request without it",
                param="X-Keep-Alive",
            )

    def _presented_key(self, scope: Scope) -> str:
        """The request's valid API key; :class:`AuthenticationError` if it has none."""
        authorization = _header(scope, b"authorization")
        if authorization is None:
            # Anthropic's clients send the key as x-api-key
            api_key = _header(scope, b"x-api-key")
            if api_key is None:
                raise AuthenticationError(
                    "no API key: send it as 'Authorization: Bearer <key>' (in the openai SDK: api_key=...) "
                    "or as 'x-api-key: <key>' (the anthropic SDK's api_key)"
                )
            presented = api_key.strip()
        else:
            scheme, _, bearer = authorization.partition(" ")
            if scheme.lower() != "bearer":
                raise AuthenticationError("the API key is not valid for this server")
            presented = bearer.strip()
        if not self.key_is_valid(presented):
            raise AuthenticationError("the API key is not valid for this server")
        return presented

    def allowed_origin(self, scope: Scope) -> str | None:
        """The value for ``Access-Control-Allow-Origin``, if this request gets one."""
        if not self.cors_origins:
            return None
        origin = _header(scope, b"origin")
        if origin is None:
            return None
        if "*" in self.cors_origins:
            return "*"
        return origin if origin in self.cors_origins else None


def _matches(presented: str, digests: list[bytes]) -> bool:
    digest = hashlib.sha256(presented.encode()).digest()
    valid = False
    for known in digests:  # no early exit: the time does not depend on which
        valid |= hmac.compare_digest(digest, known)
    return valid


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def with_access_control(app: ASGIApp, policy: AccessPolicy) -> ASGIApp:
    """Wrap ``app`` so every HTTP request passes ``policy`` first. (Its own answers —
    401, 403, a CORS preflight's 204 — go out through the ``send`` it is given:
    ``create_app`` shields that one on HTTP/1.x, ``_lifecycle.completing``.)"""

    async def guarded(
        scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        origin = policy.allowed_origin(scope)
        cors_headers: list[tuple[bytes, bytes]] = []
        if origin is not None:
            cors_headers = [
                (b"access-control-allow-origin", origin.encode()),
                (b"access-control-expose-headers", b"x-request-id, retry-after, x-conversation-id"),
                (b"vary", b"origin"),
            ]
            if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
                await _respond(
                    send,
                    204,
                    b"",
                    [
                        *cors_headers,
                        (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                        (
                            b"access-control-allow-headers",
                            b"authorization, content-type, x-request-timeout, x-request-id, x-api-key, "
                            b"anthropic-version, anthropic-beta, x-session-id, x-conversation-id, "
                            b"last-event-id",
                        ),
                        (b"access-control-max-age", b"600"),
                    ],
                )
                return
        try:
            policy.check(scope)
        except (AuthenticationError, PermissionDeniedError) as exc:
            status, headers, body = render_for_path(exc, scope["path"])
            await _respond(send, status, body, [*headers, *cors_headers])
            return
        if not cors_headers:
            await app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors_headers]}
            await send(message)

        await app(scope, receive, send_with_cors)

    return guarded


async def _respond(
    send: Callable[[Message], Awaitable[None]], status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def presented_key(scope: Scope) -> str | None:
    """The API key a request presents, read as the access layer reads it
    (``Authorization: Bearer``, else ``x-api-key``); ``None``: none."""
    authorization = _header(scope, b"authorization")
    if authorization is not None:
        scheme, _, key = authorization.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None
    api_key = _header(scope, b"x-api-key")
    return api_key.strip() if api_key is not None else None


def check_keep_alive_key(scope: Scope, access: AccessPolicy | None) -> None:
    """Raise :class:`PermissionDeniedError` (403) for a body's ``keep_alive`` without an
    admin key where keys are required: like ``X-Keep-Alive`` (:meth:`AccessPolicy.check`),
    it sets how long the model stays loaded for every client."""
    if access is not None and access.requires_key and not access.key_is_admin(presented_key(scope) or ""):
        raise PermissionDeniedError(
            "keep_alive sets how long the model stays loaded for every client: it needs an admin "
            "key (--admin-key); send the request without it",
            param="keep_alive",
        )


def key_salt(scope: Scope, access: AccessPolicy | None) -> str:
    """One per API key (``"key:…"``, a hash: the key itself is never kept) where keys
    are required, else ``""``: whose cache a request shares, and whose stored
    responses it may read."""
    if access is None or not access.requires_key:
        return ""
    key = presented_key(scope) or ""  # (checked already: the access layer let it in)
    digest = hashlib.sha256(b"trioserve cache salt\0" + key.encode()).hexdigest()
    return "key:" + digest[:32]
