"""The OpenAI wire format's requests, sans-IO: request schemas in, engine requests out.

Requests are decoded and validated by msgspec in one pass (unknown fields ignored, as
OpenAI's own clients expect); errors come back as :class:`InvalidRequestError` naming the
offending field. The request structs: :mod:`._openai_request`; the fields both
endpoints share, read: :mod:`._openai_fields`. The responses: :mod:`._openai_writer` (its
names are here too, for the readers that know them from here).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .._core._exceptions import InvalidRequestError
from .._core._media import Media
from .._core._types import GenerationRequest, Infill
from ._codec import decode as _decode
from ._codec import encode_json
from ._limits import RequestLimits
from ._media import MediaCollector
from ._messages import CallFunction, ChatMessage, ContentPart, MessageToolCall, take_images
from ._openai_fields import DEFAULT_LIMITS, _constraint, _logit_bias, _sampling, _stops
from ._openai_request import ChatCompletionRequest, CompletionRequest, Priority, _CommonFields, lora_uses
from ._openai_writer import ChoiceResult, ChunkEncoder, error_event, non_stream_response, openai_finish_reason
from ._refusals import Refusal, check_refused
from ._tools import call_constraint, check_tool_choice, check_tools, chosen_tool

__all__ = [
    "DEFAULT_LIMITS",
    "CallFunction",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceResult",
    "ChunkEncoder",
    "CompletionRequest",
    "ContentPart",
    "MessageToolCall",
    "Priority",
    "decode_chat_request",
    "decode_completion_prompts",
    "decode_completion_request",
    "encode_json",
    "error_event",
    "non_stream_response",
    "openai_finish_reason",
]


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


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
        chosen_tool(mode, request.tools or ())
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
