"""The ``Response`` object one Responses response writes — in its events
(``response.created``, ``response.completed``…), as a whole body, and as the store keeps
it — with the request echoed in it, its usage and trioserve's extension. The base of
:class:`~trioserve._wire._responses_writer.ResponsesDialect`."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .._core._exceptions import TrioserveError
from .._core._types import EndCause, Usage
from ._choices import ChoiceReader, ToolMode
from ._conversation import new_id
from ._openai_writer import ChoiceResult, trioserve_extension
from ._responses_request import ResponsesRequest, ToolChoiceFunction
from ._truncation import Dropped

__all__ = ["ResponseObject"]


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


class ResponseObject:
    """One Responses response's state and its ``Response`` object."""

    #: its choice writers: the dialect itself (one choice)
    writers: Sequence[ResponseObject]

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
        extension = trioserve_extension(
            self.request_id,
            truncation=self._dropped,
            cause=None if status in ("in_progress", "queued") else self._cause,
            message=self._message,
        )
        if extension:
            body["trioserve"] = extension
        if status not in ("in_progress", "queued"):
            self.final = body
        return body


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
