"""A dialect as data: :class:`DialectSpec`, the small frozen record the HTTP layer picks
once per route (its request decoder, its error body, the names its errors use), and
:class:`ParsedRequest`, what its decoder hands back (what to run, and the
:class:`~trioserve._wire._dialect.Dialect` that writes the answer). The HTTP layer never
asks which dialect it has: it calls what the spec holds. The specs themselves:
:mod:`._inbound`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from .._core._exceptions import InvalidRequestError, TrioserveError
from .._core._types import GenerationRequest
from ._chat import ChatFormat, ChatPrompt
from ._choices import ToolMode
from ._conversation import Conversation
from ._dialect import Dialect
from ._limits import RequestLimits
from ._responses import StoredAsk, StoredContext
from ._truncation import Truncation, TruncationMode

if TYPE_CHECKING:
    from ._responses_writer import StoredTurn

__all__ = [
    "CountReader",
    "DialectSpec",
    "ErrorBody",
    "ModelResolver",
    "ParsedRequest",
    "ReadOptions",
    "RequestReader",
    "StoredAsk",
    "StoredContext",
    "ToolsAndReasoning",
    "conversation_request",
    "openai_error_body",
    "tools_and_reasoning",
]

#: ``(status, body)`` of an error response, in a dialect's own shape
ErrorBody = Callable[[TrioserveError], tuple[int, dict[str, object]]]


def openai_error_body(exc: TrioserveError) -> tuple[int, dict[str, object]]:
    """OpenAI's error body (every dialect but Anthropic's): the error's own status."""
    return exc.status, exc.to_dict()


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """What a request decoder needs from the server: its limits, and the name a
    requested model answers to (an alias resolves to the model's own; an unknown one
    raises — after the body decoded, so a bad body is reported first)."""

    limits: RequestLimits
    model_name: Callable[[str | None], str]
    #: keep Claude Code's billing header in the prompt (docs/dialects.md)
    keep_billing_header: bool = False
    #: the response store's answer for this request; ``None``: the server stores no
    #: responses (``store``, ``previous_response_id`` and ``background`` are refused)
    stored: StoredContext | None = None
    #: what a conversation that does not fit the context gets when its request does
    #: not say (``--truncation``; docs/dialects.md, "Truncation")
    truncation: TruncationMode = "disabled"
    #: ``time.perf_counter()`` when the request arrived, and the seconds it waited for
    #: its model's load: for a dialect that reports durations (Ollama's)
    arrived: float | None = None
    load_seconds: float = 0.0
    #: the model's context per sequence (``None``: not known)
    context_length: int | None = None
    #: the model's TTL after this request (a body's ``keep_alive``, ``X-Keep-Alive``)
    keep_alive: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A generation request, decoded: what to run and how to answer."""

    stream: bool
    #: one per prompt (``/v1/completions`` takes a batch)
    generations: tuple[GenerationRequest, ...]
    model: str
    #: how the response is written
    dialect: Dialect
    n: int = 1
    tool_mode: ToolMode = "none"
    tool_names: tuple[str, ...] = ()
    #: ``False``: at most one tool call per choice (parallel tool calls turned off)
    parallel_calls: bool = True
    #: a reasoning model's markers (its thinking is read out of the text), and whether
    #: the prompt opened its reasoning
    reasoning: tuple[str, str] | None = None
    inside: bool = False
    #: what to store once the response is written (``None``: it is not stored)
    turn: StoredTurn | None = None
    #: the body's ``priority`` (``None``: the API key's default)
    priority: int | None = None
    #: a conversation's overflow policy, and how to build it from fewer turns
    #: (``None``: a request that is not a conversation)
    truncation: Truncation | None = None

    @property
    def loads_only(self) -> bool:
        """Nothing to generate: the request only loads its model (Ollama's empty prompt);
        its answer is the dialect's ``body`` of no choice."""
        return not self.generations

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]

    @property
    def choices(self) -> int:
        """The response's choices: ``n`` per prompt."""
        return self.n * len(self.generations)

    @property
    def plain(self) -> bool:
        """Text only, one choice: the hot path."""
        return (
            self.choices == 1
            and self.tool_mode == "none"
            and self.generation.logprobs is None
            and self.reasoning is None
        )


class ToolsAndReasoning(TypedDict):
    """How a conversation's answer is read: its tools (the mode, their names, one call or
    several) and its reasoning (the markers, and whether the prompt opened it) — the
    keywords of a conversation dialect and of its :class:`ParsedRequest`."""

    tool_mode: ToolMode
    tool_names: tuple[str, ...]
    parallel_calls: bool
    reasoning: tuple[str, str] | None
    inside: bool


def tools_and_reasoning(conversation: Conversation, rendered: ChatPrompt) -> ToolsAndReasoning:
    """The tool and reasoning facts ``conversation`` and its rendered prompt give."""
    return ToolsAndReasoning(
        tool_mode=conversation.tool_mode,
        tool_names=conversation.tool_names,
        parallel_calls=conversation.parallel_calls,
        reasoning=rendered.reasoning,
        inside=rendered.opens_reasoning,
    )


def conversation_request(
    stream: bool,
    generation: GenerationRequest,
    model: str,
    dialect: Dialect,
    conversation: Conversation,
    rendered: ChatPrompt,
    *,
    turn: StoredTurn | None = None,
    priority: int | None = None,
    truncation: Truncation | None = None,
) -> ParsedRequest:
    """What a conversation dialect (Messages, Responses, Ollama's chat) asks for: one
    generation, and the tool and reasoning facts its conversation and rendered prompt
    give."""
    return ParsedRequest(
        turn=turn,
        priority=priority,
        truncation=truncation,
        stream=stream,
        generations=(generation,),
        model=model,
        dialect=dialect,
        **tools_and_reasoning(conversation, rendered),
    )


class ModelResolver(Protocol):
    """How a dialect's requested model name resolves: ``resolve`` (the server's lookup,
    which raises for an unknown name) applied to the name it means."""

    def __call__(self, requested: str | None, resolve: Any, /) -> Any: ...


#: decodes a request body into what to run (``ChatFormat``: the model's chat template)
RequestReader = Callable[[bytes, ChatFormat, ReadOptions], ParsedRequest]
#: decodes a token-counting body into the model it names and its conversation
CountReader = Callable[[bytes, ReadOptions], tuple[str | None, Conversation]]


@dataclass(frozen=True, slots=True)
class DialectSpec:
    """One API dialect (one generation route), as data."""

    #: the route's kind, as the request log and metrics name it
    kind: str
    #: its error body: OpenAI's, or Anthropic's (a full queue is 529 there)
    error_body: ErrorBody
    #: its request decoder (``None``: a dialect served by no generation route here)
    read: RequestReader | None = None
    #: the engine's field names that this dialect calls otherwise, renamed in its errors
    #: (Responses: ``max_tokens`` is ``max_output_tokens``)
    param_names: Mapping[str, str] | None = None
    #: its token-counting decoder (``/v1/messages/count_tokens``,
    #: ``/v1/responses/input_tokens``); ``None``: it has none
    count: CountReader | None = None
    #: what a body asks of the response store (Responses); ``None``: its responses
    #: are never stored
    peek_stored: Callable[[bytes], StoredAsk] | None = None
    #: the media type of its streamed answer (Ollama's: NDJSON)
    media_type: str = "text/event-stream; charset=utf-8"
    #: its streams may be made resumable (``X-Conversation-Id``: server-sent events
    #: with ids, read again through ``GET /v1/stream``); ``False``: the header is refused
    resumable: bool = True
    #: how a requested model name resolves (Ollama's ``name:latest``); ``None``: as it is
    resolve_model: ModelResolver | None = None
    #: the body's keep-alive in seconds, read before the model is leased (Ollama's
    #: ``keep_alive``: the lease's TTL); ``None``: the dialect has none
    peek_keep_alive: Callable[[bytes], float | None] | None = None

    def rename(self, exc: InvalidRequestError) -> None:
        """Name ``exc``'s field as this dialect names it."""
        new = self.param_names.get(exc.param) if self.param_names and exc.param else None
        if new is not None:
            assert exc.param is not None
            exc.message = exc.message.replace(exc.param, new)
            exc.param = new
