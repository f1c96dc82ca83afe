"""The dialects as data: each generation route's :class:`~trioserve._wire.DialectSpec`
(its decoder, its error body, the names its errors use) and the shared checks every
dialect goes through. No model, no server."""

from __future__ import annotations

import pytest

from trioserve._core._exceptions import InvalidRequestError, OverloadedError
from trioserve._http._errors import render_error, render_for_path, renderer
from trioserve._http._generation import GENERATION_PATHS
from trioserve._wire import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    OPENAI,
    RESPONSES,
    SPECS,
    DialectSpec,
    ReadOptions,
    spec_for_path,
)
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._limits import RequestLimits
from trioserve._wire._refusals import check_refused
from trioserve._wire._tools import check_tool_name

OPTIONS = ReadOptions(limits=RequestLimits(), model_name=lambda requested: "the-model")

BODIES = {
    "/v1/completions": b'{"prompt": "hi", "max_tokens": 3}',
    "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
    "/v1/messages": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}',
    "/v1/responses": b'{"input": "hi", "max_output_tokens": 3}',
    "/infill": b'{"input_prefix": "def f(", "input_suffix": "):\\n", "n_predict": 3}',
    "/api/chat": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false, '
    b'"options": {"num_predict": 3}}',
    "/api/generate": b'{"model": "m", "prompt": "hi", "stream": false, "options": {"num_predict": 3}}',
}


#: routes whose handler reads a multipart form and hands the spec the chat it became
#: (docs/audio.md): not a JSON body of the generation handler's
FORM_ROUTES = {"/v1/audio/transcriptions": "transcription"}


def test_every_generation_route_has_a_spec_with_a_decoder() -> None:
    assert set(SPECS) - set(FORM_ROUTES) == set(GENERATION_PATHS) == set(BODIES)
    for path, spec in SPECS.items():
        assert spec.read is not None
        assert spec.kind == (FORM_ROUTES.get(path) or GENERATION_PATHS[path])
    assert OPENAI.read is None  # (the error body of every other route)


@pytest.mark.parametrize("path", sorted(BODIES))
def test_each_spec_decodes_its_own_body(path: str) -> None:
    spec = SPECS[path]
    assert spec.read is not None
    parsed = spec.read(BODIES[path], GemmaFormat(), OPTIONS)
    assert parsed.model == "the-model"
    assert not parsed.stream
    assert parsed.plain
    assert parsed.generation.max_tokens == 3
    # every dialect answers the server's token limit (a no-op where it refuses instead)
    parsed.dialect.limit_max_tokens(2)


def test_a_bad_body_is_reported_before_the_model_is_resolved() -> None:
    def unknown(requested: str | None) -> str:
        raise AssertionError("the model was resolved first")

    options = ReadOptions(limits=RequestLimits(), model_name=unknown)
    for spec in SPECS.values():
        assert spec.read is not None
        with pytest.raises(InvalidRequestError):
            spec.read(b"[]", GemmaFormat(), options)


def test_the_error_body_is_the_dialects_own() -> None:
    full = OverloadedError("the queue is full")
    assert MESSAGES.error_body(full) == (
        529,
        {"type": "error", "error": {"type": "overloaded_error", "message": "the queue is full"}},
    )
    for spec in (OPENAI, COMPLETIONS, CHAT, RESPONSES):
        assert spec.error_body(full) == (429, full.to_dict())


def test_errors_are_rendered_by_the_dialect_of_their_path() -> None:
    assert spec_for_path("/v1/messages") is MESSAGES
    assert spec_for_path("/v1/messages/count_tokens") is MESSAGES
    assert spec_for_path("/v1/responses") is OPENAI
    assert spec_for_path("/v1/models") is OPENAI
    full = OverloadedError("the queue is full")
    status, headers, _body = render_for_path(full, "/v1/messages/nowhere")
    assert status == 529
    assert (b"retry-after", b"1") in headers
    assert render_for_path(full, "/v1/chat/completions") == render_error(full)
    assert renderer(CHAT)(full) == render_error(full)


def test_a_spec_names_the_engines_fields_as_its_dialect_does() -> None:
    exc = InvalidRequestError("max_tokens may be at most 8 on this server; got 9", param="max_tokens")
    RESPONSES.rename(exc)
    assert (exc.message, exc.param) == (
        "max_output_tokens may be at most 8 on this server; got 9",
        "max_output_tokens",
    )
    other = InvalidRequestError("max_tokens may be at most 8", param="max_tokens")
    CHAT.rename(other)
    MESSAGES.rename(other)
    assert (other.message, other.param) == ("max_tokens may be at most 8", "max_tokens")
    assert isinstance(RESPONSES, DialectSpec)


class _Fields:
    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def test_one_refused_field_mechanism() -> None:
    table = (("store", (None, False), "completions are not stored here"),)
    check_refused(_Fields(store=None), table)
    check_refused(_Fields(store=False), table)
    check_refused(_Fields(), table)
    for value in (True, 0, "no"):  # (0 is not False)
        with pytest.raises(InvalidRequestError, match="store is not supported: completions") as info:
            check_refused(_Fields(store=value), table)
        assert info.value.param == "store"


def test_one_tool_name_check() -> None:
    check_tool_name("get_weather-2", "tools[0].name")
    check_tool_name("a" * 128, "tools[0].name", longest=128)
    with pytest.raises(InvalidRequestError) as info:
        check_tool_name("a" * 65, "tools[1].function.name")
    assert info.value.param == "tools[1].function.name"
    assert str(info.value.message).endswith("must be 1-64 letters, digits, '_' or '-'")
    for bad in ("", "a b", None):
        with pytest.raises(InvalidRequestError, match="must be 1-128"):
            check_tool_name(bad, "tools[0].name", longest=128)


class _Told:
    """A dialect stand-in that records what ``limit_max_tokens`` told it."""

    def __init__(self) -> None:
        self.limits: list[int] = []

    def limit_max_tokens(self, limit: int) -> None:
        self.limits.append(limit)


def test_the_servers_token_limit_clamps_an_upper_bound_and_refuses_the_rest() -> None:
    from typing import Any, cast

    from trioserve._core._backend import PreparedPrompt
    from trioserve._core._types import GenerationRequest
    from trioserve._http._prepare_run import _check_limits
    from trioserve._http._settings import HTTPSettings

    settings = HTTPSettings(max_tokens_limit=50)
    told = _Told()
    dialect = cast(Any, told)
    bound = PreparedPrompt(
        request=GenerationRequest(prompt="x", max_tokens=80, clamp_max_tokens=True),
        tokens=[1],
        max_new_tokens=80,
    )
    assert _check_limits(bound, settings, dialect).max_new_tokens == 50
    assert told.limits == [50]
    asked = PreparedPrompt(
        request=GenerationRequest(prompt="x", max_tokens=51), tokens=[1], max_new_tokens=51
    )
    with pytest.raises(InvalidRequestError, match="max_tokens may be at most 50 on this server; got 51"):
        _check_limits(asked, settings, dialect)
    fits = PreparedPrompt(request=GenerationRequest(prompt="x", max_tokens=50), tokens=[1], max_new_tokens=50)
    assert _check_limits(fits, settings, dialect) is fits
    assert told.limits == [50]


def test_a_failed_backend_is_a_500_with_its_own_code() -> None:
    from trioserve._http._writing import BackendFailed

    error = BackendFailed("inference failed")
    assert error.status == 500
    assert error.to_dict()["error"] == {
        "message": "inference failed",
        "type": "server_error",
        "param": None,
        "code": "backend_error",
    }
