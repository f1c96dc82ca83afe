"""OpenAI's Responses API, sans-IO: the response, as Responses events (each with its
``sequence_number``) or a ``Response`` body that echoes the request. The requests:
:mod:`._responses`; the mapping and choices: ``docs/dialects.md``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core._exceptions import TrioserveError
from .._core._types import EndCause, TokenLogprob, Usage
from ._choices import CallArguments, CallStart, ChoiceReader, Part, TextPart, ThinkingPart, ToolMode
from ._codec import encode_json
from ._conversation import new_id
from ._openai_writer import END_MESSAGES, ChoiceResult
from ._responses_request import ResponsesRequest, ToolChoiceFunction
from ._truncation import Dropped

__all__ = ["ResponsesDialect", "StoredTurn"]


# -- the request, echoed in the response object


def _tools(request: ResponsesRequest) -> list[dict[str, object]]:
    return [
        {
            "type": "function",
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
            "strict": tool.strict,
        }
        for tool in request.tools or ()
    ]


def _tool_choice(request: ResponsesRequest) -> object:
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def _text_format(request: ResponsesRequest) -> dict[str, object]:
    text = request.text
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"type": fmt.type if fmt is not None else "text"}
    return {
        "type": "json_schema",
        "name": fmt.name or "response",
        "schema": fmt.schema_,
        "strict": fmt.strict,
        "description": fmt.description,
    }


def _output_items(result: ChoiceResult, status: str) -> list[dict[str, object]]:
    """A whole response's output items: its reasoning, its message, its calls."""
    output: list[dict[str, object]] = []
    if result.reasoning is not None:
        content = [{"type": "reasoning_text", "text": result.reasoning}]
        output.append(
            {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "content": content,
                "status": status,
            }
        )
    if result.text or not result.tool_calls:
        part = {"type": "output_text", "text": result.text, "annotations": [], "logprobs": []}
        output.append(
            {
                "id": new_id("msg_"),
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [part],
            }
        )
    for _call_id, name, arguments in result.tool_calls or ():
        output.append(
            {
                "id": new_id("fc_"),
                "type": "function_call",
                "status": status,
                "call_id": new_id("call_"),
                "name": name,
                "arguments": arguments,
            }
        )
    return output


class ResponsesDialect:
    """One Responses response: its events or its ``Response`` body. One choice: the
    dialect is its own writer."""

    heartbeat = b": ping\n\n"

    def __init__(
        self,
        model: str,
        request: ResponsesRequest,
        *,
        tool_mode: ToolMode = "none",
        tool_names: Sequence[str] = (),
        reasoning: tuple[str, str] | None = None,
        inside: bool = False,
        parallel_calls: bool = True,
        stored: bool = False,
        response_id: str | None = None,
    ) -> None:
        self.model = model
        self.id = response_id or new_id("resp_")
        #: the request's id (``X-Request-Id``), in trioserve's field of the response
        self.request_id: str | None = None
        #: its overflow policy, as it was resolved (the server's ``--truncation`` where
        #: the request did not say), and what it dropped (docs/dialects.md, "Truncation")
        self.truncation: str = request.truncation or "disabled"
        self._dropped: Dropped | None = None
        self.created_at = int(time.time())
        self._request = request
        #: the response is kept in the server's store (its body says ``"store": true``)
        self.stored = stored
        #: the last whole response object written (``None``: none yet)
        self.final: dict[str, object] | None = None
        self._reader = ChoiceReader(
            tool_mode, tool_names, reasoning=reasoning, inside=inside, parallel_calls=parallel_calls
        )
        self._reasoning = reasoning is not None
        self._sequence = 0
        #: the finished output items, and the open one (a message or a call)
        self._output: list[dict[str, object]] = []
        self._item: dict[str, object] | None = None
        self._texts: list[str] = []
        self._cause: EndCause = "stop"
        self._message: str | None = None
        self.writers = [self]
        self._delta_prefix = b""

    def note_truncation(self, dropped: Dropped) -> None:
        """``truncation: "auto"`` dropped turns: every response object says so."""
        self._dropped = dropped

    # -- the response object

    def snapshot(
        self, status: str, error: str | None = None, cause: EndCause | None = None
    ) -> dict[str, object]:
        """The response object as it stands, with ``status`` (a background response
        queued, running, cancelled or cut short; ``error``: why it failed; ``cause``:
        why it ended early)."""
        if cause is not None:
            self._cause, self._message = cause, None
        body = self._response(status, None)
        if error is not None:
            body["error"] = {"code": "server_error", "message": error}
        return body

    def _response(
        self, status: str, usage: Usage | None, error: TrioserveError | None = None
    ) -> dict[str, object]:
        request = self._request
        body: dict[str, object] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": bool(request.background),
            "error": {"code": "server_error", "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.model,
            "output": list(self._output),
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": None,
            "store": self.stored,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": _text_format(request)},
            "tool_choice": _tool_choice(request),
            "tools": _tools(request),
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "truncation": self.truncation,
            "usage": _usage(usage) if usage is not None else None,
        }
        extension: dict[str, object] = {}
        if self.request_id is not None:
            extension["request_id"] = self.request_id
        if self._dropped is not None:
            extension["truncation"] = self._dropped.extension()
        if status not in ("in_progress", "queued") and self._cause not in ("stop", "length"):
            extension["end_cause"] = self._cause
            extension["message"] = self._message or END_MESSAGES.get(self._cause, "")
        if extension:
            body["trioserve"] = extension
        if status not in ("in_progress", "queued"):
            self.final = body
        return body

    # -- events

    def _event(self, payload: dict[str, object]) -> bytes:
        payload["sequence_number"] = self._sequence
        self._sequence += 1
        return b"event: " + str(payload["type"]).encode() + b"\ndata: " + encode_json(payload) + b"\n\n"

    def _open_message(self) -> bytes:
        item: dict[str, object] = {
            "id": new_id("msg_"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._item, self._texts = item, []
        index = len(self._output)
        self._delta_prefix = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":'
            + encode_json(item["id"])
            + b',"output_index":'
            + str(index).encode()
            + b',"content_index":0,"logprobs":[],"delta":'
        )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._event(
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        ) + self._event(
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            }
        )

    def _open_call(self, name: str) -> bytes:
        out = self._close()
        item: dict[str, object] = {
            "id": new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": new_id("call_"),
            "name": name,
            "arguments": "",
        }
        self._item, self._texts = item, []
        return out + self._event(
            {"type": "response.output_item.added", "output_index": len(self._output), "item": dict(item)}
        )

    def _open_reasoning(self) -> bytes:
        out = self._close()
        item: dict[str, object] = {
            "id": new_id("rs_"),
            "type": "reasoning",
            "summary": [],
            "status": "in_progress",
        }
        self._item, self._texts = item, []
        return out + self._event(
            {"type": "response.output_item.added", "output_index": len(self._output), "item": dict(item)}
        )

    def _reasoning_delta(self, text: str) -> bytes:
        assert self._item is not None
        self._texts.append(text)
        return self._event(
            {
                "type": "response.reasoning_text.delta",
                "item_id": self._item["id"],
                "output_index": len(self._output),
                "content_index": 0,
                "delta": text,
            }
        )

    def _close(self, status: str = "completed") -> bytes:
        item = self._item
        if item is None:
            return b""
        self._item = None
        index = len(self._output)
        text = "".join(self._texts)
        item["status"] = status
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out = self._event(
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                }
            )
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out = self._event(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                }
            ) + self._event(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            )
        else:
            item["arguments"] = text
            out = self._event(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": text,
                }
            )
        self._output.append(item)
        return out + self._event({"type": "response.output_item.done", "output_index": index, "item": item})

    def plain_delta(self, text: str) -> bytes:
        self._texts.append(text)
        sequence = self._sequence
        self._sequence = sequence + 1
        return b'%b%b,"sequence_number":%d}\n\n' % (self._delta_prefix, encode_json(text), sequence)

    def _arguments(self, fragment: str) -> bytes:
        assert self._item is not None
        self._texts.append(fragment)
        return self._event(
            {
                "type": "response.function_call_arguments.delta",
                "item_id": self._item["id"],
                "output_index": len(self._output),
                "delta": fragment,
            }
        )

    def opening(self, prompt_tokens: int) -> bytes:
        response = self._response("in_progress", None)
        out = self._event({"type": "response.created", "response": response}) + self._event(
            {"type": "response.in_progress", "response": response}
        )
        if self._reader.mode == "none" and not self._reasoning:
            out += self._open_message()
        return out

    def _encode(self, parts: tuple[Part, ...]) -> bytes:
        out = b""
        for part in parts:
            if type(part) is TextPart:
                if self._item is None or self._item["type"] != "message":
                    out += self._close() + self._open_message()
                out += self.plain_delta(part.text)
            elif type(part) is ThinkingPart:
                if self._item is None or self._item["type"] != "reasoning":
                    out += self._open_reasoning()
                out += self._reasoning_delta(part.text)
            elif type(part) is CallStart:
                out += self._open_call(part.name)
                if part.arguments:
                    out += self._arguments(part.arguments)
            else:
                assert isinstance(part, CallArguments)
                out += self._arguments(part.fragment)
        return out

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        return self._encode(self._reader.feed(text, logprobs))

    def finish(self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None) -> bytes:
        out = self._encode(self._reader.finish(cause))
        self._cause, self._message = cause, message
        return out + self._close("completed" if cause == "stop" else "incomplete")

    def end(self, usage: Usage) -> bytes:
        status = "completed" if self._cause == "stop" else "incomplete"
        return self._event({"type": f"response.{status}", "response": self._response(status, usage)})

    def stream_error(self, error: TrioserveError) -> bytes:
        self._cause, self._message = "error", error.message
        return self._event({"type": "response.failed", "response": self._response("failed", None, error)})

    def limit_max_tokens(self, limit: int) -> None:
        """(Its ``max_output_tokens`` is refused above the limit, never held to it.)"""

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        (result,) = choices
        self._cause = result.cause
        status = "completed" if result.cause == "stop" else "incomplete"
        self._output.extend(_output_items(result, status))
        return encode_json(self._response(status, usage))


def _usage(usage: Usage) -> dict[str, object]:
    body: dict[str, object] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }
    split = usage.cache_split()
    if split is not None:
        body["trioserve"] = {"cached_tokens": split}
    return body


@dataclass(slots=True)
class StoredTurn:
    """A Responses request whose response is stored: what the store keeps of it once
    the response is written (docs/dialects.md, "Stored responses")."""

    dialect: ResponsesDialect
    #: this turn's input, as stored and listed (items with ids)
    input_items: list[dict[str, Any]]
    previous_id: str | None = None
    instructions: str | None = None
    #: a background response (its status is read live while it runs)
    background: bool = False
    model: str = ""

    @property
    def id(self) -> str:
        return self.dialect.id
