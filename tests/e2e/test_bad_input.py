"""Bad input gets a clear OpenAI-style error with the right status, and disturbs
nothing. Each row of BAD_INPUTS is a test, and the table in docs/bad-input.md is
checked against it, so the documentation cannot drift from the behaviour."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from trioserve import HTTPSettings, ScriptedBackend
from trioserve._wire._limits import RequestLimits

from .._helpers import RunningServer, start_server

J = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = "/v1/messages"
TOK, DETOK = "/tokenize", "/detokenize"
#: arrays nested 50,000 deep: every JSON reader that recurses would fail on it (left
#: open: closed, it would be over the rows' body limit; a reader recurses as deep either
#: way before it finds the end; tests/unit/wire/test_dialects.py sends closed ones)
DEEP = b"[" * 50_000
HI = [{"role": "user", "content": "hi"}]


def deep(path: str, body: bytes) -> tuple[str, str, str, dict[str, Any], int, str | None, str]:
    """A row: ``body`` (holding :data:`DEEP`) sent to ``path``."""
    return (
        f"nested 50,000 deep: {path}",
        "POST",
        path,
        {"content": body, "headers": J},
        400,
        None,
        "at most 128",
    )


def user(content: object = "hi") -> dict[str, object]:
    return {"role": "user", "content": content}


# (name, method, path, request kwargs, status, error code, a fragment of the message)
BAD_INPUTS: list[tuple[str, str, str, dict[str, Any], int, str | None, str]] = [
    (
        "body is not JSON",
        "POST",
        COMP,
        {"content": b"{prompt: hi", "headers": J},
        400,
        None,
        "not valid JSON",
    ),
    ("JSON is not an object", "POST", COMP, {"json": ["hi"]}, 400, None, "must be a JSON object"),
    (
        "invalid UTF-8 in the body",
        "POST",
        COMP,
        {"content": b'{"prompt": "\xff"}', "headers": J},
        400,
        None,
        "not valid UTF-8",
    ),
    (
        "missing prompt",
        "POST",
        COMP,
        {"json": {"max_tokens": 5}},
        400,
        None,
        "missing required field `prompt`",
    ),
    (
        "missing messages",
        "POST",
        CHAT,
        {"json": {"max_tokens": 5}},
        400,
        None,
        "missing required field `messages`",
    ),
    (
        "prompt of the wrong type",
        "POST",
        COMP,
        {"json": {"prompt": 42}},
        400,
        None,
        "Expected `str | array`, got `int`",
    ),
    (
        "max_tokens of the wrong type",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "max_tokens": "5"}},
        400,
        None,
        "Expected `int | null`, got `str`",
    ),
    (
        "stream of the wrong type",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "stream": "yes"}},
        400,
        None,
        "Expected `bool`, got `str`",
    ),
    ("empty prompt", "POST", COMP, {"json": {"prompt": ""}}, 400, None, "prompt must not be empty"),
    (
        "a batch mixing texts and token ids",
        "POST",
        COMP,
        {"json": {"prompt": ["a", 5]}},
        400,
        None,
        "not a mix",
    ),
    ("empty messages", "POST", CHAT, {"json": {"messages": []}}, 400, None, "at least one message"),
    (
        "invalid role",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "wizard", "content": "hi"}]}},
        400,
        None,
        "Invalid enum value 'wizard'",
    ),
    (
        "no user message",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "system", "content": "hi"}]}},
        400,
        None,
        "at least one user message",
    ),
    (
        "image content part without its image_url",
        "POST",
        CHAT,
        {"json": {"messages": [user([{"type": "image_url"}])]}},
        400,
        None,
        "needs an image_url object with a url",
    ),
    (
        "an image for a backend that cannot see images",
        "POST",
        CHAT,
        {
            "json": {
                "messages": [
                    user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
                ]
            }
        },
        400,
        "images_not_supported",
        "images are not supported",
    ),
    (
        "unknown model",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "model": "gpt-9"}},
        404,
        "model_not_found",
        "does not exist on this server",
    ),
    (
        "max_tokens 0",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "max_tokens": 0}},
        400,
        None,
        "Expected `int` >= 1",
    ),
    (
        "max_tokens negative",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "max_tokens": -3}},
        400,
        None,
        "Expected `int` >= 1",
    ),
    (
        "max_tokens beyond the context",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "max_tokens": 9000}},
        400,
        "context_length_exceeded",
        "only 4094 tokens fit",
    ),
    (
        "prompt longer than the context",
        "POST",
        COMP,
        {"json": {"prompt": "x" * 5000}},
        400,
        "context_length_exceeded",
        "the prompt has 5000 tokens but the context holds 4096",
    ),
    (
        "a conversation longer than the context",
        "POST",
        CHAT,
        {"json": {"messages": [user("x" * 5000), {"role": "assistant", "content": "y"}, user()]}},
        400,
        "context_length_exceeded",
        'or send truncation: "auto" to drop the oldest turns until it fits',
    ),
    (
        "a last user turn longer than the context, with truncation auto",
        "POST",
        CHAT,
        {
            "json": {
                "messages": [user("hi"), {"role": "assistant", "content": "y"}, user("x" * 5000)],
                "truncation": "auto",
            }
        },
        400,
        "context_length_exceeded",
        "even with truncation auto: with all 1 earlier turn(s) dropped",
    ),
    (
        "n above the server's slots",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "n": 3}},
        400,
        None,
        "n may be at most 2 on this server",
    ),
    ("n above 16", "POST", COMP, {"json": {"prompt": "hi", "n": 17}}, 400, None, "Expected `int` <= 16"),
    (
        "negative temperature",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "temperature": -0.5}},
        400,
        None,
        "Expected `float` >= 0.0",
    ),
    (
        "huge temperature",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "temperature": 1e30}},
        400,
        None,
        "Expected `float` <= 2.0",
    ),
    ("top_p 0", "POST", COMP, {"json": {"prompt": "hi", "top_p": 0}}, 400, None, "Expected `float` > 0.0"),
    (
        "logit_bias key not a number",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "logit_bias": {"hello": 5}}},
        400,
        None,
        "keys must be token ids",
    ),
    (
        "logit_bias value out of range",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "logit_bias": {"5": 500}}},
        400,
        None,
        "Expected `float` <= 100.0",
    ),
    (
        "five stop sequences",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}},
        400,
        None,
        "at most 4 stop sequences",
    ),
    (
        "17 stop sequences (Anthropic)",
        "POST",
        MSGS,
        {"json": {"max_tokens": 5, "messages": HI, "stop_sequences": ["x"] * 17}},
        400,
        None,
        "stop_sequences holds 17 entries; this server accepts at most 16 (--max-stop-sequences)",
    ),
    (
        "stop sequences over 2048 bytes",
        "POST",
        CHAT,
        {"json": {"messages": HI, "stop": ["x" * 1500, "y" * 1500]}},
        400,
        None,
        "add up to 3000 bytes; this server accepts at most 2048 (--max-stop-bytes)",
    ),
    (
        "1025 logit_bias entries",
        "POST",
        COMP,
        {"json": {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}},
        400,
        None,
        "logit_bias holds 1025 entries; this server accepts at most 1024 (--max-logit-bias)",
    ),
    (
        "129 tools",
        "POST",
        CHAT,
        {
            "json": {
                "messages": HI,
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            }
        },
        400,
        None,
        "tools holds 129 entries; this server accepts at most 128 (--max-tools)",
    ),
    (
        "a tool schema over the limit",
        "POST",
        MSGS,
        {
            "json": {
                "max_tokens": 5,
                "messages": HI,
                "tools": [{"name": "t", "input_schema": {"type": "object", "description": "x" * 5000}}],
            }
        },
        400,
        None,
        "bytes of JSON Schema; this server accepts at most 4096 (--max-schema-bytes)",
    ),
    (
        "a response_format schema over the limit",
        "POST",
        CHAT,
        {
            "json": {
                "messages": HI,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"description": "x" * 5000}},
                },
            }
        },
        400,
        None,
        "bytes of JSON Schema; this server accepts at most 4096 (--max-schema-bytes)",
    ),
    (
        "more messages than the limit",
        "POST",
        "/v1/responses",
        {"json": {"input": [{"role": "user", "content": "hi"}] * 101}},
        400,
        None,
        "input holds 101 entries; this server accepts at most 100 (--max-messages)",
    ),
    (
        "more content parts than the limit",
        "POST",
        CHAT,
        {"json": {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 201}]}},
        400,
        None,
        "hold 201 content parts; this server accepts at most 200 (--max-content-parts)",
    ),
    (
        "a batch of prompts × n over the limit",
        "POST",
        COMP,
        {"json": {"prompt": ["a"] * 10, "n": 8}},
        400,
        None,
        "10 prompts × n=8 asks for 80 choices; this server accepts at most 64 (--max-batch-choices)",
    ),
    deep(CHAT, b'{"messages": ' + DEEP + b"}"),
    deep(COMP, b'{"prompt": "hi", "logit_bias": {"1": ' + DEEP + b"}}"),
    deep(
        MSGS, b'{"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "metadata": ' + DEEP + b"}"
    ),
    deep("/v1/messages/count_tokens", b'{"messages": ' + DEEP + b"}"),
    deep(
        "/v1/responses",
        b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": ' + DEEP + b"}]}",
    ),
    deep("/v1/responses/input_tokens", b'{"input": ' + DEEP + b"}"),
    deep("/v1/embeddings", b'{"input": ' + DEEP + b"}"),
    deep(TOK, b'{"content": "hi", "extra": ' + DEEP + b"}"),
    deep(DETOK, b'{"tokens": ' + DEEP + b"}"),
    (
        "X-Request-Timeout not a number",
        "POST",
        COMP,
        {"json": {"prompt": "hi"}, "headers": {"X-Request-Timeout": "soon"}},
        400,
        None,
        "must be a number of seconds",
    ),
    (
        "X-Request-Timeout negative",
        "POST",
        COMP,
        {"json": {"prompt": "hi"}, "headers": {"X-Request-Timeout": "-1"}},
        400,
        None,
        "positive, finite",
    ),
    (
        "wrong Content-Type",
        "POST",
        COMP,
        {"content": b'{"prompt": "hi"}', "headers": {"content-type": "text/plain"}},
        415,
        "unsupported_media_type",
        "Content-Type must be application/json",
    ),
    (
        "body over the size limit",
        "POST",
        COMP,
        {"json": {"prompt": "x" * 70_000}},
        413,
        "payload_too_large",
        "the limit is 65536",
    ),
    (
        "headers over the size limit",
        "POST",
        COMP,
        {"json": {"prompt": "hi"}, "headers": {"X-Big": "x" * 20_000}},
        431,
        "headers_too_large",
        "exceed the limit",
    ),
    ("wrong method on an endpoint", "GET", COMP, {}, 405, "method_not_allowed", "accepts POST only"),
    ("wrong method on /health", "DELETE", "/health", {}, 405, "method_not_allowed", "does not accept DELETE"),
    ("unknown path", "GET", "/v2/everything", {}, 404, "not_found", "no route for GET /v2/everything"),
    (
        "unknown model id",
        "GET",
        "/v1/models/gpt-4o",
        {},
        404,
        "model_not_found",
        "'gpt-4o' does not exist on this server; available: scripted",
    ),
    (
        "tokenize: missing content",
        "POST",
        TOK,
        {"json": {"text": "hi"}},
        400,
        None,
        "missing required field `content`",
    ),
    (
        "tokenize: content not a string",
        "POST",
        TOK,
        {"json": {"content": 42}},
        400,
        None,
        "Expected `str`, got `int`",
    ),
    (
        "tokenize: a flag not a boolean",
        "POST",
        TOK,
        {"json": {"content": "hi", "with_pieces": 1}},
        400,
        None,
        "Expected `bool`, got `int`",
    ),
    ("detokenize: missing tokens", "POST", DETOK, {"json": {}}, 400, None, "missing required field `tokens`"),
    (
        "detokenize: a token id not a number",
        "POST",
        DETOK,
        {"json": {"tokens": [104, "105"]}},
        400,
        None,
        "Expected `int`, got `str`",
    ),
    (
        "detokenize: a negative token id",
        "POST",
        DETOK,
        {"json": {"tokens": [-1]}},
        400,
        None,
        "Expected `int` >= 0",
    ),
    (
        "detokenize: a token id past the vocabulary",
        "POST",
        DETOK,
        {"json": {"tokens": [104, 256]}},
        400,
        None,
        "tokens[1] is 256, which is not a token id of this model: its ids are 0 to 255",
    ),
]
IDS = [row[0] for row in BAD_INPUTS]
SCRIPT = [f" w{i}".encode() for i in range(400)]


@pytest.fixture
async def server(nursery: trio.Nursery) -> RunningServer:
    backend = ScriptedBackend(SCRIPT, token_interval=0.001, slots=2)
    limits = RequestLimits(max_schema_bytes=4096, max_messages=100, max_content_parts=200)
    http = HTTPSettings(max_body_bytes=65536, request_limits=limits)
    return await start_server(nursery, backend, close_backend=True, http=http)


async def _check(
    client: httpx.AsyncClient, row: tuple[str, str, str, dict[str, Any], int, str | None, str]
) -> None:
    _name, method, path, kwargs, status, code, fragment = row
    response = await client.request(method, path, **kwargs)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    if path.startswith(MSGS):  # Anthropic's error body: {"type": "error", "error": {"type", "message"}}
        assert response.json()["type"] == "error"
        error = response.json()["error"]
        assert set(error) == {"type", "message"}
        assert code is None
    else:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == code
    assert fragment in error["message"], error["message"]
    assert error["type"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize("row", BAD_INPUTS, ids=IDS)
async def test_bad_input_gets_a_clear_error(server: RunningServer, row: Any) -> None:
    async with server.client() as client:
        await _check(client, row)


async def test_bad_input_never_disturbs_a_stream_in_flight(server: RunningServer) -> None:
    expected = b"".join(SCRIPT[:300]).decode()
    async with server.client() as client:
        received: list[str] = []

        async def stream() -> None:
            body = {"prompt": "p", "max_tokens": 300, "stream": True}
            async with client.stream("POST", COMP, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        received.append(json.loads(line[6:])["choices"][0]["text"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            for row in BAD_INPUTS:
                await _check(client, row)
    assert "".join(received) == expected
    await server.wait_idle()


def test_the_documented_table_matches() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "bad-input.md").read_text()
    rows = re.findall(r"^\| ([^|]+?) \| (\d{3}) \| `?([^|`]+?)`? \|", doc, re.M)
    documented = {name: (int(status), None if code == "—" else code) for name, status, code in rows}
    assert documented == {name: (status, code) for name, _m, _p, _k, status, code, _f in BAD_INPUTS}
