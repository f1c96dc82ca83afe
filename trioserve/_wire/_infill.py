"""llama-server's ``/infill`` (code completion in the editor: llama.vim, llama.vscode),
request and response: its fields, its defaults, its ``/completion``-shaped answer
(``content``, ``stop_type``, ``timings``, ``response_fields``), streamed or not. The
prompt's layout is the backend's (``_backends/_infill.py``): the editor sends text,
never a template. The design and each field: docs/api.md, "Code completion".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from .._core._exceptions import InvalidRequestError, TrioserveError
from .._core._types import (
    SAMPLER_NAMES,
    EndCause,
    GenerationRequest,
    Infill,
    LineLimits,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from ._codec import decode as _decode
from ._codec import encode_json
from ._limits import RequestLimits
from ._openai import Priority
from ._openai_writer import ChoiceResult, trioserve_extension
from ._refusals import Refusal, check_refused
from ._sse import HEARTBEAT, encode_data

__all__ = ["InfillDialect", "InfillRequest", "decode_infill_request", "infill_parts"]

#: samplers llama-server lists by default that are no-ops at their default parameters
#: (which are the only ones accepted here): accepted in ``samplers`` and skipped
_NO_OP_SAMPLERS = frozenset({"dry", "typ_p", "typical_p", "xtc", "top_n_sigma"})
#: at most this many extra context chunks (llama.vim sends up to 16 by default)
MAX_EXTRA_CHUNKS = 256

Text = str | list[str | int]


class ExtraChunk(msgspec.Struct, kw_only=True):
    text: str
    filename: str = "tmp"
    #: llama.vim's timestamp of the chunk: not used
    time: Any = None


class InfillRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input_prefix: Text
    input_suffix: Text
    input_extra: list[ExtraChunk] = msgspec.field(default_factory=list)
    prompt: str = ""
    #: llama-server's; -1: until the end of sequence (or the context)
    n_predict: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    n_indent: Annotated[int, msgspec.Meta(ge=0)] = 0
    t_max_prompt_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    t_max_predict_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool = False
    # llama-server's sampling defaults
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.8
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 40
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.95
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] = 64
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    samplers: list[str] | str | None = None
    cache_prompt: bool = True
    response_fields: list[str] = msgspec.field(default_factory=list)
    priority: Priority | None = None
    speculate: bool = True
    # known, not honoured: refused unless "not asked for" (_REFUSED)
    id_slot: Any = -1
    n_probs: Any = 0
    ignore_eos: Any = False
    grammar: Any = None
    json_schema: Any = None
    logit_bias: Any = None
    lora: Any = None
    n_keep: Any = 0
    n_discard: Any = 0
    mirostat: Any = 0
    dry_multiplier: Any = 0.0
    xtc_probability: Any = 0.0
    typical_p: Any = 1.0
    return_tokens: Any = False
    timings_per_token: Any = False
    post_sampling_probs: Any = False
    image_data: Any = None


_decoder = msgspec.json.Decoder(InfillRequest)

_REFUSED: tuple[Refusal, ...] = (
    ("id_slot", (-1, None), "there are no slots to choose here: a request takes any free one"),
    (
        "n_probs",
        (0, None),
        "token probabilities are not reported by /infill here (use /v1/completions' logprobs)",
    ),
    ("ignore_eos", (False, None), "the end of sequence is always honoured here"),
    ("grammar", (None, ""), "constrained code completion is not supported; use /v1/completions with grammar"),
    ("json_schema", (None,), "constrained code completion is not supported; use /v1/completions"),
    ("logit_bias", (None, [], {}), "send logit_bias to /v1/completions"),
    ("lora", (None, []), "send lora to /v1/completions (with suffix): /infill runs the base model"),
    ("n_keep", (0, -1, None), "the context is never shifted here: a prompt that does not fit is refused"),
    ("n_discard", (0, None), "the context is never shifted here"),
    ("mirostat", (0, None), "mirostat sampling is not supported"),
    ("dry_multiplier", (0.0, 0, None), "DRY sampling is not supported"),
    ("xtc_probability", (0.0, 0, None), "XTC sampling is not supported"),
    ("typical_p", (1.0, 1, None), "typical sampling is not supported"),
    ("return_tokens", (False, None), "token ids are not returned here"),
    ("timings_per_token", (False, None), "timings come with the final response only"),
    ("post_sampling_probs", (False, None), "token probabilities are not reported by /infill here"),
    ("image_data", (None, []), "code completion takes text only"),
)


def _samplers(given: list[str] | str | None) -> tuple[str, ...] | None:
    """llama-server's ``samplers``: a list of names, or a string of one-letter codes."""
    if given is None:
        return None
    codes = {"k": "top_k", "p": "top_p", "m": "min_p", "t": "temperature", "i": "infill", "e": "penalties"}
    codes |= {"d": "dry", "y": "typ_p", "x": "xtc", "s": "top_n_sigma"}
    names = [codes.get(c, c) for c in given] if isinstance(given, str) else list(given)
    out: list[str] = []
    for name in names:
        canonical = name.replace("-", "_")
        if canonical in _NO_OP_SAMPLERS:
            continue
        if canonical not in SAMPLER_NAMES:
            known = ", ".join(sorted(SAMPLER_NAMES | _NO_OP_SAMPLERS))
            raise InvalidRequestError(
                f"samplers names an unknown sampler {name!r}; known here: {known}", param="samplers"
            )
        out.append(canonical)
    return tuple(out)


def _text_size(value: Text) -> int:
    return len(value) if isinstance(value, str) else sum(len(p) if isinstance(p, str) else 1 for p in value)


def infill_parts(prefix: Text, suffix: Text, extra: Sequence[ExtraChunk] = ()) -> Infill:
    return Infill(prefix=prefix, suffix=suffix, extra=tuple((c.filename, c.text) for c in extra))


def decode_infill_request(body: bytes, limits: RequestLimits) -> tuple[InfillRequest, GenerationRequest]:
    """Parse and check an ``/infill`` body: the request, and the generation it asks
    for (the backend lays out its prompt)."""
    request = _decode(_decoder, body)
    check_refused(request, _REFUSED)
    if len(request.input_extra) > MAX_EXTRA_CHUNKS:
        raise InvalidRequestError(
            f"input_extra may hold at most {MAX_EXTRA_CHUNKS} chunks; got {len(request.input_extra)}",
            param="input_extra",
        )
    for name in ("input_prefix", "input_suffix"):
        value = getattr(request, name)
        if not isinstance(value, str) and any(isinstance(p, int) and p < 0 for p in value):
            raise InvalidRequestError(f"{name} token ids must be ≥ 0", param=name)
    if _text_size(request.input_prefix) + _text_size(request.input_suffix) == 0 and not request.prompt:
        pass  # (an editor's warm-up of its extra context sends both empty: allowed)
    if len(request.stop) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"stop may hold at most {limits.max_stop_sequences} sequences", param="stop"
        )
    predict = request.n_predict if request.n_predict is not None else request.max_tokens
    max_tokens = None if predict is None or predict < 0 else predict
    seed = request.seed if request.seed is not None and request.seed >= 0 else None
    sampling = SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        min_p=request.min_p,
        seed=seed,
        repeat_penalty=request.repeat_penalty,
        repeat_last_n=request.repeat_last_n,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        samplers=_samplers(request.samplers),
    )
    t_max_predict = request.t_max_predict_ms / 1000.0 if request.t_max_predict_ms else None
    lines = LineLimits(n_indent=request.n_indent, t_max_predict=t_max_predict)
    generation = GenerationRequest(
        prompt=request.prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=tuple(s for s in request.stop if s),
        add_bos=False,
        cache_prompt=request.cache_prompt,
        speculate=request.speculate,
        infill=infill_parts(request.input_prefix, request.input_suffix, request.input_extra),
        lines=lines if lines.n_indent or lines.t_max_predict is not None else None,
        # a request for no token is the editor's warm-up of its extra context: it is
        # evaluated in full, whatever its time limit (llama.vim sends 1 ms there)
        first_token_timeout=(
            request.t_max_prompt_ms / 1000.0 if request.t_max_prompt_ms and max_tokens != 0 else None
        ),
    )
    return request, generation


def _stop_type(cause: EndCause, stop_sequence: str | None) -> str:
    if cause == "stop":
        return "word" if stop_sequence else "eos"
    return "limit"


def _nested(paths: Sequence[str], body: dict[str, object]) -> dict[str, object]:
    """llama-server's ``response_fields``: the values at ``a/b`` paths, keyed by path."""
    out: dict[str, object] = {}
    for path in paths:
        current: object = body
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


class _Writer:
    """The one choice of an infill stream."""

    def __init__(self, dialect: InfillDialect) -> None:
        self._dialect = dialect

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        return self._dialect.plain_delta(text)

    def finish(self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None) -> bytes:
        self._dialect.cause = cause
        self._dialect.message = message
        self._dialect.stop_sequence = stop_sequence
        return b""


class InfillDialect:
    """One ``/infill`` response: ``data:`` chunks of ``content`` and a final object
    (``stop: true``, no ``[DONE]``, as llama-server's ``/completion``), or that final
    object alone."""

    heartbeat = HEARTBEAT

    def __init__(self, model: str, request: InfillRequest) -> None:
        self.model = model
        self._request = request
        self.request_id: str | None = None
        self.writers = [_Writer(self)]
        self.cause: EndCause = "stop"
        self.message: str | None = None
        self.stop_sequence: str | None = None
        self._content: list[str] = []
        self._prefix = b'data: {"index":0,"content":'
        self._suffix = b',"tokens":[],"stop":false,"id_slot":-1}\n\n'

    def plain_delta(self, text: str) -> bytes:
        self._content.append(text)
        return self._prefix + encode_json(text) + self._suffix

    def opening(self, prompt_tokens: int) -> bytes:
        return b""

    def end(self, usage: Usage) -> bytes:
        return encode_data(encode_json(self._final("".join(self._content), usage)))

    def stream_error(self, error: TrioserveError) -> bytes:
        return encode_data(encode_json(error.to_dict()))

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        (result,) = choices
        self.cause, self.stop_sequence = result.cause, result.stop_sequence
        return encode_json(self._final(result.text, usage))

    def limit_max_tokens(self, limit: int) -> None:
        """(Its ``n_predict`` is refused above the limit, never held to it.)"""

    def _final(self, content: str, usage: Usage) -> dict[str, object]:
        request = self._request
        evaluated = usage.prompt_tokens - usage.cached_tokens
        prompt_ms = usage.prefill_seconds * 1000.0
        predicted_ms = usage.decode_seconds * 1000.0
        body: dict[str, object] = {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "generation_settings": {
                "n_predict": request.n_predict if request.n_predict is not None else -1,
                "seed": request.seed if request.seed is not None else -1,
                "temperature": request.temperature,
                "top_k": request.top_k,
                "top_p": request.top_p,
                "min_p": request.min_p,
                "n_indent": request.n_indent,
                "t_max_predict_ms": request.t_max_predict_ms or -1,
                "stop": request.stop,
                "stream": request.stream,
                "samplers": request.samplers if request.samplers is not None else [],
            },
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": _stop_type(self.cause, self.stop_sequence),
            "stopping_word": self.stop_sequence or "",
            "tokens_cached": usage.prompt_tokens + usage.completion_tokens,
            "timings": {
                "cache_n": usage.cached_tokens,
                "prompt_n": evaluated,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
                "prompt_per_second": evaluated / usage.prefill_seconds if usage.prefill_seconds else 0.0,
                "predicted_n": usage.completion_tokens,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / usage.completion_tokens
                if usage.completion_tokens
                else 0.0,
                "predicted_per_second": (
                    usage.completion_tokens / usage.decode_seconds if usage.decode_seconds else 0.0
                ),
            },
        }
        if request.response_fields:
            body = _nested(request.response_fields, body)
        extension = trioserve_extension(self.request_id, cause=self.cause, message=self.message)
        if extension and not request.response_fields:
            body["trioserve"] = extension
        elif "end_cause" in extension:
            body["trioserve"] = extension  # (why it ended early is always said)
        return body
