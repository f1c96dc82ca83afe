"""What trioserve says to an OpenAI-compatible upstream server, and reads back.

Sans-IO, like the rest of :mod:`trioserve._wire`: the body of a streamed
``POST /v1/completions`` and of llama-server's streamed ``POST /infill``, one SSE
event's data of either turned into a :class:`CompletionEvent`, an error body's
message, an embeddings answer, a rerank answer, and what ``GET /v1/models`` and
llama-server's ``GET /props`` say about the model. The upstream backend
(:mod:`trioserve._backends._upstream`) does the I/O and decides what each answer means
for the request (retry, cooldown, the client's error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from .._core._types import GenerationRequest, SamplingParams

__all__ = [
    "CompletionEvent",
    "EmbeddingsAnswer",
    "ModelDescription",
    "NotJSON",
    "RerankAnswer",
    "base_url",
    "completion_event",
    "completion_payload",
    "decode_embeddings",
    "decode_rerank",
    "error_fields",
    "error_text",
    "infill_event",
    "infill_payload",
    "models_answer",
    "props_answer",
    "rerank_payload",
]

#: stop sequences forwarded upstream (OpenAI and trioserve accept at most 4; the engine
#: applies all of them anyway, so forwarding only saves the upstream some tokens)
_MAX_FORWARDED_STOPS = 4

_decode_json = msgspec.json.decode


def base_url(url: str) -> str:
    """An upstream's base URL as the requests' paths are appended to it."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def completion_payload(
    request: GenerationRequest, *, bos_token: str, extra_body: Mapping[str, object]
) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body for ``request`` (without ``model``)."""
    text = request.prompt
    assert isinstance(text, str)  # (the backend refuses token ids)
    if not request.add_bos and bos_token and text.startswith(bos_token):
        # the text was rendered with the BOS already in it; the upstream's completion
        # endpoint adds one itself
        text = text[len(bos_token) :]
    sampling = request.sampling
    payload: dict[str, Any] = {
        "prompt": text,
        "max_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    if request.stop:
        payload["stop"] = list(request.stop[:_MAX_FORWARDED_STOPS])
    if sampling.logit_bias:
        payload["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    # the penalties and llama.cpp's extras: sent only when asked for (every peer
    # accepts OpenAI's two; llama-server and llama-cpp-python the others)
    payload.update(_penalties(sampling))
    if sampling.top_k != 0:
        payload["top_k"] = sampling.top_k
    if sampling.min_p != 0.0:
        payload["min_p"] = sampling.min_p
    payload.update(extra_body)
    return payload


def _penalties(sampling: SamplingParams) -> dict[str, Any]:
    """The penalties, only where asked for (llama-server's defaults are "off")."""
    payload: dict[str, Any] = {}
    for name, value, default in (
        ("frequency_penalty", sampling.frequency_penalty, 0.0),
        ("presence_penalty", sampling.presence_penalty, 0.0),
        ("repeat_penalty", sampling.repeat_penalty, 1.0),
    ):
        if value != default:
            payload[name] = value
    if sampling.repeat_penalty != 1.0 and sampling.repeat_last_n != 64:
        payload["repeat_last_n"] = sampling.repeat_last_n
    return payload


def infill_payload(request: GenerationRequest, *, extra_body: Mapping[str, object]) -> dict[str, Any]:
    """llama-server's streamed ``/infill`` body for a fill-in-the-middle ``request``
    (without ``model``): its own fields, so the upstream lays out the prompt with its
    model's FIM tokens. The sampling is sent whole (``top_k`` and ``min_p`` too: a
    ``suffix`` completion's 0 is not llama-server's default), the penalties only when
    asked for."""
    infill = request.infill
    assert infill is not None
    assert isinstance(request.prompt, str)
    sampling = request.sampling
    payload: dict[str, Any] = {
        "input_prefix": infill.prefix if isinstance(infill.prefix, str) else list(infill.prefix),
        "input_suffix": infill.suffix if isinstance(infill.suffix, str) else list(infill.suffix),
        "input_extra": [{"filename": filename, "text": text} for filename, text in infill.extra],
        "prompt": request.prompt,
        "n_predict": request.max_tokens if request.max_tokens is not None else -1,
        "stream": True,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "cache_prompt": request.cache_prompt,
    }
    if sampling.seed is not None:
        payload["seed"] = sampling.seed
    if request.stop:
        payload["stop"] = list(request.stop)
    if sampling.samplers is not None:
        payload["samplers"] = list(sampling.samplers)
    if sampling.logit_bias:  # (a suffix completion's; /infill refuses it)
        payload["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    payload.update(_penalties(sampling))
    lines = request.lines
    if lines is not None:
        if lines.n_indent:
            payload["n_indent"] = lines.n_indent
        if lines.t_max_predict is not None:
            payload["t_max_predict_ms"] = round(lines.t_max_predict * 1000)
    payload.update(extra_body)
    return payload


# ------------------------------------------------------------- the streamed answer


class NotJSON(ValueError):
    """An SSE event whose data is not JSON."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionEvent:
    """What one streamed completion chunk says (choice 0 only)."""

    #: the texts to hand on, in order (none: a progress event, the usage chunk)
    texts: tuple[str, ...] = ()
    #: OpenAI's finish_reason, or an upstream trioserve's ``end_cause`` when it has one
    finish_reason: str | None = None
    #: ``(prompt_tokens, completion_tokens)`` from a usage chunk
    usage: tuple[int, int] | None = None
    #: an upstream trioserve's ``trioserve.message``, if the chunk has the extension
    message: str | None = None
    #: whether the chunk has the ``trioserve`` extension (its message then replaces
    #: the one before, even with ``None``)
    has_extension: bool = False
    #: a mid-stream error's text (vLLM and llama-server report them so)
    error: str | None = None
    #: the stream's last event (llama-server's ``/infill`` sends no ``[DONE]``: its
    #: final object, ``"stop": true``, ends it)
    last: bool = False


_NOTHING = CompletionEvent()


def _event_object(data: str) -> dict[str, Any] | CompletionEvent:
    """One SSE event's JSON object, or the event it is without one to read: nothing (not
    an object) or an error.

    Raises:
        NotJSON: the data is not JSON.
    """
    try:
        chunk = _decode_json(data)
    except msgspec.DecodeError:
        raise NotJSON(data) from None
    if not isinstance(chunk, dict):
        return _NOTHING
    error = chunk.get("error")
    if error is not None:
        return CompletionEvent(error=error_text(error))
    return chunk


def _extension_fields(extension: object) -> tuple[Any, str | None]:
    """An upstream trioserve's ``trioserve`` object: its ``message`` and its
    ``end_cause`` (``None``, ``None`` where there is none)."""
    if not isinstance(extension, dict):
        return None, None
    cause = extension.get("end_cause")
    return extension.get("message"), cause if isinstance(cause, str) else None


def completion_event(data: str) -> CompletionEvent:
    """One SSE event's data (not ``[DONE]``) as a :class:`CompletionEvent`.

    Raises:
        NotJSON: the data is not JSON.
    """
    chunk = _event_object(data)
    if isinstance(chunk, CompletionEvent):
        return chunk
    usage = None
    reported = chunk.get("usage")
    if isinstance(reported, dict):
        prompt_tokens, completion_tokens = reported.get("prompt_tokens"), reported.get("completion_tokens")
        if isinstance(prompt_tokens, int) and isinstance(completion_tokens, int):
            usage = (prompt_tokens, completion_tokens)
    extension = chunk.get("trioserve")
    has_extension = isinstance(extension, dict)
    # an upstream trioserve: finish_reason is OpenAI's ("length" for a stream it cut
    # short); why it ended is in its extension
    message, cause = _extension_fields(extension)
    texts: list[str] = []
    finish_reason = None
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue
        text = choice.get("text")
        if text:
            texts.append(text)
        reason = choice.get("finish_reason")
        if reason:
            finish_reason = cause or str(reason)
    return CompletionEvent(
        texts=tuple(texts),
        finish_reason=finish_reason,
        usage=usage,
        message=message,
        has_extension=has_extension,
    )


#: llama-server's ``stop_type`` → the finish reason ("word": a stop sequence)
_STOP_TYPES = {"eos": "stop", "word": "stop", "limit": "length"}


def infill_event(data: str) -> CompletionEvent:
    """One SSE event's data of llama-server's streamed ``/infill`` (its
    ``/completion`` shape: ``content``, ``stop``, ``stop_type``, ``tokens_evaluated``,
    ``tokens_predicted``, ``timings``; or an upstream trioserve's, with its
    ``trioserve.end_cause``) as a :class:`CompletionEvent`.

    Raises:
        NotJSON: the data is not JSON.
    """
    chunk = _event_object(data)
    if isinstance(chunk, CompletionEvent):
        return chunk
    if chunk.get("stop") is not True:
        content = chunk.get("content")
        return CompletionEvent(texts=(content,)) if isinstance(content, str) and content else _NOTHING
    # the final object: its content is not text to hand on (llama-server's is empty;
    # an upstream trioserve's repeats the whole text the deltas carried)
    extension = chunk.get("trioserve")
    message, cause = _extension_fields(extension)
    stop_type = chunk.get("stop_type")
    reason = cause or _STOP_TYPES.get(stop_type if isinstance(stop_type, str) else "", "stop")
    timings = chunk.get("timings")
    timings = timings if isinstance(timings, dict) else {}
    evaluated, predicted = chunk.get("tokens_evaluated"), chunk.get("tokens_predicted")
    if not isinstance(evaluated, int):  # (response_fields may have left them out)
        prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
        evaluated = prompt_n + cache_n if isinstance(prompt_n, int) and isinstance(cache_n, int) else None
    if not isinstance(predicted, int):
        predicted = timings.get("predicted_n")
    usage = (evaluated, predicted) if isinstance(evaluated, int) and isinstance(predicted, int) else None
    return CompletionEvent(
        finish_reason=reason,
        usage=usage,
        message=message if isinstance(message, str) else None,
        has_extension=isinstance(extension, dict),
        last=True,
    )


# ------------------------------------------------------------------------- errors


def error_text(error: object) -> str:
    """A mid-stream ``error`` field's text."""
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def error_fields(data: bytes, status: int) -> tuple[str, str | None, str | None]:
    """(message, param, code) from an error body: OpenAI's ``{"error": {...}}``
    (vLLM, llama-server, trioserve), vLLM's older ``{"message": ...}``, FastAPI's
    ``{"detail": ...}`` (llama-cpp-python's validation errors), or plain text."""
    text = data.decode("utf-8", errors="replace").strip()
    try:
        body = _decode_json(data)
    except msgspec.DecodeError:
        return text[:1000] or f"HTTP {status}", None, None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            param, code = error.get("param"), error.get("code")
            return (
                str(error["message"]),
                str(param) if param is not None else None,
                str(code) if isinstance(code, str) else None,
            )
        if isinstance(error, str):
            return error, None, None
        if isinstance(body.get("message"), str):
            return body["message"], None, None
        detail = body.get("detail")
        if isinstance(detail, str):
            return detail, None, None
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            location = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
            return str(first.get("msg", detail)), location or None, None
    return text[:1000] or f"HTTP {status}", None, None


# --------------------------------------------------------------------- embeddings


class _HasIndex(Protocol):
    @property
    def index(self) -> int: ...


class _Embedding(msgspec.Struct):
    index: int
    embedding: list[float]


class _EmbeddingsUsage(msgspec.Struct):
    prompt_tokens: int = 0


class EmbeddingsAnswer(msgspec.Struct):
    """A ``POST /v1/embeddings`` answer: the vectors, and the usage if it sent one."""

    data: list[_Embedding]
    usage: _EmbeddingsUsage | None = None

    def vectors(self, inputs: int) -> tuple[list[list[float]], int] | None:
        """``(vectors in input order, prompt tokens)``; ``None`` unless there is
        exactly one vector per input."""
        vectors = _in_order(self.data, inputs)
        if vectors is None:
            return None
        return [item.embedding for item in vectors], self.usage.prompt_tokens if self.usage is not None else 0


def _in_order[Indexed: _HasIndex](items: list[Indexed], count: int) -> list[Indexed] | None:
    """An answer's items by their ``index``; ``None`` unless there is exactly one for
    each of ``0 … count − 1`` (embeddings' vectors, rerank's scores)."""
    ordered = sorted(items, key=lambda item: item.index)
    if [item.index for item in ordered] != list(range(count)):
        return None
    return ordered


def _decoding[Answer](decoder: msgspec.json.Decoder[Answer]) -> Callable[[bytes], Answer | None]:
    """``decoder.decode``, with ``None`` for what is not such an answer."""

    def decode(data: bytes) -> Answer | None:
        try:
            return decoder.decode(data)
        except msgspec.DecodeError:  # (ValidationError included)
            return None

    return decode


#: a ``POST /v1/embeddings`` answer, or ``None`` if it is not one
decode_embeddings = _decoding(msgspec.json.Decoder(EmbeddingsAnswer))


# ------------------------------------------------------------------------- rerank


def rerank_payload(query: str, documents: list[str]) -> dict[str, Any]:
    """A ``POST /v1/rerank`` body (without ``model``): every document's score asked
    for (``top_n``: all of them; the relay sorts and cuts)."""
    return {"query": query, "documents": documents, "top_n": len(documents)}


class _RerankResult(msgspec.Struct):
    index: int
    relevance_score: float


class _RerankUsage(msgspec.Struct):
    prompt_tokens: int = 0


class _RerankExtension(msgspec.Struct):
    reranker: str | None = None
    score: str | None = None


class RerankAnswer(msgspec.Struct):
    """A rerank answer (llama-server's and Jina's shape, vLLM's and trioserve's too):
    a score per document by index, the usage if it sent one, and an upstream
    trioserve's word on what its scores are."""

    results: list[_RerankResult]
    usage: _RerankUsage | None = None
    trioserve: _RerankExtension | None = None

    def scores(self, documents: int) -> tuple[list[float], int] | None:
        """``(scores in the documents' order, prompt tokens)``; ``None`` unless there
        is exactly one score per document."""
        results = _in_order(self.results, documents)
        if results is None:
            return None
        scores = [item.relevance_score for item in results]
        return scores, self.usage.prompt_tokens if self.usage is not None else 0


#: a rerank answer, or ``None`` if it is not one
decode_rerank = _decoding(msgspec.json.Decoder(RerankAnswer))


# -------------------------------------------------------------------- the model


@dataclass(kw_only=True, slots=True)
class ModelDescription:
    """What an upstream says about its model."""

    id: str
    context_length: int | None = None
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    #: fields this kind of server needs in every request (llama-server:
    #: ``return_progress``)
    request_fields: dict[str, object] | None = None


def models_answer(body: Any) -> ModelDescription | str:
    """The first model of a ``GET /v1/models`` answer (parsed JSON), or why there is
    none."""
    models = body.get("data") or []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        return "GET /v1/models listed no model"
    model = models[0]
    context = model.get("context_length") or model.get("max_model_len")  # trioserve, vLLM
    return ModelDescription(id=str(model["id"]), context_length=context if isinstance(context, int) else None)


def props_answer(description: ModelDescription, props: object) -> None:
    """Add what llama-server's ``GET /props`` (parsed JSON) says: chat template,
    BOS/EOS text and the real context size."""
    if not isinstance(props, dict):
        return
    trioserve = str(props.get("build_info", "")).startswith("trioserve")  # (its /props: _http/_props.py)
    if isinstance(props.get("default_generation_settings"), dict) and not trioserve:  # llama-server
        # a prompt-progress event (empty text) after every batch: its HTTP thread
        # checks for a closed connection only when a result arrives, else once a
        # second, so without them a client that leaves mid-prompt keeps it
        # computing for up to 1 s more (docs/deployment.md)
        description.request_fields = {"return_progress": True}
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if isinstance(n_ctx, int) and description.context_length is None:
        description.context_length = n_ctx
    for key in ("chat_template", "bos_token", "eos_token"):
        if isinstance(props.get(key), str) and props[key]:
            setattr(description, key, props[key])
