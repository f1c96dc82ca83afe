"""The OpenAI wire format's requests, sans-IO: request schemas in, engine requests out.

Requests are decoded and validated by msgspec in one pass (unknown fields ignored, as
OpenAI's own clients expect); errors come back as :class:`InvalidRequestError` naming the
offending field. The responses: :mod:`._openai_writer` (its names are here too, for
the readers that know them from here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._media import Media
from .._core._types import Constraint, GenerationRequest, Infill, SamplingParams
from ._codec import decode as _decode
from ._codec import encode_json
from ._constraints import ANY_OBJECT, json_schema_constraint
from ._limits import RequestLimits, top_level_entries
from ._media import MediaCollector
from ._messages import CallFunction, ChatMessage, ContentPart, MessageToolCall, take_images
from ._openai_writer import (
    ChoiceResult,
    ChunkEncoder,
    error_event,
    non_stream_response,
    openai_finish_reason,
)
from ._refusals import Refusal, check_refused
from ._tools import Tool, ToolChoiceObject, call_constraint, check_tool_choice, check_tools

__all__ = [
    "CallFunction",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceResult",
    "ChunkEncoder",
    "CompletionRequest",
    "ContentPart",
    "MessageToolCall",
    "decode_chat_request",
    "decode_completion_prompts",
    "decode_completion_request",
    "encode_json",
    "error_event",
    "non_stream_response",
    "openai_finish_reason",
]


Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
#: a request's place in the queue: lower first (vLLM's ``priority``); the key's default
#: when absent (docs/scheduling.md)
Priority = Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    #: OpenAI's field is ``schema``
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    #: llama-server's ``{"type": "json_object", "schema": {...}}``
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class LoraUse(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """llama-server's ``lora`` entry: an adapter by its id (``GET /lora-adapters``)."""

    id: Annotated[int, msgspec.Meta(ge=0)]
    scale: Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)] = 1.0


class _CommonFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    #: counted before it is decoded (``_logit_bias``): its entries are limited
    logit_bias: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    response_format: ResponseFormat | None = None
    #: llama.cpp's sampling fields (llama-server's names and meanings)
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    repeat_last_n: Annotated[int, msgspec.Meta(ge=-1)] = 64
    #: llama-server's field: ``false`` neither reuses nor leaves a cached prefix
    cache_prompt: bool = True
    #: trioserve's: ``false`` decodes this request one token per call, without guessing
    #: ahead (speculative decoding; the text at temperature 0 is the same either way)
    speculate: bool = True
    #: vLLM's: the request's priority, lower first (docs/scheduling.md)
    priority: Priority | None = None
    #: llama-server's constraint fields: a JSON Schema, a GBNF grammar
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    #: an end-user identifier: accepted and not used (ignored, like prompt_cache_key
    #: and safety_identifier: identifiers every client may send)
    user: str | None = None
    #: llama-server's: ``false``: this request's reasoning cannot be ended on request
    #: (``POST /v1/chat/completions/control``); absent or ``true``: it can
    reasoning_control: bool | None = None
    #: llama-server's: LoRA adapters by id, with their scales (docs/lora.md); none:
    #: the base model (or the adapter ``model`` names)
    lora: Annotated[list[LoraUse], msgspec.Meta(max_length=16)] | None = None


def lora_uses(request: _CommonFields) -> tuple[tuple[str | int, float | None], ...]:
    """The request's ``lora`` as :attr:`GenerationRequest.lora`."""
    return tuple((use.id, use.scale) for use in request.lora or ())


class CompletionRequest(_CommonFields, kw_only=True):
    #: a text, token ids, or a batch of either (one choice per prompt, × ``n``)
    prompt: str | list[str | int | list[int]]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    # the chat endpoint's (refused here: _CHAT_ONLY)
    messages: Any = None
    max_completion_tokens: Any = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class ChatCompletionRequest(_CommonFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    #: trioserve's (the Responses API's field): ``auto`` drops whole oldest turns until
    #: the prompt fits the context; absent: the server's ``--truncation``
    truncation: Literal["auto", "disabled"] | None = None
    # known, not honoured: refused when set to anything but "not asked for" (_REFUSED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    service_tier: Any = None
    metadata: Any = None
    # identifiers: accepted and not used (ignored)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # the completions endpoint's (refused here: _COMPLETIONS_ONLY)
    prompt: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None

    def tool_mode(self) -> Literal["none", "auto", "required"] | str:
        """``none``, ``auto``, ``required``, or the name of the function to call."""
        if not self.tools:
            return "none"
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            return choice
        return choice.function.name


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


#: the limits a decoder applies when its caller passes none
DEFAULT_LIMITS = RequestLimits()


#: fields trioserve knows and does not honour: (name, the values that mean "not asked
#: for", why it is refused). Any other value gets a 400 naming the field
#: (docs/api.md, "Request fields").
_REFUSED: tuple[Refusal, ...] = (
    ("echo", (None, False), "add the prompt to the text yourself"),
    ("best_of", (None, 1), "use n and pick on the client"),
    ("functions", (None, []), "the field is deprecated; send tools"),
    ("function_call", (None,), "the field is deprecated; send tool_choice"),
    ("audio", (None,), "this server generates text only"),
    ("modalities", (None, ["text"]), "only the text modality exists here"),
    ("prediction", (None,), "there are no predicted outputs here"),
    ("web_search_options", (None,), "this server cannot search the web"),
    ("reasoning_effort", (None, "none"), "the model has no reasoning mode"),
    # "medium" is OpenAI's default
    ("verbosity", (None, "medium"), "the model has no verbosity control"),
    ("store", (None, False), "completions are not stored here"),
    ("service_tier", (None, "auto", "default"), "only the default service tier exists here"),
    ("metadata", (None, {}), "it is only kept with store, which is not supported"),
)

#: the other endpoint's fields, sent to this one: refused, naming the right field
#: (a client that sends ``max_completion_tokens`` to /v1/completions would otherwise
#: get 16 tokens and no word why)
_CHAT_ONLY = {
    "messages": "send prompt",
    "max_completion_tokens": "send max_tokens",
    "top_logprobs": "send logprobs (an integer: how many alternatives)",
    "tools": "tools are a chat completions field",
    "tool_choice": "tools are a chat completions field",
    "parallel_tool_calls": "tools are a chat completions field",
}
_COMPLETIONS_ONLY = {
    "prompt": "send messages",
    "echo": "echo is a completions field (and not supported)",
    "suffix": "suffix is a completions field (fill in the middle: send prompt and suffix there)",
    "best_of": "best_of is a completions field (and not supported)",
}


def _check_common(request: _CommonFields) -> None:
    chat = isinstance(request, ChatCompletionRequest)
    for name, hint in (_COMPLETIONS_ONLY if chat else _CHAT_ONLY).items():
        if getattr(request, name, None) is not None:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise InvalidRequestError(f"{endpoint} has no field {name}: {hint}", param=name)
    check_refused(request, _REFUSED)


def _stops(stop: str | list[str] | None, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    limits.check_stops(stops, "stop", openai=True)
    return tuple(s for s in stops if s)


_bias_decoder = msgspec.json.Decoder(dict[str, Bias] | None)


def _logit_bias(raw: msgspec.Raw, limits: RequestLimits = DEFAULT_LIMITS) -> dict[int, float]:
    """The ``logit_bias`` field, counted (``--max-logit-bias``) before it is decoded."""
    data = bytes(raw)
    if not data:
        return {}
    limits.check_count(
        "logit_bias", top_level_entries(data), limits.max_logit_bias, "--max-logit-bias", "logit_bias"
    )
    try:
        bias = _bias_decoder.decode(data)
    except msgspec.ValidationError as exc:  # (its path, as the whole body's would be)
        message, _, path = str(exc).partition(" - at `$")
        param = "logit_bias" + path.rstrip("`")
        raise InvalidRequestError(f"{message} at `{param}`", param=param) from None
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


def _sampling(request: _CommonFields, limits: RequestLimits = DEFAULT_LIMITS) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        logit_bias=_logit_bias(request.logit_bias, limits),
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        repeat_penalty=request.repeat_penalty,
        repeat_last_n=request.repeat_last_n,
    )


def _constraint(request: _CommonFields, limits: RequestLimits = DEFAULT_LIMITS) -> Constraint | None:
    """The constraint ``response_format`` (or llama-server's ``json_schema``/``grammar``)
    asks for; at most one of them (a schema no larger than ``limits`` allow)."""
    asked: list[tuple[str, Constraint]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            schema = fmt.schema_
            source = ANY_OBJECT if schema is None else msgspec.json.encode(schema).decode()
            constraint = json_schema_constraint(source, "response_format.schema", limits)
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema (a JSON Schema object)",
                    param="response_format.json_schema.schema",
                )
            source = msgspec.json.encode(fmt.json_schema.schema_).decode()
            constraint = json_schema_constraint(source, "response_format.json_schema.schema", limits)
        asked.append(("response_format", constraint))
    if request.json_schema is not None:
        source = msgspec.json.encode(request.json_schema).decode()
        asked.append(("json_schema", json_schema_constraint(source, "json_schema", limits)))
    if request.grammar:
        size = len(request.grammar.encode())
        if size > limits.max_schema_bytes:
            raise InvalidRequestError(
                f"grammar is {size} bytes; this server accepts at most "
                f"{limits.max_schema_bytes} (--max-schema-bytes)",
                param="grammar",
            )
        asked.append(("grammar", Constraint(kind="gbnf", source=request.grammar)))
    if len(asked) > 1:
        raise InvalidRequestError(
            f"send one constraint, not {' and '.join(name for name, _ in asked)}", param=asked[1][0]
        )
    return asked[0][1] if asked else None


def _completion_prompts(
    prompt: str | list[str | int | list[int]], n: int = 1, limits: RequestLimits = DEFAULT_LIMITS
) -> list[str | list[int]]:
    """The prompts of a ``/v1/completions`` body: a text, token ids, or a batch (a list
    of texts or of token-id lists, as OpenAI and llama-server accept)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(item, int) for item in prompt):
        prompts = [[int(item) for item in prompt]]  # type: ignore[arg-type]
    elif prompt and all(isinstance(item, str) for item in prompt):
        prompts = [str(item) for item in prompt]
    elif prompt and all(isinstance(item, list) for item in prompt):
        prompts = [list(item) for item in prompt]  # type: ignore[arg-type]
    elif not prompt:
        prompts = [[]]
    else:
        raise InvalidRequestError(
            "prompt must be a string, a list of token ids, or a batch: a list of strings or a "
            "list of token-id lists (not a mix)",
            param="prompt",
        )
    # (each prompt takes n choices: the response, and the slots, hold prompts × n)
    limit = limits.max_batch_choices
    if len(prompts) > limit:
        raise InvalidRequestError(
            f"a batch may hold at most {limit} prompts (--max-batch-choices); got {len(prompts)}",
            param="prompt",
        )
    if len(prompts) * n > limit:
        raise InvalidRequestError(
            f"a batch of {len(prompts)} prompts × n={n} asks for {len(prompts) * n} choices; this server "
            f"accepts at most {limit} (--max-batch-choices)",
            param="n",
        )
    for index, item in enumerate(prompts):
        if item == "" or item == []:
            where = "" if len(prompts) == 1 else f" (prompt {index} of the batch)"
            raise InvalidRequestError(f"prompt must not be empty{where}", param="prompt")
    return prompts


def decode_completion_prompts(
    body: bytes, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[CompletionRequest, list[GenerationRequest]]:
    """Parse and validate a ``/v1/completions`` body: one generation per prompt (a
    batch has several; the response has ``n`` choices per prompt, prompt by prompt)."""
    request = _decode(_completion_decoder, body)
    _check_common(request)
    prompts = _completion_prompts(request.prompt, request.n, limits)
    infill = _suffix_infill(request, prompts)
    if infill is not None:
        prompts = [""]  # (the prompt is the text before the cursor: the middle starts empty)
    sampling = _sampling(request, limits)
    stops = _stops(request.stop, limits)
    constraint = _constraint(request, limits)
    generations = [
        GenerationRequest(
            prompt=prompt,
            max_tokens=16 if request.max_tokens is None else request.max_tokens,
            sampling=sampling,
            stop=stops,
            cache_prompt=request.cache_prompt,
            speculate=request.speculate,
            constraint=constraint,
            logprobs=request.logprobs,
            infill=infill,
            add_bos=infill is None,
            lora=lora_uses(request),
        )
        for prompt in prompts
    ]
    return request, generations


def _suffix_infill(request: CompletionRequest, prompts: list[str | list[int]]) -> Infill | None:
    """OpenAI's ``suffix`` (Continue, Tabby): fill in the middle, the prompt before the
    cursor and the suffix after it, laid out by the backend as ``/infill`` lays them
    out (the same prompt tokens); ``None`` without a suffix."""
    suffix = request.suffix
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise InvalidRequestError("suffix must be a string: the text after the cursor", param="suffix")
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise InvalidRequestError(
            "with suffix, prompt must be one string (the text before the cursor)", param="prompt"
        )
    return Infill(prefix=prompts[0], suffix=suffix)


def decode_completion_request(
    body: bytes, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[CompletionRequest, GenerationRequest]:
    """Parse and validate a ``/v1/completions`` body of one prompt (a batch is refused:
    :func:`decode_completion_prompts` takes both)."""
    request, generations = decode_completion_prompts(body, limits)
    if len(generations) != 1:
        raise InvalidRequestError("send one prompt (this call takes no batch)", param="prompt")
    return request, generations[0]


def check_messages(messages: Sequence[ChatMessage], limits: RequestLimits, param: str = "messages") -> None:
    """Refuse more messages, or content parts, than ``limits`` allow."""
    limits.check_count(param, len(messages), limits.max_messages, "--max-messages", param)
    parts = sum(len(m.content) for m in messages if isinstance(m.content, list))
    if parts > limits.max_content_parts:
        raise InvalidRequestError(
            f"{param} hold {parts} content parts; this server accepts at most {limits.max_content_parts} "
            "(--max-content-parts)",
            param=param,
        )


def decode_chat_request(
    body: bytes, limits: RequestLimits = DEFAULT_LIMITS, media: MediaCollector | None = None
) -> ChatCompletionRequest:
    """Parse and validate a ``/v1/chat/completions`` body (the prompt is rendered later,
    by the model's chat template) within ``limits``. Its images go to ``media`` (each
    image part becomes a text part holding its marker: docs/vision.md)."""
    request = _decode(_chat_decoder, body)
    _check_common(request)
    if not request.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    check_messages(request.messages, limits)
    # (refuses every part that is neither text nor an image, naming it)
    take_images(request.messages, media if media is not None else MediaCollector(limits))
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    # checked here, not only when the generation is built: a refusal before any rendering
    _stops(request.stop, limits)
    _logit_bias(request.logit_bias, limits)
    _constraint(request, limits)
    if request.tools:
        check_tools(request.tools, limits)
    check_tool_choice(request.tool_choice)
    mode = request.tool_mode()
    if mode not in ("none", "auto", "required"):
        names = [tool.function.name for tool in request.tools or ()]
        if mode not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {mode!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )
    elif request.tool_choice is not None and not request.tools and request.tool_choice != "none":
        raise InvalidRequestError(f"tool_choice {request.tool_choice!r} needs tools", param="tool_choice")
    fmt = request.response_format
    asks_constraint = (
        (fmt is not None and fmt.type != "text") or request.json_schema is not None or request.grammar
    )
    if mode not in ("none", "auto") and asks_constraint:
        raise InvalidRequestError(
            "a forced tool call cannot also follow response_format; send one of them", param="tool_choice"
        )
    return request


def chat_generation(
    request: ChatCompletionRequest,
    prompt: str,
    extra_stops: Sequence[str],
    *,
    add_bos: bool = True,
    limits: RequestLimits = DEFAULT_LIMITS,
    images: tuple[Media, ...] = (),
) -> GenerationRequest:
    """The generation for a chat request whose messages were rendered to ``prompt``
    (``add_bos=False`` when the template already wrote the BOS token); ``images``: the
    ones its markers name."""
    max_tokens = request.max_completion_tokens or request.max_tokens
    mode = request.tool_mode()
    constraint = _constraint(request, limits)
    if mode == "required":
        constraint = call_constraint(request.tools or ())
    elif mode not in ("none", "auto"):
        constraint = call_constraint([tool for tool in request.tools or () if tool.function.name == mode])
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,  # None: until the context is full
        sampling=_sampling(request, limits),
        stop=_stops(request.stop, limits) + tuple(extra_stops),
        add_bos=add_bos,
        cache_prompt=request.cache_prompt,
        speculate=request.speculate,
        constraint=constraint,
        logprobs=logprobs,
        images=images,
        lora=lora_uses(request),
    )
