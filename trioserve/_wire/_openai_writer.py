"""The OpenAI wire format's responses, sans-IO: streamed chunks and whole bodies.
Streaming chunks are the per-token hot path, so a :class:`ChunkEncoder` pre-encodes
everything in a chunk except the text: each token costs one JSON string encode and one
concatenation. The requests: :mod:`._openai`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Literal

import msgspec

from .._core._types import EndCause, TokenLogprob, Usage
from ._codec import encode_json
from ._sse import DONE, encode_data
from ._truncation import Dropped

__all__ = [
    "END_MESSAGES",
    "ChoiceResult",
    "ChunkEncoder",
    "error_event",
    "non_stream_response",
    "openai_finish_reason",
    "token_logprobs",
    "trioserve_extension",
]


def openai_finish_reason(cause: EndCause) -> Literal["stop", "length"]:
    """OpenAI's ``finish_reason`` for ``cause``: ``stop`` when the model ended the text
    (its end token, a stop sequence), else ``length`` — the text was cut short (by
    ``max_tokens``, the context, a deadline, shutdown). Strict clients (typed SDKs,
    async-openai) refuse any other value; the real cause goes in the ``trioserve``
    extension field of the chunk and in the log (docs/api.md, "Why a stream ended")."""
    return "stop" if cause == "stop" else "length"


def error_event(error: dict[str, object]) -> bytes:
    """A failure after the stream started: an SSE event holding OpenAI's error object
    (``{"error": {...}}``, which the OpenAI SDKs raise as ``APIError``), then ``[DONE]``."""
    return encode_data(encode_json(error)) + DONE


def _usage_dict(usage: Usage) -> dict[str, object]:
    body: dict[str, object] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    split = usage.cache_split()
    if split is not None:
        body["trioserve"] = {"cached_tokens": split}
    return body


def _token_text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def token_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, object]]:
    """Per token, its text, log-probability, bytes and the most likely alternatives:
    OpenAI's chat ``logprobs.content``, and Ollama's ``logprobs`` (the same shape)."""
    return [
        {
            "token": _token_text(entry.piece),
            "logprob": entry.logprob,
            "bytes": list(entry.piece),
            "top_logprobs": [
                {"token": _token_text(piece), "logprob": logprob, "bytes": list(piece)}
                for piece, logprob in entry.top
            ],
        }
        for entry in entries
    ]


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, object]:
    """OpenAI's chat ``logprobs`` object for ``entries``."""
    return {"content": token_logprobs(entries), "refusal": None}


def text_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, object]:
    """The completions ``logprobs`` object (``text_offset`` counts characters from
    ``offset``, where the text of ``entries`` starts)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(_token_text(entry.piece))
    return {
        "tokens": [_token_text(entry.piece) for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{_token_text(piece): logprob for piece, logprob in entry.top} for entry in entries],
        "text_offset": offsets,
    }


class ChunkEncoder:
    """Encodes one choice's SSE chunks. Everything but the text is encoded once.

    Args:
        kind: ``"text"`` for ``/v1/completions``, ``"chat"`` for ``/v1/chat/completions``.
        model: the model id reported in each chunk.
        include_usage: ``stream_options.include_usage``: every chunk carries
            ``"usage": null`` and a last chunk carries the usage.
        index: the choice's index (``n`` > 1: one encoder per choice, sharing
            ``id`` and ``created`` with the first).
    """

    def __init__(
        self,
        kind: Literal["text", "chat"],
        model: str,
        *,
        include_usage: bool = False,
        index: int = 0,
        first: ChunkEncoder | None = None,
    ) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self.index = index
        self.id: str = first.id if first else ("cmpl-" if kind == "text" else "chatcmpl-") + uuid.uuid4().hex
        #: the request's id (``X-Request-Id``), in trioserve's field of the finish chunk
        self.request_id: str | None = None
        #: what ``truncation: "auto"`` dropped, in the same field (``dropped_turns``…)
        self.truncation: dict[str, int] | None = None
        self.created: int = first.created if first else int(time.time())
        self.model = model
        self._object = "text_completion" if kind == "text" else "chat.completion.chunk"
        #: characters of text sent so far (the completions ``text_offset``)
        self._offset = 0
        head = self._head()
        usage_tail = b',"usage":null' if include_usage else b""
        i = str(index).encode()
        if kind == "text":
            self._prefix = b"data: " + head + b',"choices":[{"index":' + i + b',"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + usage_tail + b"}\n\n"
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":' + i + b',"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]' + usage_tail + b"}\n\n"

    def _head(self) -> bytes:
        return (
            b'{"id":'
            + encode_json(self.id)
            + b',"object":'
            + encode_json(self._object)
            + b',"created":'
            + str(self.created).encode()
            + b',"model":'
            + encode_json(self.model)
        )

    def role(self) -> bytes:
        """The first chat chunk: announces the assistant role."""
        return self._chunk(
            [
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta(self, text: str) -> bytes:
        """One text delta, as complete SSE bytes. The hot path."""
        return self._prefix + encode_json(text) + self._suffix

    def delta_logprobs(self, text: str, entries: Sequence[TokenLogprob]) -> bytes:
        """A text delta with the log-probabilities of the tokens it came from."""
        choice: dict[str, object] = {"index": self.index}
        if self.kind == "text":
            choice["text"] = text
            choice["logprobs"] = text_logprobs(entries, self._offset)
            self._offset += len(text)
        else:
            choice["delta"] = {"content": text}
            choice["logprobs"] = chat_logprobs(entries)
        choice["finish_reason"] = None
        return self._chunk([choice])

    def reasoning_delta(self, text: str) -> bytes:
        """A reasoning model's thinking (``reasoning_content``, as llama-server and vLLM
        send it)."""
        return self._chunk(
            [
                {
                    "index": self.index,
                    "delta": {"reasoning_content": text},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def tool_call_start(self, call_index: int, call_id: str, name: str, arguments: str = "") -> bytes:
        """A tool call begins: its id and name (OpenAI's first chunk of a call)."""
        call = {
            "index": call_index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        return self._chunk(
            [{"index": self.index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}]
        )

    def tool_call_arguments(self, call_index: int, fragment: str) -> bytes:
        """More of a tool call's arguments (JSON text)."""
        call = {"index": call_index, "function": {"arguments": fragment}}
        return self._chunk(
            [{"index": self.index, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}]
        )

    def finish(
        self, cause: EndCause, message: str | None = None, *, finish_reason: str | None = None
    ) -> bytes:
        """This choice's finish chunk (``finish_reason``: e.g. ``tool_calls`` instead of
        ``stop``)."""
        choice: dict[str, object] = {
            "index": self.index,
            "logprobs": None,
            "finish_reason": finish_reason or openai_finish_reason(cause),
        }
        if self.kind == "text":
            choice["text"] = ""
        else:
            choice["delta"] = {}
        extension = trioserve_extension(
            self.request_id, truncation=self.truncation, cause=cause, message=message
        )
        if not extension:
            return self._chunk([choice])
        return self._chunk([choice], trioserve=extension)

    def end(self, usage: Usage) -> bytes:
        """The usage chunk if asked for, and ``[DONE]``."""
        if self.include_usage:
            return self._chunk([], usage=_usage_dict(usage)) + DONE
        return DONE

    def final(
        self, cause: EndCause, usage: Usage, message: str | None = None, *, finish_reason: str | None = None
    ) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        return self.finish(cause, message, finish_reason=finish_reason) + self.end(usage)

    def _chunk(self, choices: list[dict[str, object]], **extra: object) -> bytes:
        body: dict[str, object] = {
            "id": self.id,
            "object": self._object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None
        body.update(extra)
        return encode_data(encode_json(body))


END_MESSAGES: dict[str, str] = {
    "deadline": "the request's deadline passed; the text so far is complete up to here",
    "shutdown": "the server is shutting down; retry on another instance or later",
    "unload": "the model was unloaded (POST /models/unload); the text so far is complete up to here",
    "cancelled": "the request was cancelled by its id (POST /v1/requests/{id}/cancel, or DELETE "
    "/v1/stream for a resumable stream); the text so far is complete up to here",
    "superseded": "a newer request of the same session (X-Session-Id) replaced this one; the text so "
    "far is complete up to here",
    "detach_timeout": "nobody read this resumable stream for the detach timeout (--detach-timeout); the "
    "text so far is complete up to here",
    "evicted": "nobody read this resumable stream and another request needed its slot; the text so far "
    "is complete up to here",
    "error": "inference failed",
}


def trioserve_extension(
    request_id: str | None,
    *,
    truncation: Dropped | dict[str, int] | None = None,
    cause: str | None = None,
    message: str | None = None,
    cached_tokens: int = 0,
) -> dict[str, object]:
    """trioserve's own fields of a response (its ``trioserve`` object; empty: none to
    send): the request's id, the tokens read from cache (where the dialect has no field
    of its own), what truncation dropped, and, where it ended other than by a stop or its
    length, why (``end_cause``) in words a user can act on (``message``)."""
    extension: dict[str, object] = {}
    if request_id is not None:
        extension["request_id"] = request_id
    if cached_tokens:
        extension["cached_tokens"] = cached_tokens
    if truncation is not None:
        extension["truncation"] = truncation.extension() if isinstance(truncation, Dropped) else truncation
    if cause is not None and cause not in ("stop", "length"):
        extension["end_cause"] = cause
        extension["message"] = message or END_MESSAGES.get(cause, "")
    return extension


class ChoiceResult(msgspec.Struct, kw_only=True):
    """One finished choice of a non-streamed response."""

    text: str
    cause: EndCause
    logprobs: list[TokenLogprob] | None = None
    #: (id, name, arguments JSON) of each tool call the text was read as
    tool_calls: list[tuple[str, str, str]] | None = None
    #: the stop sequence that ended the text (``None``: the model's end token, or no stop)
    stop_sequence: str | None = None
    #: a reasoning model's thinking, before the text
    reasoning: str | None = None


def non_stream_response(
    kind: Literal["text", "chat"],
    *,
    model: str,
    text: str = "",
    cause: EndCause = "stop",
    usage: Usage,
    choices: Sequence[ChoiceResult] | None = None,
    request_id: str | None = None,
    truncation: dict[str, int] | None = None,
) -> bytes:
    """The body of a ``stream: false`` response (``choices``, or one from ``text``);
    ``request_id`` and what ``truncation: "auto"`` dropped go in trioserve's field."""
    created = int(time.time())
    results = list(choices) if choices is not None else [ChoiceResult(text=text, cause=cause)]
    out: list[dict[str, object]] = []
    for index, result in enumerate(results):
        if kind == "text":
            logprobs = text_logprobs(result.logprobs) if result.logprobs is not None else None
            out.append(
                {
                    "index": index,
                    "text": result.text,
                    "logprobs": logprobs,
                    "finish_reason": openai_finish_reason(result.cause),
                }
            )
            continue
        message: dict[str, object] = {"role": "assistant", "content": result.text}
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning
        finish: str = openai_finish_reason(result.cause)
        if result.tool_calls:
            message["content"] = None
            message["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                for call_id, name, arguments in result.tool_calls
            ]
            if result.cause == "stop":
                finish = "tool_calls"
        out.append(
            {
                "index": index,
                "message": message,
                "logprobs": chat_logprobs(result.logprobs) if result.logprobs is not None else None,
                "finish_reason": finish,
            }
        )
    body: dict[str, object] = {
        "id": ("cmpl-" if kind == "text" else "chatcmpl-") + uuid.uuid4().hex,
        "object": "text_completion" if kind == "text" else "chat.completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": _usage_dict(usage),
    }
    extension = trioserve_extension(request_id, truncation=truncation)
    if extension:
        body["trioserve"] = extension
    return encode_json(body)
