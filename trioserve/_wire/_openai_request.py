"""OpenAI's request bodies as structs: ``/v1/completions``' and
``/v1/chat/completions``' fields (their common ones in one base), each field's bounds,
and llama-server's and vLLM's fields beside OpenAI's. Decoded and read into the engine's
requests by :mod:`._openai`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ._messages import ChatMessage
from ._tools import Tool, ToolChoiceObject

__all__ = [
    "Bias",
    "ChatCompletionRequest",
    "CompletionRequest",
    "JsonSchemaFormat",
    "LoraUse",
    "MaxTokens",
    "Penalty",
    "Priority",
    "ResponseFormat",
    "StreamOptions",
    "Temperature",
    "TopLogprobs",
    "TopP",
    "lora_uses",
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
