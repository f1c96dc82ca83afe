"""Ollama's native answers, sans-IO: NDJSON lines (``application/x-ndjson``: one JSON
object per line, ``"done": false`` while text comes, then one ``"done": true`` line with
``done_reason`` and the measured durations), or that final object alone, and Ollama's
error body (``{"error": "…"}``). The requests: :mod:`._ollama`; every choice:
``docs/dialects.md``, "Ollama"."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Literal

from .._core._exceptions import OverloadedError, TrioserveError
from .._core._types import EndCause, Usage
from ._choices import CallArguments, CallStart, ChoiceReader, Part, TextPart, ThinkingPart, ToolMode
from ._codec import encode_json
from ._openai_writer import ChoiceResult, token_logprobs, trioserve_extension
from ._parts_writer import PartsWriter
from ._tools import new_call_id
from ._truncation import Dropped

__all__ = ["NDJSON", "OllamaDialect", "ollama_error", "rfc3339_now"]

#: the media type of a streamed answer
NDJSON = "application/x-ndjson"

OllamaKind = Literal["chat", "generate"]


def ollama_error(exc: TrioserveError) -> tuple[int, dict[str, object]]:
    """Ollama's status and error body for ``exc``: ``{"error": message}``; a full queue
    is 503 (Ollama's "server busy"), the rest keep their status."""
    status = 503 if isinstance(exc, OverloadedError) else exc.status
    return status, {"error": exc.message}


class _Clock:
    """``created_at``: RFC 3339, UTC, nanoseconds (Ollama's); the date and time of day
    formatted once a second (a line's stamp is one integer format on the hot path)."""

    __slots__ = ("_head", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._head = ""

    def now(self) -> str:
        ns = time.time_ns()
        second, fraction = divmod(ns, 1_000_000_000)
        if second != self._second:
            self._second = second
            self._head = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._head}.{fraction:09d}Z"


_CLOCK = _Clock()


def rfc3339_now() -> str:
    return _CLOCK.now()


def _done_reason(cause: EndCause) -> str:
    """``stop`` when the model ended the text, else ``length`` (the text was cut: by
    ``num_predict``, the context, a deadline, shutdown; the real cause goes in the
    ``trioserve`` field)."""
    return "stop" if cause == "stop" else "length"


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


class OllamaDialect(PartsWriter):
    """One ``/api/chat`` (``kind="chat"``) or ``/api/generate`` (``"generate"``) answer.
    One choice: the dialect is its own writer."""

    def __init__(
        self,
        kind: OllamaKind,
        model: str,
        *,
        tool_mode: ToolMode = "none",
        tool_names: Sequence[str] = (),
        reasoning: tuple[str, str] | None = None,
        inside: bool = False,
        logprobs: bool = False,
        arrived: float | None = None,
        load_seconds: float = 0.0,
        unloads: bool = False,
    ) -> None:
        self.kind = kind
        self.model = model
        #: the request's id (``X-Request-Id``), in the final line's ``trioserve`` field
        self.request_id: str | None = None
        self.writers = [self]
        self._reader = ChoiceReader(tool_mode, tool_names, reasoning=reasoning, inside=inside)
        self._logprobs = logprobs
        #: ``time.perf_counter()`` when the request arrived, and its wait for its load
        self._arrived = time.perf_counter() if arrived is None else arrived
        self._load_seconds = load_seconds
        #: an empty prompt with ``keep_alive: 0``: ``done_reason`` is ``unload``
        self._unloads = unloads
        self._dropped: Dropped | None = None
        self._cause: EndCause = "stop"
        self._message: str | None = None
        #: the call being read (forced mode streams its arguments): (id, name, arguments)
        self._call: tuple[str, str, list[str]] | None = None
        self._calls = 0
        head = b'{"model":' + encode_json(model) + b',"created_at":"'
        self._head = head
        if kind == "chat":
            self._middle = b'","message":{"role":"assistant","content":'
            self._tail = b'},"done":false}\n'
        else:
            self._middle = b'","response":'
            self._tail = b',"done":false}\n'

    # -- streamed ---------------------------------------------------------------------------

    def plain_delta(self, text: str) -> bytes:
        return self._head + _CLOCK.now().encode() + self._middle + encode_json(text) + self._tail

    @property
    def heartbeat(self) -> bytes:
        """An empty progress line, stamped now: Ollama's clients read every line as
        JSON (an SSE comment or a blank line would break them)."""
        return self.plain_delta("")

    def opening(self, prompt_tokens: int) -> bytes:
        return b""

    def _line(self, fields: dict[str, object]) -> bytes:
        line: dict[str, object] = {"model": self.model, "created_at": _CLOCK.now()}
        if self.kind == "chat":
            message: dict[str, object] = {"role": "assistant", "content": fields.pop("content", "")}
            for name in ("thinking", "tool_calls"):
                if name in fields:
                    message[name] = fields.pop(name)
            line["message"] = message
        else:
            line["response"] = fields.pop("content", "")
            if "thinking" in fields:
                line["thinking"] = fields.pop("thinking")
        line.update(fields)
        if "done" not in line:
            line["done"] = False
        return encode_json(line) + b"\n"

    def _call_object(self, call_id: str, name: str, arguments: str) -> dict[str, object] | None:
        """A call as Ollama writes it (arguments an object); ``None``: its arguments
        are not a JSON object (cut short)."""
        try:
            value = json.loads(arguments) if arguments else {}
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        index = self._calls
        self._calls += 1
        return {"id": call_id, "function": {"index": index, "name": name, "arguments": value}}

    def _flush_call(self) -> bytes:
        if self._call is None:
            return b""
        call_id, name, fragments = self._call
        self._call = None
        arguments = "".join(fragments)
        call = self._call_object(call_id, name, arguments)
        if call is None:  # (cut short: what there is, as text)
            return self._line({"content": arguments})
        return self._line({"tool_calls": [call]})

    def _encode(self, parts: tuple[Part, ...]) -> bytes:
        out = b""
        for part in parts:
            if type(part) is TextPart:
                if part.logprobs is not None and self._logprobs:
                    out += self._line({"content": part.text, "logprobs": token_logprobs(part.logprobs)})
                else:
                    out += self.plain_delta(part.text)
            elif type(part) is ThinkingPart:
                out += self._line({"thinking": part.text})
            elif type(part) is CallStart:
                out += self._flush_call()
                self._call = (new_call_id(), part.name, [part.arguments])
            else:
                assert isinstance(part, CallArguments)
                if self._call is not None:
                    self._call[2].append(part.fragment)
        return out

    def _close_choice(self, cause: EndCause, message: str | None, stop_sequence: str | None) -> bytes:
        self._cause, self._message = cause, message
        return self._flush_call()

    def note_truncation(self, dropped: Dropped) -> None:
        """``truncation: "auto"`` dropped turns: the final line says so."""
        self._dropped = dropped

    def limit_max_tokens(self, limit: int) -> None:
        """(``num_predict`` is an upper bound; reaching the limit is ``length``.)"""

    def _final(self, usage: Usage, done_reason: str | None = None) -> dict[str, object]:
        fields: dict[str, object] = {
            "done": True,
            "done_reason": done_reason or _done_reason(self._cause),
            "total_duration": _ns(time.perf_counter() - self._arrived),
            "load_duration": _ns(self._load_seconds),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _ns(usage.prefill_seconds),
            "eval_count": usage.completion_tokens,
            "eval_duration": _ns(usage.decode_seconds),
        }
        extension = trioserve_extension(
            self.request_id,
            cached_tokens=usage.cached_tokens,
            truncation=self._dropped,
            cause=self._cause,
            message=self._message,
        )
        if extension:
            fields["trioserve"] = extension
        return fields

    def end(self, usage: Usage) -> bytes:
        return self._line(self._final(usage))

    def stream_error(self, error: TrioserveError) -> bytes:
        return encode_json({"error": error.message}) + b"\n"

    # -- whole ------------------------------------------------------------------------------

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        """The whole answer; no choice: the model was only loaded (an empty prompt)."""
        if not choices:
            final = self._final(usage, "unload" if self._unloads else "load")
            return self._line({"done": True, "done_reason": final["done_reason"]}).rstrip(b"\n")
        (result,) = choices
        self._cause = result.cause
        fields: dict[str, object] = {"content": result.text}
        if result.reasoning is not None:
            fields["thinking"] = result.reasoning
        calls = []
        for call_id, name, arguments in result.tool_calls or ():
            call = self._call_object(call_id, name, arguments)
            if call is None:  # cut short: as text
                fields["content"] = str(fields["content"]) + arguments
            else:
                calls.append(call)
        if calls:
            fields["tool_calls"] = calls
        if self._logprobs and result.logprobs is not None:
            fields["logprobs"] = token_logprobs(result.logprobs)
        fields.update(self._final(usage))
        return self._line(fields).rstrip(b"\n")
