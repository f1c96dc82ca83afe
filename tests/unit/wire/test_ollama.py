"""Ollama's generation dialect at the wire (docs/dialects.md, "Ollama"): ``keep_alive``'s
durations, ``options`` honoured or refused by name, the conversion of ``/api/chat`` and
``/api/generate`` bodies (the prompt a chat completion renders), the NDJSON lines and the
final object's fields, Ollama's model names and error body; and the field table of
docs/api.md against the request structs."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from trioserve._core._exceptions import InvalidRequestError, NotFoundError, OverloadedError
from trioserve._core._types import TokenLogprob, Usage
from trioserve._wire import CHAT, SPECS, ReadOptions
from trioserve._wire._chat import GemmaFormat
from trioserve._wire._limits import RequestLimits
from trioserve._wire._ollama import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    resolve_ollama_model,
)
from trioserve._wire._ollama_options import OllamaOptions, parse_duration, peek_keep_alive
from trioserve._wire._ollama_writer import OllamaDialect, ollama_error
from trioserve._wire._openai_writer import ChoiceResult

GEMMA = GemmaFormat()
CHAT_SPEC, GENERATE_SPEC = SPECS["/api/chat"], SPECS["/api/generate"]
SERVED = {"gemma", "qwen:7b"}


def _resolve(name: str | None) -> str:
    if name not in SERVED:
        raise NotFoundError(f"the model {name!r} does not exist on this server", param="model")
    return name


def options(**extra: Any) -> ReadOptions:
    return ReadOptions(limits=RequestLimits(), model_name=_resolve, context_length=4096, **extra)


def chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "gemma", "messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("300ms", 0.3),
        ("1.5h", 5400.0),
        ("10s", 10.0),
        ("2m30s", 150.0),
        ("0", 0.0),
        (0, 0.0),
        (45, 45.0),
        ("45", 45.0),
        (-1, math.inf),
        ("-1m", math.inf),
        ("-1", math.inf),
    ],
)
def test_keep_alive_durations(value: float | str, seconds: float) -> None:
    assert parse_duration(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", "5d", ""])
def test_a_keep_alive_that_is_no_duration_is_a_400_naming_it(value: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_duration(value)
    assert caught.value.param == "keep_alive"


def test_keep_alive_is_peeked_from_the_body() -> None:
    assert peek_keep_alive(chat_body()) is None
    assert peek_keep_alive(chat_body(keep_alive="1h")) == 3600.0
    assert peek_keep_alive(chat_body(keep_alive=0)) == 0.0
    with pytest.raises(InvalidRequestError):
        peek_keep_alive(chat_body(keep_alive=True))


def test_names_latest_is_the_served_name_and_an_unknown_one_is_ollamas_404() -> None:
    assert resolve_ollama_model("gemma:latest", _resolve) == "gemma"
    assert resolve_ollama_model("gemma", _resolve) == "gemma"
    assert resolve_ollama_model("qwen:7b", _resolve) == "qwen:7b"
    with pytest.raises(NotFoundError) as caught:
        resolve_ollama_model("llama3:8b", _resolve)
    assert caught.value.message.startswith('model "llama3:8b" not found')
    assert "--model" in caught.value.message  # how to add one
    with pytest.raises(InvalidRequestError, match="model is required"):
        resolve_ollama_model(None, _resolve)


def test_the_error_body_and_status() -> None:
    assert ollama_error(InvalidRequestError("bad", param="x")) == (400, {"error": "bad"})
    assert ollama_error(OverloadedError("full")) == (503, {"error": "full"})  # Ollama's "server busy"


def test_a_chat_renders_the_prompt_a_chat_completion_renders() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Weather?"},
    ]
    body = {"model": "gemma", "messages": messages, "options": {"temperature": 0, "num_predict": 9}}
    ollama = CHAT_SPEC.read(json.dumps(body).encode(), GEMMA, options())  # type: ignore[misc]
    openai = CHAT.read(  # type: ignore[misc]
        json.dumps({"model": "gemma", "messages": messages, "max_tokens": 9}).encode(), GEMMA, options()
    )
    assert ollama.generation.prompt == openai.generation.prompt
    assert ollama.generation.max_tokens == 9
    assert ollama.generation.sampling.temperature == 0
    assert ollama.model == "gemma"
    assert ollama.stream  # Ollama's default


def test_ollamas_defaults_apply_where_no_option_is_sent() -> None:
    sampling = CHAT_SPEC.read(chat_body(), GEMMA, options()).generation.sampling  # type: ignore[misc]
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.8, 40, 0.9)
    assert (sampling.repeat_penalty, sampling.repeat_last_n) == (1.1, 64)
    given = {
        "temperature": 0.2,
        "top_k": 5,
        "top_p": 0.5,
        "min_p": 0.1,
        "seed": 7,
        "repeat_penalty": 1.3,
        "repeat_last_n": 16,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    read = CHAT_SPEC.read(chat_body(options=given), GEMMA, options())  # type: ignore[misc]
    for name, value in given.items():
        assert getattr(read.generation.sampling, name) == value, name


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("mirostat", 2),
        ("typical_p", 0.5),
        ("tfs_z", 0.9),
        ("penalize_newline", True),
        ("num_thread", 4),
        ("num_gpu", 1),
        ("use_mmap", False),
        ("num_batch", 64),
        ("f16_kv", True),
    ],
)
def test_an_option_that_is_not_honoured_is_refused_by_name(option: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        CHAT_SPEC.read(chat_body(options={option: value}), GEMMA, options())  # type: ignore[misc]
    assert caught.value.param == f"options.{option}"
    assert caught.value.message.startswith(f"options.{option} is not supported")


def test_an_unknown_option_and_a_small_num_ctx_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="bogus"):
        CHAT_SPEC.read(chat_body(options={"bogus": 1}), GEMMA, options())  # type: ignore[misc]
    with pytest.raises(InvalidRequestError) as caught:
        CHAT_SPEC.read(chat_body(options={"num_ctx": 2048}), GEMMA, options())  # type: ignore[misc]
    assert caught.value.param == "options.num_ctx"
    assert "4096" in caught.value.message
    # the served context or more: accepted (Ollama clamps it to what the model has)
    CHAT_SPEC.read(chat_body(options={"num_ctx": 8192, "num_keep": 5}), GEMMA, options())  # type: ignore[misc]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
        ({"prompt": "x", "context": [1, 2, 3]}, "context"),
        ({"prompt": "x", "raw": True, "system": "s"}, "system"),
        ({"prompt": "x", "suffix": "y", "images": ["aGk="]}, "images"),
        ({"prompt": "x", "think": "high"}, "think"),
        ({"prompt": "x", "think": True}, "think"),  # (this template does not reason)
        ({"prompt": "x", "format": "xml"}, "format"),
        ({"prompt": "x", "top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_generate_refusals(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        GENERATE_SPEC.read(json.dumps({"model": "gemma", **body}).encode(), GEMMA, options())  # type: ignore[misc]
    assert caught.value.param == param


def test_generate_raw_suffix_and_templated() -> None:
    def read(**body: Any) -> Any:
        return GENERATE_SPEC.read(  # type: ignore[misc]
            json.dumps({"model": "gemma:latest", **body}).encode(), GEMMA, options()
        ).generation

    raw = read(prompt="Once upon", raw=True)
    assert (raw.prompt, raw.add_bos, raw.infill) == ("Once upon", True, None)
    fim = read(prompt="def f(", suffix="\n    return x\n")
    assert fim.infill.prefix == "def f("
    assert fim.infill.suffix == "\n    return x\n"
    assert (fim.prompt, fim.add_bos) == ("", False)
    templated = read(prompt="Hi", system="Be brief.")
    chat = CHAT_SPEC.read(  # type: ignore[misc]
        json.dumps(
            {
                "model": "gemma",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            }
        ).encode(),
        GEMMA,
        options(),
    ).generation
    assert templated.prompt == chat.prompt
    assert read(prompt="x", format="json").constraint.kind == "json_schema"


def test_an_empty_prompt_or_no_messages_only_loads() -> None:
    for spec, body in ((GENERATE_SPEC, {"prompt": ""}), (CHAT_SPEC, {"messages": []})):
        read = spec.read(json.dumps({"model": "gemma", **body}).encode(), GEMMA, options())  # type: ignore[misc]
        assert read.loads_only
        answer = json.loads(read.dialect.body((), Usage(prompt_tokens=0, completion_tokens=0)))
        assert (answer["done"], answer["done_reason"], answer["model"]) == (True, "load", "gemma")
        unloads = spec.read(  # type: ignore[misc]
            json.dumps({"model": "gemma", **body}).encode(), GEMMA, options(keep_alive=0.0)
        )
        answer = json.loads(unloads.dialect.body((), Usage(prompt_tokens=0, completion_tokens=0)))
        assert answer["done_reason"] == "unload"


def test_tool_calls_in_the_history_and_tool_results() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "22 C", "tool_name": "get_weather"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = json.dumps({"model": "gemma", "messages": messages, "tools": tools}).encode()
    read = CHAT_SPEC.read(body, GEMMA, options())  # type: ignore[misc]
    assert '{"name":"get_weather","arguments":{"city":"Paris"}}' in read.generation.prompt
    assert "get_weather returned: 22 C" in read.generation.prompt
    assert read.tool_mode == "auto"
    forced = CHAT_SPEC.read(  # type: ignore[misc]
        json.dumps(
            {"model": "gemma", "messages": messages, "tools": tools, "tool_choice": "required"}
        ).encode(),
        GEMMA,
        options(),
    )
    assert forced.tool_mode == "forced"
    assert forced.generation.constraint is not None


def _lines(data: bytes) -> list[dict[str, Any]]:
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")


def test_the_lines_and_the_final_object() -> None:
    dialect = OllamaDialect("chat", "gemma:latest", arrived=time.perf_counter() - 0.5, load_seconds=0.25)
    dialect.request_id = "abc"
    lines = _lines(dialect.plain_delta("Hel") + dialect.plain_delta("lo") + dialect.heartbeat)
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": c} for c in ("Hel", "lo", "")
    ]
    assert all(line["done"] is False and line["model"] == "gemma:latest" for line in lines)
    assert all(RFC3339.match(line["created_at"]) for line in lines)
    usage = Usage(
        prompt_tokens=12, completion_tokens=5, cached_tokens=4, prefill_seconds=0.1, decode_seconds=0.2
    )
    (final,) = _lines(dialect.finish("length") + dialect.end(usage))
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert final["total_duration"] >= 500_000_000
    assert final["load_duration"] == 250_000_000
    assert (final["prompt_eval_count"], final["prompt_eval_duration"]) == (12, 100_000_000)
    assert (final["eval_count"], final["eval_duration"]) == (5, 200_000_000)
    assert final["trioserve"] == {"request_id": "abc", "cached_tokens": 4}
    # cut short by trioserve: a length a client accepts, and the cause
    cut = OllamaDialect("generate", "gemma")
    (final,) = _lines(cut.finish("deadline") + cut.end(usage))
    assert final["done_reason"] == "length"
    assert final["response"] == ""
    assert final["trioserve"]["end_cause"] == "deadline"
    assert _lines(cut.stream_error(InvalidRequestError("it broke"))) == [{"error": "it broke"}]


def test_streamed_calls_come_whole_with_object_arguments_and_thinking_apart() -> None:
    dialect = OllamaDialect("chat", "m", tool_mode="forced", tool_names=["get_weather"])
    data = dialect.delta('{"name":"get_weather","arguments":{"ci', None)
    data += dialect.delta('ty":"Oslo"}}', None) + dialect.finish("stop")
    (line,) = _lines(data)
    (call,) = line["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Oslo"}}
    thinker = OllamaDialect("generate", "m", reasoning=("<think>", "</think>"), inside=True)
    lines = _lines(thinker.delta("Two.</think>Four.", None) + thinker.finish("stop"))
    assert [(line.get("thinking"), line["response"]) for line in lines] == [("Two.", ""), (None, "Four.")]
    logprobs = OllamaDialect("generate", "m", logprobs=True)
    entry = TokenLogprob(token=5, piece=b"Hi", logprob=-0.5, top=((b"Hi", -0.5), (b"Yo", -1.5)))
    (line,) = _lines(logprobs.delta("Hi", [entry]))
    assert line["logprobs"][0]["token"] == "Hi"
    assert line["logprobs"][0]["top_logprobs"][1] == {"token": "Yo", "logprob": -1.5, "bytes": list(b"Yo")}


def test_a_whole_answer() -> None:
    dialect = OllamaDialect("chat", "m")
    result = ChoiceResult(text="", cause="stop", tool_calls=[("call_1", "f", '{"a":1}')], reasoning="hm")
    body = json.loads(dialect.body([result], Usage(prompt_tokens=3, completion_tokens=2)))
    assert body["message"]["thinking"] == "hm"
    assert body["message"]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert body["done"] is True
    assert body["done_reason"] == "stop"


# -- the field table of docs/api.md ---------------------------------------------------------

API = Path(__file__).parents[3] / "docs" / "api.md"


def _documented() -> dict[str, tuple[str, str]]:
    """The table's rows: field → (routes, status)."""
    section = API.read_text().split("### Ollama request fields", 1)[1].split("\n#", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_every_request_field_and_option_has_a_row_and_every_row_a_field() -> None:
    fields = {
        f.encode_name
        for struct in (OllamaChatRequest, OllamaGenerateRequest)
        for f in msgspec.structs.fields(struct)
    }
    fields |= {"options." + f.encode_name for f in msgspec.structs.fields(OllamaOptions)}
    fields |= {
        "messages[]." + f.encode_name
        for f in msgspec.structs.fields(OllamaMessage)
        if f.encode_name not in ("role", "content")
    }
    documented = _documented()
    assert set(documented) == fields
    assert all(status in ("honoured", "refused", "accepted") for _, status in documented.values())
