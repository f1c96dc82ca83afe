"""OpenAI's Responses API, sans-IO: the response, as Responses events (each with its
``sequence_number``) or a ``Response`` body that echoes the request (that object:
:mod:`._responses_object`). The requests: :mod:`._responses`; the mapping and choices:
``docs/dialects.md``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._core._exceptions import TrioserveError
from .._core._types import EndCause, Usage
from ._choices import CallArguments, CallStart, Part, TextPart, ThinkingPart
from ._codec import encode_json
from ._conversation import new_id
from ._openai_writer import ChoiceResult
from ._parts_writer import PartsWriter
from ._responses_object import ResponseObject, _output_items

__all__ = ["ResponsesDialect", "StoredTurn"]


class ResponsesDialect(ResponseObject, PartsWriter):
    """One Responses response: its events or its ``Response`` body. One choice: the
    dialect is its own writer."""

    heartbeat = b": ping\n\n"
    writers: Sequence[ResponsesDialect]

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
        return self._item_delta("response.reasoning_text.delta", text, content_index=0)

    def _item_delta(self, kind: str, text: str, **fields: object) -> bytes:
        """The open item's event ``kind`` carrying ``text`` as its delta (``fields``: the
        event's own, before it); the text kept for the item's done event."""
        assert self._item is not None
        self._texts.append(text)
        return self._event(
            {
                "type": kind,
                "item_id": self._item["id"],
                "output_index": len(self._output),
                **fields,
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
        return self._item_delta("response.function_call_arguments.delta", fragment)

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

    def _close_choice(self, cause: EndCause, message: str | None, stop_sequence: str | None) -> bytes:
        self._cause, self._message = cause, message
        return self._close("completed" if cause == "stop" else "incomplete")

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
