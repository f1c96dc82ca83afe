"""The OpenAI wire format, sans-IO: request schemas in, response bytes out.

Requests are decoded and validated by msgspec in one pass (unknown fields ignored, as
OpenAI's own clients expect); errors come back as :class:`InvalidRequestError` naming the
offending field. Responses are shaped here too. Streaming chunks are the per-token hot
path, so a :class:`ChunkEncoder` pre-encodes everything in a chunk except the text: each
token costs one JSON string encode and one concatenation.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._types import EndCause, GenerationRequest, SamplingParams, Usage
from ._sse import DONE, encode_data

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChunkEncoder",
    "CompletionRequest",
    "decode_chat_request",
    "decode_completion_request",
    "encode_json",
    "non_stream_response",
]

encode_json = msgspec.json.Encoder().encode

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _CommonFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, Bias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    #: llama-server's field: ``false`` neither reuses nor leaves a cached prefix
    cache_prompt: bool = True


class CompletionRequest(_CommonFields, kw_only=True):
    prompt: str | list[str | int]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported; send text",
                    param="messages",
                )
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_CommonFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def _decode[T](decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1) if match else None
        if match:
            message = message[: match.start()] + (f" at `{param}`" if param else "")
        if message.startswith("Expected `object`, got") and param is None:
            message = "the request body must be a JSON object; " + message[0].lower() + message[1:]
        raise InvalidRequestError(message, param=param or None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec < 0.23 raises UnicodeDecodeError for bad UTF-8, 0.23 a DecodeError
        # ("Invalid UTF-8 encoded string"): find the offending byte ourselves (only on
        # this error path), so the message is the same with either.
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            byte = bad.object[bad.start]
            raise InvalidRequestError(
                f"the request body is not valid UTF-8: byte 0x{byte:02x} at offset {bad.start}"
            ) from None
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


def _check_common(request: _CommonFields) -> None:
    if request.n != 1:
        raise InvalidRequestError(
            f"n={request.n} is not supported: trioserve returns one choice per request; "
            "send n=1 (or omit it) and make several requests instead",
            param="n",
        )


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 4:
        raise InvalidRequestError("at most 4 stop sequences are allowed", param="stop")
    return tuple(s for s in stops if s)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers as strings); got {key!r}",
                param="logit_bias",
            ) from None
        if token < 0:
            raise InvalidRequestError(f"logit_bias key {key!r} is not a valid token id", param="logit_bias")
        out[token] = value
    return out


def _sampling(request: _CommonFields) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        logit_bias=_logit_bias(request.logit_bias),
    )


def decode_completion_request(body: bytes) -> tuple[CompletionRequest, GenerationRequest]:
    """Parse and validate a ``/v1/completions`` body."""
    request = _decode(_completion_decoder, body)
    _check_common(request)
    prompt: str | list[int]
    if isinstance(request.prompt, str):
        prompt = request.prompt
    elif all(isinstance(item, int) for item in request.prompt) and request.prompt:
        prompt = [int(item) for item in request.prompt]
    elif len(request.prompt) == 1 and isinstance(request.prompt[0], str):
        prompt = request.prompt[0]
    else:
        raise InvalidRequestError(
            "prompt must be a string, a list with one string, or a list of token ids; "
            "batches of prompts are not supported (send one request per prompt)",
            param="prompt",
        )
    if prompt == "" or prompt == []:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    generation = GenerationRequest(
        prompt=prompt,
        max_tokens=16 if request.max_tokens is None else request.max_tokens,
        sampling=_sampling(request),
        stop=_stops(request.stop),
        cache_prompt=request.cache_prompt,
    )
    return request, generation


def decode_chat_request(body: bytes) -> ChatCompletionRequest:
    """Parse and validate a ``/v1/chat/completions`` body (the prompt is rendered later,
    by the model's chat template)."""
    request = _decode(_chat_decoder, body)
    _check_common(request)
    if not request.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    for message in request.messages:
        message.text()  # rejects unsupported content parts early
    return request


def chat_generation(
    request: ChatCompletionRequest, prompt: str, extra_stops: Sequence[str], *, add_bos: bool = True
) -> GenerationRequest:
    """The generation for a chat request whose messages were rendered to ``prompt``
    (``add_bos=False`` when the template already wrote the BOS token)."""
    max_tokens = request.max_completion_tokens or request.max_tokens
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,  # None: until the context is full
        sampling=_sampling(request),
        stop=_stops(request.stop) + tuple(extra_stops),
        add_bos=add_bos,
        cache_prompt=request.cache_prompt,
    )


def _finish_reason(cause: EndCause) -> str:
    return cause


def _usage_dict(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ChunkEncoder:
    """Encodes one stream's SSE chunks. Everything but the text is encoded once.

    Args:
        kind: ``"text"`` for ``/v1/completions``, ``"chat"`` for ``/v1/chat/completions``.
        model: the model id reported in each chunk.
        include_usage: ``stream_options.include_usage``: every chunk carries
            ``"usage": null`` and a last chunk carries the usage.
    """

    def __init__(self, kind: Literal["text", "chat"], model: str, *, include_usage: bool = False) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self.id = ("cmpl-" if kind == "text" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self._object = "text_completion" if kind == "text" else "chat.completion.chunk"
        head = self._head()
        usage_tail = b',"usage":null' if include_usage else b""
        if kind == "text":
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + usage_tail + b"}\n\n"
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
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
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta(self, text: str) -> bytes:
        """One text delta, as complete SSE bytes. The hot path."""
        return self._prefix + encode_json(text) + self._suffix

    def final(self, cause: EndCause, usage: Usage, message: str | None = None) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        choice: dict[str, object] = {"index": 0, "logprobs": None, "finish_reason": _finish_reason(cause)}
        if self.kind == "text":
            choice["text"] = ""
        else:
            choice["delta"] = {}
        extra: dict[str, object] = {}
        if cause not in ("stop", "length"):
            # trioserve's own field: why the stream ended, in words a user can act on.
            extra["trioserve"] = {"end_cause": cause, "message": message or _END_MESSAGES.get(cause, "")}
        out = self._chunk([choice], **extra)
        if self.include_usage:
            out += self._chunk([], usage=_usage_dict(usage))
        return out + DONE

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


_END_MESSAGES: dict[str, str] = {
    "deadline": "the request's deadline passed; the text so far is complete up to here",
    "shutdown": "the server is shutting down; retry on another instance or later",
    "error": "inference failed",
}


def non_stream_response(
    kind: Literal["text", "chat"],
    *,
    model: str,
    text: str,
    cause: EndCause,
    usage: Usage,
) -> bytes:
    """The body of a ``stream: false`` response."""
    created = int(time.time())
    if kind == "text":
        body: dict[str, object] = {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(cause)}],
            "usage": _usage_dict(usage),
        }
    else:
        body = {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": _finish_reason(cause),
                }
            ],
            "usage": _usage_dict(usage),
        }
    return encode_json(body)
