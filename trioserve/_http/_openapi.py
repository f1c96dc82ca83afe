"""The API describing itself: the OpenAPI 3.1 document served at ``GET /openapi.json``
(docs/api.md, "The API's description").

It is generated, never written by hand: :data:`OPERATIONS` says, for each route, which
struct its decoder reads the body with (the same ``msgspec`` structs the server
decodes requests with), which type its answer has (:mod:`trioserve._wire._shapes`), the
statuses it answers with and whether it streams; the schemas come from
``msgspec.json.schema_components``. :func:`openapi_document` walks the routes the app
serves and looks each one up here: a route with no entry (or an entry with no route)
is an error when the app is made, so a new route cannot go undescribed."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import msgspec

from .._core._exceptions import TrioserveError
from .._wire import _shapes as shapes
from ._access import AccessPolicy
from ._openapi_operations import JSON, NDJSON, OPERATIONS, Operation, Param

__all__ = ["OPERATIONS", "Operation", "Param", "needs_key", "openapi_document", "openapi_path"]

#: why each error status is answered (the responses' descriptions)
_REASONS = {
    400: "the request is not valid (the message names the field)",
    401: "no API key, or not a valid one",
    403: "the key may not do this (an admin's action, or a priority beyond its own)",
    404: "no such model, route or object (for this key)",
    405: "the route does not take this method",
    408: "the body did not all arrive in time",
    409: "a request with this id is in flight, or the model is busy loading or unloading",
    413: "the body is too large",
    415: "the body is not JSON",
    429: "the queue is full, or the key's rate limit is spent (Retry-After)",
    431: "the headers are too large",
    501: "the backend cannot do this (e.g. no embeddings; Ollama's pull: no registry is reachable)",
    503: "the server is loading or shutting down, or the model failed to load (Retry-After); on "
    "Ollama's routes, also a full queue (Ollama's status for it)",
    504: "the request's deadline passed",
    529: "the queue is full (Anthropic's status for it)",
}
_SPACES = re.compile(r"<(?:[a-z]+:)?([A-Za-z_]+)>")


def openapi_path(rule: str) -> str:
    """A werkzeug rule (``/v1/models/<path:model_id>``) as an OpenAPI path
    (``/v1/models/{model_id}``)."""
    return _SPACES.sub(r"{\1}", rule)


def needs_key(access: AccessPolicy, path: str) -> bool:
    """Whether the access policy wants an API key at ``path`` (an OpenAPI path: each
    ``{parameter}`` stands for any value)."""
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": re.sub(r"{[^}]*}", "x", path),
        "headers": [],
    }
    try:
        access.check(scope)
    except TrioserveError:
        return True
    return False


def _schema_hook(t: type) -> dict[str, Any]:
    if t is object:
        return {"description": "any JSON value"}
    raise NotImplementedError


def openapi_document(routes: Iterable[tuple[str, str]], *, keys: bool, keyed: Iterable[str] = ()) -> bytes:
    """The document for the app's ``routes`` (``(method, OpenAPI path)``), as JSON.
    ``keys``: the server requires API keys (then the paths in ``keyed`` need one: a
    bearer key, 401 without). Raises :class:`LookupError` for a route with no entry in
    :data:`OPERATIONS`, or an entry with no route."""
    served = sorted(set(routes))
    missing = [route for route in served if route not in OPERATIONS]
    if missing:
        raise LookupError(
            f"routes not described in trioserve/_http/_openapi_operations.py OPERATIONS: {missing}"
        )
    extra = sorted(set(OPERATIONS) - set(served))
    if extra:
        raise LookupError(
            f"OPERATIONS in trioserve/_http/_openapi_operations.py describe routes not served: {extra}"
        )
    keyed = frozenset(keyed)
    types: list[object] = [shapes.OpenAIError, shapes.AnthropicError, shapes.OllamaError]
    for operation in OPERATIONS.values():
        types += [t for t in (operation.body, operation.answer) if t is not None]
        types += [t for _, answers in operation.error_answers for t in answers]
    refs, components = msgspec.json.schema_components(
        types, schema_hook=_schema_hook, ref_template="#/components/schemas/{name}"
    )
    schema_of = dict(zip(map(id, types), refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served:
        operation = OPERATIONS[method, path]
        item = paths.setdefault(path, {})
        item[method.lower()] = _operation(method, path, operation, schema_of, keys=keys and path in keyed)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "trioserve",
            "version": _version(),
            "description": "A streaming LLM inference server on Trio: OpenAI's, Anthropic's, Ollama's and "
            "llama-server's APIs (docs/api.md). Generated from the structs the server decodes with.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
    if keys:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "an API key"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "an API key"},
        }
    return msgspec.json.encode(document)


def _operation(
    method: str, path: str, operation: Operation, schema_of: dict[int, Any], *, keys: bool
) -> dict[str, Any]:
    shape = shapes.AnthropicError if operation.anthropic else shapes.OpenAIError
    error = schema_of[id(shapes.OllamaError if operation.ollama else shape)]
    ok: dict[str, Any] = {}
    if operation.answer is not None:
        ok[operation.media] = {"schema": schema_of[id(operation.answer)]}
    else:
        ok[operation.media] = {"schema": {"type": "string"}}
    if operation.stream:
        ok[operation.stream_media] = {"schema": {"type": "string"}}
    if operation.ndjson:
        ok[NDJSON] = {"schema": {"type": "string"}}
    success: dict[str, Any] = {"description": "success"}
    if operation.media:  # (a 204 has no content)
        success["content"] = ok
    responses: dict[str, Any] = {str(operation.status): success}
    if operation.links:
        responses[str(operation.status)]["links"] = {
            _operation_id(method, path): {
                "operationId": _operation_id(method, path),
                "parameters": {name: "$response.body#/id"},
            }
            for method, path, name in operation.links
        }
    errors = set(operation.errors)
    if keys:
        errors |= {401, 403}
    shaped = dict(operation.error_answers)
    for status in sorted(errors):
        schema = error
        if status in shaped:
            refs = [schema_of[id(t)] for t in shaped[status]]
            schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
        responses[str(status)] = {"description": _REASONS[status], "content": {JSON: {"schema": schema}}}
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{([A-Za-z_]+)}", path)
    ]
    parameters += [
        {
            "name": p.name,
            "in": p.where,
            "required": False,
            "schema": dict(p.schema),
            "description": p.description,
        }
        for p in operation.params
    ]
    body: dict[str, Any] = {
        "operationId": _operation_id(method, path),
        "summary": operation.summary,
        "tags": [operation.tag],
        "responses": responses,
    }
    if parameters:
        body["parameters"] = parameters
    if operation.body is not None:
        body["requestBody"] = {"required": True, "content": {JSON: {"schema": schema_of[id(operation.body)]}}}
    body["security"] = [{"bearer": []}, {"apiKey": []}] if keys else []
    return body


def _operation_id(method: str, path: str) -> str:
    """``post_v1_chat_completions``, ``get_v1_responses_response_id``."""
    return f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path).rstrip('_')}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trioserve")
    except PackageNotFoundError:
        return "0"
