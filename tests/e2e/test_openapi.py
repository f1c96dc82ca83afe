"""``GET /openapi.json``: the API's OpenAPI 3.1 document, generated from the structs the
server decodes with; every route of the app in it and nothing else; security where keys
are in force. And two HTTP/1.1 connection rules its fuzz run (test_openapi_fuzz.py)
found broken: a keep-alive connection whose body the server did not read is answered
or closed, never left hanging (the access layer's own answers too: sent shielded); an idle
keep-alive connection is closed after hypercorn's keep-alive timeout. ``/health``'s and
``/loads``' 503s are in the shapes the document gives them."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
import trio

from trioserve._http._access import AccessPolicy
from trioserve._http._openapi import OPERATIONS, openapi_document
from trioserve._http._routes import _create_quart_app, create_app, served_routes
from trioserve._http._state import ServerState
from trioserve._wire._openai import ChatCompletionRequest

from .._helpers import ServerProcess


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ServerProcess("--scripted", "--scripted-interval", "0") as server:
        yield server.wait_ready()
        assert server.stop() == 0


def _document(url: str, **headers: str) -> dict[str, object]:
    answer = httpx.get(f"{url}/openapi.json", headers=headers)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    document: dict[str, object] = answer.json()
    return document


def test_the_document_lists_every_route_of_the_app_and_nothing_else(url: str) -> None:
    document = _document(url)
    assert document["openapi"] == "3.1.0"
    paths = document["paths"]
    assert isinstance(paths, dict)
    documented = {(method.upper(), path) for path, item in paths.items() for method in item}
    app = _create_quart_app(ServerState())
    assert documented == served_routes(app) == set(OPERATIONS)
    # every dialect's generation route, with its streaming media type
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/infill"):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path


def test_request_schemas_are_the_decoders_structs(url: str) -> None:
    document = _document(url)
    schemas = document["components"]["schemas"]  # type: ignore[index]
    fields = msgspec.structs.fields(ChatCompletionRequest)
    schema = schemas["ChatCompletionRequest"]
    assert set(schema["properties"]) == {field.encode_name for field in fields}
    assert schema["required"] == ["messages"]
    assert schema["properties"]["n"] == {"type": "integer", "minimum": 1, "maximum": 16, "default": 1}
    chat = document["paths"]["/v1/chat/completions"]["post"]  # type: ignore[index]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    # errors: OpenAI's body, Anthropic's on its routes
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    messages = document["paths"]["/v1/messages"]["post"]  # type: ignore[index]
    assert messages["responses"]["529"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicError"
    )
    # the document is valid JSON Schema where it holds schemas (3.1: JSON Schema 2020-12)
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_a_route_without_an_entry_and_an_entry_without_a_route_are_refused() -> None:
    routes = set(OPERATIONS)
    with pytest.raises(LookupError, match="not described"):
        openapi_document({*routes, ("GET", "/v1/new")}, keys=False)
    with pytest.raises(LookupError, match="not served"):
        openapi_document(routes - {("GET", "/health")}, keys=False)


def test_with_keys_the_keyed_routes_need_a_bearer_key() -> None:
    with ServerProcess("--scripted", "--api-key", "sekrit") as server:
        url = server.wait_ready()
        document = _document(url)  # open, like /health
        schemes = document["components"]["securitySchemes"]  # type: ignore[index]
        assert schemes["bearer"] == {"type": "http", "scheme": "bearer", "description": "an API key"}
        paths = document["paths"]
        chat = paths["/v1/chat/completions"]["post"]  # type: ignore[index]
        assert chat["security"] == [{"bearer": []}, {"apiKey": []}]
        assert {"401", "403"} <= set(chat["responses"])
        assert paths["/health"]["get"]["security"] == []  # type: ignore[index]
        # what the document says is what the server does
        assert httpx.post(f"{url}/v1/chat/completions", json={}).status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        assert server.stop() == 0


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_keep_alive_connection_with_an_unread_body_is_never_left_hanging(url: str) -> None:
    """The server answers 405 before the body has come; the client then sends the body
    and its next request on the same connection. hypercorn must close the connection
    (it cannot know where the next request starts) or answer it: on main it sometimes
    did neither (its close was cancelled with quart-trio's request task), so the
    client waited forever."""
    outcomes = []
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=3) as sock:
            body = b'{"model": null}'
            head = "PUT /models/load HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
            answer = b""
            while b"method_not_allowed" not in answer:
                answer += sock.recv(65536)
            sock.sendall(body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = b""
            try:
                while b'"status"' not in rest:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                outcomes.append("answered" if b'"status"' in rest else "closed")
            except TimeoutError:
                outcomes.append("hung")
    assert "hung" not in outcomes, outcomes


def test_the_access_layers_answer_leaves_no_keep_alive_connection_hanging() -> None:
    """The same rule for the access layer's own answers (sent before the app, and its
    body never read): a POST without a key gets 401 before its body is sent; the client
    then sends the body and its next request on the same connection, which is answered
    or closed, never left hanging."""
    with ServerProcess("--scripted", "--scripted-interval", "0", "--api-key", "sekrit") as server:
        port = _port(server.wait_ready())
        outcomes = []
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
                body = b'{"prompt": "x", "max_tokens": 1}'
                head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
                answer = b""
                while b"invalid_api_key" not in answer:
                    answer += sock.recv(65536)
                assert answer.startswith(b"HTTP/1.1 401"), answer
                sock.sendall(body + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                rest = b""
                try:
                    while b'"status"' not in rest:
                        chunk = sock.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                    outcomes.append("answered" if b'"status"' in rest else "closed")
                except TimeoutError:
                    outcomes.append("hung")
        assert "hung" not in outcomes, outcomes
        assert server.stop() == 0


async def _get(app: Callable[..., Awaitable[None]], path: str) -> tuple[int, bytes]:
    """``GET path`` of the ASGI ``app``, in this process: its status and body."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"host", b"t")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }  # fmt: skip
    asked = False
    ended = trio.Event()
    status = 0
    body = b""

    async def receive() -> dict[str, object]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, body
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body += message.get("body", b"")
            if not message.get("more_body", False):
                ended.set()

    await app(scope, receive, send)
    return status, body


@pytest.mark.parametrize(
    ("method", "headers", "status"),
    [
        ("POST", [], 401),
        ("POST", [(b"authorization", b"Bearer sekrit"), (b"x-keep-alive", b"-1")], 403),
        ("OPTIONS", [(b"origin", b"https://a.example"), (b"access-control-request-method", b"POST")], 204),
    ],
)
async def test_the_access_layers_own_answers_are_sent_shielded(
    method: str, headers: list[tuple[bytes, bytes]], status: int
) -> None:
    """The access layer's 401, 403 and CORS preflight 204 are sent as every other
    HTTP/1.x answer is (``_lifecycle.completing``): shielded, so a cancel that comes
    while they go out — what quart-trio's or a watcher's reaction to hypercorn's
    ``http.disconnect`` at the end of a response is — cannot cut the send hypercorn
    closes the connection or restarts its keep-alive timer in. Here the task is
    cancelled before the answer starts: every message still goes out whole."""
    access = AccessPolicy(["sekrit"], cors_origins=["https://a.example"])
    app = create_app(ServerState(), access)
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"host", b"t"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, object]:
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        await trio.lowlevel.checkpoint()  # (hypercorn's send: a write, an event)
        sent.append(message)

    with trio.CancelScope() as cancel:
        cancel.cancel()
        await app(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == status
    assert sent[1].get("more_body", False) is False


def _conforms(document: dict[str, Any], method: str, path: str, status: int, body: object) -> None:
    """``body`` is valid under the schema ``document`` gives ``path``'s answer with
    ``status`` (its ``$ref``s resolved in the document's components)."""
    answers = document["paths"][path][method.lower()]["responses"]
    schema = answers[str(status)]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(body)


async def test_health_and_loads_answer_503_in_the_shape_the_document_gives(url: str) -> None:
    """While not serving (here: no model yet), ``/health`` answers 503 with its own
    shape (the status, and why) and ``/loads`` with ``{"error": "not serving"}``: the
    document gives those 503s those shapes, not the error body of the other routes;
    their 200s conform too."""
    app = create_app(ServerState())
    status, answer = await _get(app, "/openapi.json")
    assert status == 200
    document = json.loads(answer)
    for path in ("/health", "/loads", "/v1/loads"):
        status, answer = await _get(app, path)
        assert status == 503, answer
        _conforms(document, "GET", path, 503, json.loads(answer))
    # a 503 of /loads may also be the error body (a model named while the unnamed one loads)
    error = {"error": {"message": "the model is still loading", "type": "x", "param": None, "code": None}}
    _conforms(document, "GET", "/loads", 503, error)
    with pytest.raises(jsonschema.ValidationError):
        _conforms(document, "GET", "/health", 503, error)
    async with httpx.AsyncClient(base_url=url) as client:
        for path in ("/health", "/loads"):
            answer = await client.get(path)
            assert answer.status_code == 200, answer.text
            _conforms(document, "GET", path, 200, answer.json())


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(url: str) -> None:
    """hypercorn restarts its keep-alive timer as a response ends; on main the restart
    was cancelled with quart-trio's request task, and an idle connection stayed open
    for as long as the client kept it (one socket each, without bound)."""
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b'"status"' not in answer:
            answer += sock.recv(65536)
        answered = time.monotonic()
        while sock.recv(65536):  # until the server closes it (10 s: the test fails)
            pass
        assert time.monotonic() - answered < 8.0  # hypercorn's keep_alive_timeout: 5 s
