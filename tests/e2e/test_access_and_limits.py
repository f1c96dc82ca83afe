"""API keys, CORS and the server's limits, over a real socket (scripted backend)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from trioserve import HTTPSettings, ScriptedBackend
from trioserve._wire import _shapes as shapes

from .._helpers import RawStream, RunningServer, start_server, wait_for

KEYS = ("sk-first-5b0f3c9e", "sk-second-77d1aa02")
#: valid for every endpoint (each ignores the others' fields)
#: a valid body for each keyed POST path (each endpoint refuses the others' fields)
BODIES: dict[str, dict[str, object]] = {
    "/v1/completions": {"prompt": "x"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
    "/tokenize": {"content": "x"},
    "/detokenize": {"tokens": [120]},
}


@pytest.fixture
async def keyed(nursery: trio.Nursery) -> RunningServer:
    backend = ScriptedBackend([b"ok"], slots=1)
    return await start_server(nursery, backend, close_backend=True, api_keys=KEYS)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/scripted"),
        ("GET", "/metrics"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ],
)
async def test_without_a_valid_key_the_api_answers_401(keyed: RunningServer, method: str, path: str) -> None:
    async with httpx.AsyncClient(base_url=keyed.url) as client:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEYS[0]}"}):
            response = await client.request(method, path, json=BODIES.get(path), headers=headers)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            error = response.json()["error"]
            assert error["type"] == "authentication_error"
            assert error["code"] == "invalid_api_key"
            assert KEYS[0] not in response.text
        for key in KEYS:
            response = await client.request(
                method, path, json=BODIES.get(path), headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200


async def test_health_and_the_page_stay_open(keyed: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=keyed.url) as client:
        assert (await client.get("/health")).status_code == 200
        page = await client.get("/")
        assert page.status_code == 200
        assert "<title>trioserve</title>" in page.text


async def test_keys_never_reach_the_logs(keyed: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient(base_url=keyed.url) as client:
        await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEYS[1]}"}
        )
        await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-guess"}
        )
        await client.post("/v1/completions", json={"prompt": KEYS[0]})  # even as a prompt: no key, 401
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert "request " in text  # the request lines are there
    for secret in (*KEYS, "sk-guess"):
        assert secret not in text


def test_the_openai_sdk_with_and_without_a_key() -> None:
    async def run() -> None:
        async with trio.open_nursery() as nursery:
            server = await start_server(nursery, ScriptedBackend([b"hi"]), close_backend=True, api_keys=KEYS)

            def call(key: str) -> str:
                with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as sdk:
                    return sdk.completions.create(model="scripted", prompt="x").choices[0].text

            assert await trio.to_thread.run_sync(call, KEYS[0]) == "hi"
            with pytest.raises(openai.AuthenticationError):
                await trio.to_thread.run_sync(call, "sk-nope")
            server.server.shutdown()

    trio.run(run)


async def test_cors_is_off_by_default_and_answers_allowed_origins(nursery: trio.Nursery) -> None:
    closed = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True)
    opened = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, cors_origins=("https://app.example",)
    )
    origin = {"Origin": "https://app.example"}
    preflight = {
        **origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    async with httpx.AsyncClient() as client:
        response = await client.post(closed.url + "/v1/completions", json={"prompt": "x"}, headers=origin)
        assert "access-control-allow-origin" not in response.headers
        answer = await client.options(opened.url + "/v1/completions", headers=preflight)
        assert answer.status_code == 204
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert "x-request-timeout" in answer.headers["access-control-allow-headers"]
        # a page on another origin can opt in to resumable streams, resume and stop them
        # (docs/resumable-streams.md)
        assert "DELETE" in answer.headers["access-control-allow-methods"]
        for header in ("x-conversation-id", "last-event-id", "x-session-id"):
            assert header in answer.headers["access-control-allow-headers"]
        assert "x-conversation-id" in answer.headers["access-control-expose-headers"]
        response = await client.post(opened.url + "/v1/completions", json={"prompt": "x"}, headers=origin)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = await client.post(
            opened.url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers


async def test_server_limits_on_prompt_tokens_max_tokens_and_headers(nursery: trio.Nursery) -> None:
    server = await start_server(
        nursery,
        ScriptedBackend([b"ok"]),
        close_backend=True,
        http=HTTPSettings(max_prompt_tokens=10, max_tokens_limit=50, max_header_bytes=4096),
    )
    async with server.client() as client:
        long = await client.post("/v1/completions", json={"prompt": "x" * 11})
        assert long.status_code == 400
        assert long.json()["error"]["message"] == "the prompt has 11 tokens; this server accepts at most 10"
        assert long.json()["error"]["code"] == "context_length_exceeded"
        many = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 51})
        assert many.status_code == 400
        assert "max_tokens may be at most 50" in many.json()["error"]["message"]
        assert (
            await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        ).status_code == 200
        huge = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Padding": "p" * 8000})
        assert huge.status_code == 431
        assert huge.json()["error"]["code"] == "headers_too_large"


@pytest.mark.parametrize("stream", [True, False])
async def test_http_1_0_and_connection_close_get_their_connection_closed(
    nursery: trio.Nursery, stream: bool
) -> None:
    """Regression: the disconnect watcher used to cancel hypercorn's own end-of-response
    work (hypercorn reports the end as a disconnect from inside the last send), so an
    HTTP/1.0 client — which needs the close to know the stream ended — hung."""
    server = await start_server(nursery, ScriptedBackend([b"a", b"b"]), close_backend=True)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = b'{"prompt": "x", "max_tokens": 2, "stream": %s}' % (b"true" if stream else b"false")
    for head in (
        b"POST /v1/completions HTTP/1.0\r\n",
        b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\n",
    ):
        connection = await trio.open_tcp_stream(host, int(port))
        await connection.send_all(
            head
            + b"Host: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        received = b""
        with trio.fail_after(5):  # the server closes: EOF
            while chunk := await connection.receive_some(65536):
                received += chunk
        await connection.aclose()
        assert b" 200 " in received.split(b"\r\n", 1)[0]
        assert (b"data: [DONE]" in received) if stream else (b'"finish_reason":"stop"' in received)


async def test_a_431_on_a_generation_endpoint_is_logged_with_its_id(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.requests")
    server = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, http=HTTPSettings(max_header_bytes=4096)
    )
    async with server.client() as client:
        response = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "big-head", "X-Pad": "p" * 8000}
        )
    assert response.status_code == 431
    assert response.headers["x-request-id"] == "big-head"
    # the line is written once the handler returns, just after the client has its answer
    await wait_for(lambda: any("big-head" in r.getMessage() for r in caplog.records), limit=2)
    lines = [r.getMessage() for r in caplog.records if "big-head" in r.getMessage()]
    assert len(lines) == 1
    assert "status=431 cause=error" in lines[0]


async def _read_response(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response (``Content-Length`` or chunked): ``(head, body)``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lengths = [
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    complete: Callable[[bytes], bool] = (
        (lambda got: len(got) >= lengths[0]) if lengths else (lambda got: got.endswith(b"0\r\n\r\n"))
    )
    while not complete(body):
        chunk = await stream.receive_some(65536)
        assert chunk, body
        body += chunk
    if lengths:
        return head, body
    decoded = b""  # chunked: size line, data, CRLF, … up to the 0-size chunk
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, decoded
        decoded, body = decoded + body[:size], body[size + 2 :]


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/embeddings", "/tokenize", "/v1/messages/count_tokens"]
)
async def test_a_body_that_trickles_in_gets_408_and_holds_no_request_slot(
    nursery: trio.Nursery, path: str
) -> None:
    """A client sends its headers, then its body one byte at a time: once
    ``body_timeout`` has passed since the headers (however often a byte came), the
    answer is 408 ``request_timeout``; meanwhile it holds no request's place."""
    import json
    import socket

    backend = ScriptedBackend([b"ok"], slots=1)
    running = await start_server(nursery, backend, close_backend=True, http=HTTPSettings(body_timeout=0.5))
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    host, port = running.url.removeprefix("http://").split(":")
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 100000\r\n\r\n"
    )
    await stream.send_all(head.encode() + b'{"x": "')
    sent = trio.Event()

    async def trickle() -> None:
        try:
            for _ in range(10_000):
                await stream.send_all(b"y")
                sent.set()
                await trio.sleep(0.05)  # (the client's pace, not a wait for a phase)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the server closed the connection

    try:
        async with trio.open_nursery() as client:
            client.start_soon(trickle)
            await sent.wait()
            # receiving a body: no request in flight, no slot, nothing queued
            assert not running.server.state.requests
            assert running.engine.admission.snapshot().in_use == 0
            with trio.fail_after(10):
                status_line, body = await _read_response(stream)
            client.cancel_scope.cancel()
    finally:
        await stream.aclose()
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    error = json.loads(body)["error"]
    if not path.startswith("/v1/messages"):  # (Anthropic's error body has no code)
        assert error["code"] == "request_timeout"
    assert "0.5 s" in error["message"]
    await wait_for(lambda: not running.server.state.requests)
    running.server.shutdown()


ADMIN = "sk-admin-0c4e91d2"


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/models/load", {"model": "scripted"}, {}),
        ("/models/unload", {"model": "scripted"}, {}),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Keep-Alive": "-1"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, {"X-Keep-Alive": "0"}),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            {"X-Keep-Alive": "5m"},
        ),
    ],
)
async def test_only_an_admin_key_may_load_unload_or_send_x_keep_alive(
    nursery: trio.Nursery, path: str, body: dict[str, object], headers: dict[str, str]
) -> None:
    """#33: with keys configured, what changes a model's lifetime for every client needs
    an admin key (403 otherwise, never silently ignored); an admin key is an API key."""
    running = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, api_keys=KEYS, admin_keys=(ADMIN,)
    )
    async with httpx.AsyncClient(base_url=running.url) as client:
        refused = await client.post(
            path, json=body, headers={**headers, "Authorization": f"Bearer {KEYS[0]}"}
        )
        assert refused.status_code == 403, refused.text
        if path.startswith("/v1/messages"):
            assert refused.json()["error"]["type"] == "permission_error"
        else:
            assert refused.json()["error"]["code"] == "admin_key_required"
        assert "admin key" in refused.text
        assert (await client.post(path, json=body, headers=headers)).status_code == 401  # no key: 401 first
        if path != "/models/unload":  # (the single model refuses that: below)
            allowed = await client.post(
                path, json=body, headers={**headers, "Authorization": f"Bearer {ADMIN}"}
            )
            assert allowed.status_code == 200, allowed.text
        # an admin key is also an API key
        plain = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-api-key": ADMIN}
        )
        assert plain.status_code == 200


async def test_without_keys_anyone_may_send_x_keep_alive(nursery: trio.Nursery) -> None:
    running = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True)
    async with httpx.AsyncClient(base_url=running.url) as client:
        response = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Keep-Alive": "-1"}
        )
        assert response.status_code == 200


async def test_the_single_model_server_refuses_to_unload_its_model(nursery: trio.Nursery) -> None:
    """#33: ``POST /models/unload`` of the one pinned model would leave a server whose
    /health says ok with nothing to serve: refused (400 ``model_pinned``), naming why."""
    running = await start_server(nursery, ScriptedBackend([b"ok"]), close_backend=True)
    async with httpx.AsyncClient(base_url=running.url) as client:
        refused = await client.post("/models/unload", json={"model": "scripted"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("model_pinned", "model")
        assert "only model" in error["message"]
        assert (await client.get("/health")).json()["status"] == "ok"
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 200


#: the table of docs/operations.md, "Who may call what": one row per route
_TABLE_ROW = re.compile(r"^\| `(GET|POST|DELETE) (/[^`]*)` \| (open|key|admin) \|")
#: a route's parameters, as the docs and werkzeug write them, and a value for each
_PARAMETER = re.compile(r"<(?:[a-z]+:)?([a-z_]+)>|\{([a-z_]+)\}")
_VALUES = {"model_id": "scripted", "request_id": "nope", "response_id": "resp_nope", "digest": "nope"}


def _access_table() -> dict[tuple[str, str], str]:
    text = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = text.split("### Who may call what", 1)[1].split("\n#", 1)[0]
    table: dict[tuple[str, str], str] = {}
    for line in section.splitlines():
        if match := _TABLE_ROW.match(line):
            method, path, rule = match.groups()
            assert (method, path) not in table, f"{method} {path}: two rows"
            table[method, path] = rule
    assert len(table) > 20, "the table of docs/operations.md was not found"
    return table


def _app_routes(server: RunningServer) -> set[tuple[str, str]]:
    """Every route the server answers: the Quart app's (its url_map) and the ones served
    at the ASGI level, before it (generation, embeddings, rerank, Ollama's embed and
    blobs, the stream reader)."""
    from trioserve._http._embeddings import EMBEDDINGS_PATH
    from trioserve._http._generation import GENERATION_PATHS
    from trioserve._http._ollama_asgi import OLLAMA_ASGI_PATHS
    from trioserve._http._replay import STREAM_PATH
    from trioserve._http._rerank import RERANK_PATHS
    from trioserve._http._routes import _create_quart_app
    from trioserve._http._speech import SPEECH_PATH
    from trioserve._http._transcriptions import TRANSCRIPTIONS_PATH

    quart = _create_quart_app(server.server.state, server.server.access)
    routes = {
        (method, _PARAMETER.sub(lambda m: "{" + (m[1] or m[2]) + "}", rule.rule))
        for rule in quart.url_map.iter_rules()
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")  # (they follow their route's rule)
    }
    asgi = {
        ("POST", path)
        for path in (
            *GENERATION_PATHS,
            EMBEDDINGS_PATH,
            *RERANK_PATHS,
            *OLLAMA_ASGI_PATHS,
            TRANSCRIPTIONS_PATH,
            SPEECH_PATH,
        )
    }
    return routes | asgi | {("GET", STREAM_PATH)}


async def test_every_route_is_in_the_access_table_and_its_rule_holds(nursery: trio.Nursery) -> None:
    """Issue 47: admin-only and key-only routes in ONE table (docs/operations.md, "Who
    may call what"). Every route of the app has its row and no row lacks a route; each
    rule is enforced over a real socket: open (no 401/403 without a key), key (401
    without a key or with a wrong one, served with any key), admin (401 without a key,
    403 with a plain key, served with an admin key)."""
    running = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, api_keys=KEYS, admin_keys=(ADMIN,)
    )
    table = _access_table()
    routes = _app_routes(running)
    assert routes - table.keys() == set(), "routes missing from the table of docs/operations.md"
    assert table.keys() - routes == set(), "rows of docs/operations.md without a route"
    access = running.server.access
    plain, admin = {"Authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": ADMIN}
    async with httpx.AsyncClient(base_url=running.url) as client:
        for (method, route), rule in sorted(table.items()):
            path = _PARAMETER.sub(lambda m: _VALUES[m[1] or m[2]], route)
            assert access.rule(path, method) == rule, (method, route)

            async def status(headers: dict[str, str], method: str = method, path: str = path) -> int:
                body: dict[str, object] | None = {} if method == "POST" else None
                return (await client.request(method, path, json=body, headers=headers)).status_code

            where = f"{method} {route} ({rule})"
            if rule == "open":
                assert await status({}) not in (401, 403), where
                continue
            assert await status({}) == 401, where
            assert await status({"Authorization": "Bearer sk-wrong"}) == 401, where
            assert await status(admin) not in (401, 403), where
            # a valid key is served (a 400 for an empty body, a 404 for an id not there)
            with_plain = await status(plain)
            assert (with_plain == 403) if rule == "admin" else (with_plain not in (401, 403)), where
        # default-deny: a path that is no route needs a key too
        assert (await client.get("/v1/nothing-here")).status_code == 401
        assert (await client.get("/favicon.ico")).status_code == 401
        assert (await client.get("/favicon.ico", headers=plain)).status_code == 404
        assert (await client.get("/static/index.html", headers=plain)).status_code == 404  # (no such route)


async def test_loads_follow_the_rule_of_the_health_details(keyed: RunningServer) -> None:
    """Issue 47: ``/loads`` named the models and their load errors to anyone; it needs a
    key now, as ``/health``'s details do (``/health`` itself stays open, the status alone)."""
    async with httpx.AsyncClient(base_url=keyed.url) as client:
        for path in ("/loads", "/v1/loads", "/loads?model=missing"):
            refused = await client.get(path)
            assert refused.status_code == 401, path
            assert refused.headers["www-authenticate"] == "Bearer"
        assert (await client.get("/health")).json() == {"status": "ok"}
        served = await client.get("/loads", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert served.status_code == 200
        assert served.json()["loads"][0]["max_running_requests"] == 1
        health = await client.get("/health", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert "models" in health.json()


async def test_an_admins_cancel_by_id_names_the_owner(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 47: an admin may cancel any key's request by id; the answer and the log
    say whose it was (the keys file's name), and which admin cancelled it."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[key]]\nname = "editor"\nkey = "sk-editor"\n\n[[key]]\nname = "ops"\nkey = "sk-ops"\nadmin = true\n'
    )
    backend = ScriptedBackend(token_interval=0.001)  # never ends on its own
    running = await start_server(nursery, backend, close_backend=True, keys_file=keys, shutdown_grace=0.0)
    caplog.set_level(logging.INFO, logger="trioserve.server")
    stream = await RawStream.post(
        running.url,
        "/v1/completions",
        {"prompt": "x", "stream": True},
        {"X-Request-Id": "job-7", "authorization": "Bearer sk-editor"},
    )
    try:
        await stream.read_until(b"data: ", 2)
        async with httpx.AsyncClient(base_url=running.url, headers={"x-api-key": "sk-ops"}) as admin:
            answer = await admin.post("/v1/requests/job-7/cancel")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["id"], body["cancelled"], body["key"]) == ("job-7", True, "editor")
        # the answer is the shape /openapi.json documents for it, field for field
        documented = msgspec.structs.fields(shapes.RequestCancelled)
        assert set(body) == {field.encode_name for field in documented}
        msgspec.convert(body, shapes.RequestCancelled)
        await stream.read_to_eof_or(b"data: [DONE]\n\n")
    finally:
        await stream.aclose()
    lines = [r.getMessage() for r in caplog.records if "cancelled by id" in r.getMessage()]
    assert lines == ["request job-7 of key 'editor' cancelled by id by admin key 'ops'"]
    running.server.shutdown()


async def test_token_counting_takes_the_keys_rate_limits_as_generation_does(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """``count_tokens`` and ``input_tokens`` are requests of the key's like any other
    (they may load a model, read a stored conversation, fetch images): its rate limits
    apply before any work, 429 with ``Retry-After`` once spent, and its
    ``x-ratelimit-*`` headers go on the answers."""
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "limited"\nkey = "sk-limited"\nrequests_per_minute = 2\n')
    running = await start_server(
        nursery, ScriptedBackend([b"ok"]), close_backend=True, keys_file=keys, shutdown_grace=0.0
    )
    messages = [{"role": "user", "content": "Hi"}]
    async with httpx.AsyncClient(base_url=running.url, headers={"x-api-key": "sk-limited"}) as client:
        counted = await client.post("/v1/messages/count_tokens", json={"messages": messages})
        assert counted.status_code == 200, counted.text
        assert counted.headers["x-ratelimit-limit-requests"] == "2"
        assert counted.headers["x-ratelimit-remaining-requests"] == "1"
        counted = await client.post("/v1/responses/input_tokens", json={"input": "Hi"})
        assert counted.status_code == 200, counted.text
        assert counted.headers["x-ratelimit-remaining-requests"] == "0"
        # spent: each count, and generation, refused before any work
        refused = await client.post("/v1/messages/count_tokens", json={"messages": messages})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error"  # (Anthropic's body)
        assert "retry-after" in refused.headers
        refused = await client.post("/v1/responses/input_tokens", json={"input": "Hi"})
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requests per minute" in refused.json()["error"]["message"]
        generation = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert generation.status_code == 429, generation.text
    running.server.shutdown()
