"""The backend interface: the one seam between the engine and whatever makes tokens.

A :class:`Backend` turns a :class:`PreparedPrompt` into token *bytes* written to the
request's :class:`~trioserve._core._channel.PieceChannel`, and returns why it stopped;
the engine owns everything else. Contract for :meth:`Backend.generate`:

* respect the channel's capacity (``send`` from Trio, ``put_wait`` from a thread, or
  check ``room`` and pause): that is the backpressure; the engine closes the channel;
* when its cancel scope is cancelled, stop promptly (well under one decode step), leave
  the model state as a fresh request would find it, and raise that ``trio.Cancelled`` —
  never a :class:`BackendError`;
* count itself in :attr:`Backend.generations` until it has let go of the work;
* count what it makes in its :class:`GenerationProgress`; a backend whose pieces are
  tokens sets ``piece_per_token`` (then a stream cut by a stop sequence reports the
  tokens up to the stop, not those made past it before the cancel reached it).
* a backend that can set a running generation aside (:attr:`Backend.pausable`) and
  finds ``progress.preemption`` set takes part in preemption: once it can act on an
  ask, it calls ``preemption.enable_pause(hook, state_bytes=...)`` (the lease is not
  pausable before: an ask cannot be lost); asked, it sets the work aside at its next
  step (its state kept), calls ``await preemption.pause(saved_bytes)`` (the slot goes
  back; it returns once the slot is held again) and resumes where it stopped — or
  calls ``preemption.decline()``; it calls ``preemption.disable_pause()`` when its work
  ends. A cancel while paused is a cancel like any other (docs/scheduling.md).
* a backend that can end a running generation's reasoning (:attr:`Backend.ends_reasoning`)
  installs ``progress.control`` when it starts a request whose ``reasoning`` is set: a
  hook the engine calls from Trio (``EventStream.end_reasoning``) that arranges for the
  model's end-of-reasoning marker to be written at the sequence's next token, as if the
  model had drawn it, and says what came of the ask (:data:`ControlOutcome`); an ask
  made before the hook is installed is ``progress.reasoning_end_asked``, honoured from
  the first token. It removes the hook when its work ends.

The backends that fit it: ``docs/embedding.md``.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import trio

from ._admission import SlotLease
from ._channel import PieceChannel
from ._exceptions import ContextLengthError, InvalidRequestError, NotSupportedError
from ._types import GenerationEnd, GenerationRequest

__all__ = [
    "Backend",
    "ChoiceGroup",
    "ControlOutcome",
    "GenerationCounter",
    "GenerationProgress",
    "ModelInfo",
    "PreparedPrompt",
    "Ranking",
    "check_dimensions",
    "check_token_ids",
    "fit_to_context",
    "refuse_unsupported",
]


#: What an ask to end a running generation's reasoning came to
#: (``EventStream.end_reasoning``): ``forced`` — the end marker is written at its next
#: token (or was being written already); ``not_enabled`` — the request said
#: ``reasoning_control: false``; ``not_reasoning`` — the model does not reason here (no
#: markers, reasoning turned off, a constrained answer); ``already_ended`` — its
#: reasoning ended (the model wrote the marker, or an earlier ask did); ``finished`` —
#: its generation is over; ``unsupported`` — its backend cannot (the upstream relay).
ControlOutcome = Literal["forced", "not_enabled", "not_reasoning", "already_ended", "finished", "unsupported"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    id: str
    context_length: int
    #: A Jinja chat template from the model's metadata, if it has one.
    chat_template: str | None = None
    #: The model architecture (``general.architecture``), for the chat fallback.
    architecture: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    #: the model can fill in the middle (its vocabulary names FIM tokens: ``/infill``);
    #: ``None``: not known (the upstream relay, until an upstream has answered one)
    infill: bool | None = False
    #: what reranking it does: ``"cross-encoder"``, ``"yes-no"``, ``"upstream"`` (the
    #: relay, once an upstream has reranked) or ``None`` (docs/rerank.md)
    rerank: str | None = None
    #: it generates text (an encoder embeds and ranks only)
    generates: bool = True
    #: it takes images (a vision projector is loaded with it: docs/vision.md)
    vision: bool = False
    #: it takes audio (an audio projector is loaded with it: docs/audio.md)
    audio: bool = False
    #: its LoRA adapters, ``(name, default scale, file)`` in their ``id`` order
    #: (docs/lora.md)
    adapters: tuple[tuple[str, float, str], ...] = ()
    #: its activated LoRAs' invocations, ``(name, tokens, text)`` (docs/lora.md)
    alora: tuple[tuple[str, tuple[int, ...], str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Ranking:
    """A rerank's answer (``Backend.rerank``): a score per document, in the order given."""

    scores: list[float]
    #: tokens evaluated for it (the shared prefix counted once)
    prompt_tokens: int
    #: ``"cross-encoder"``, ``"yes-no"``, or ``"upstream"`` (the relay: an upstream's,
    #: which it does not name)
    kind: str
    #: what a score is: ``"logit"``, ``"probability"``, or ``"unknown"`` (the relay: the
    #: upstream's own, unnamed)
    score: str
    #: of ``prompt_tokens``, the shared prefix's (a ``yes-no`` reranker; 0: it was kept
    #: from the previous request)
    prefix_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedPrompt:
    """A request after tokenization and validation: ready to run, nothing left to refuse."""

    request: GenerationRequest
    tokens: Sequence[int]
    #: ``max_tokens`` resolved against the context: how many tokens may be generated.
    max_new_tokens: int
    #: the backend's compiled ``request.constraint`` (its own type), if any
    compiled: object | None = None
    #: the backend's own form of ``request.sampling.logit_bias`` (arrays, say), made once
    #: per request at prepare, so no per-token or per-choice work walks the mapping
    logit_bias: object | None = None
    #: ``n`` > 1: this prompt is choice ``choice`` of ``group``, whose choices may share
    #: one evaluation of the prompt (a backend that cannot share runs them apart)
    group: ChoiceGroup | None = None
    choice: int = 0
    #: the backend's own form of the prompt's images (where they sit, what encodes
    #: them: docs/vision.md), if it has any
    media: object | None = None
    #: ``request.reasoning``'s markers as the backend's tokens (``(start, end)``),
    #: tokenized at prepare where the reasoning may be ended on request
    reasoning_tokens: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: ``request.lora`` resolved: the adapter set, ``((name, scale), …)`` sorted by
    #: name, no zero scale (docs/lora.md); empty: the base model
    adapters: tuple[tuple[str, float], ...] = ()
    #: an activated LoRA of ``adapters`` and the prompt position it applies from: the
    #: positions before it run without it (docs/lora.md, "Activated LoRA")
    alora: tuple[str, int] | None = None


def refuse_unsupported(request: GenerationRequest, backend: str, *, infill: bool = False) -> None:
    """For backends that cannot constrain their text or report log-probabilities:
    refuse such requests (400 naming the field) rather than ignore the ask.
    ``infill``: the backend fills in the middle another way (the upstream relay
    forwards it, ``samplers`` included); ``samplers`` is still refused elsewhere."""
    if request.constraint is not None:
        raise InvalidRequestError(
            f"constrained decoding (response_format, json_schema, grammar, forced tool calls) "
            f"is not supported by the {backend} backend",
            param="response_format",
        )
    if request.logprobs is not None:
        raise InvalidRequestError(f"logprobs are not supported by the {backend} backend", param="logprobs")
    if request.lora:
        raise InvalidRequestError(f"LoRA adapters are not supported by the {backend} backend", param="lora")
    if request.images:
        raise InvalidRequestError(
            f"images are not supported by the {backend} backend",
            param="messages",
            code="images_not_supported",
        )
    if request.infill is not None and not infill:
        raise InvalidRequestError(
            f"fill in the middle (/infill, suffix) is not supported by the {backend} backend: it lays "
            "out the prompt with the model's own FIM tokens, which only a llama backend has",
            param="input_prefix",
            code="infill_not_supported",
        )
    if request.sampling.samplers is not None and not (infill and request.infill is not None):
        where = " outside /infill" if infill else ""
        raise InvalidRequestError(
            f"samplers (a sampler chain in a given order) is not supported{where} by the {backend} "
            "backend; send the request without it",
            param="samplers",
        )


class ChoiceGroup:
    """The ``n`` choices of one request: a token their prompts share (``size``: how
    many are still to be served; a backend that shares the evaluation counts down the
    choices cancelled before they started)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def fit_to_context(request: GenerationRequest, tokens: Sequence[int], n_ctx: int) -> PreparedPrompt:
    """Check that the prompt and ``max_tokens`` fit a context of ``n_ctx`` tokens, and
    resolve ``max_tokens=None`` to the room left. Raises :class:`ContextLengthError`
    with the numbers a user needs to fix the request."""
    if not tokens:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(tokens) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; "
            f"shorten it to at most {n_ctx - 1} tokens",
            param="prompt",
        )
    room = n_ctx - len(tokens)
    max_new = room if request.max_tokens is None else request.max_tokens
    if max_new > room and request.clamp_max_tokens:
        max_new = room
    if max_new > room:
        raise ContextLengthError(
            f"max_tokens is {max_new} but only {room} tokens fit after the "
            f"{len(tokens)}-token prompt (context {n_ctx}); lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
    return PreparedPrompt(request=request, tokens=tokens, max_new_tokens=max_new)


def check_token_ids(tokens: Sequence[int], n_vocab: int, param: str = "tokens") -> None:
    """Raise :class:`InvalidRequestError` naming the first id of ``tokens`` that is not
    in a vocabulary of ``n_vocab`` tokens (ids ``0`` to ``n_vocab - 1``)."""
    for i, token in enumerate(tokens):
        if not 0 <= token < n_vocab:
            raise InvalidRequestError(
                f"{param}[{i}] is {token}, which is not a token id of this model: "
                f"its ids are 0 to {n_vocab - 1}",
                param=f"{param}[{i}]",
            )


def check_dimensions(dimensions: int | None, n_embd: int) -> None:
    """Embeddings' ``dimensions``: refused by name unless it is the model's own size
    ``n_embd`` (a model cannot produce vectors of another length)."""
    if dimensions is not None and dimensions != n_embd:
        raise InvalidRequestError(
            f"dimensions is not supported: this model's embeddings have {n_embd} dimensions and it cannot "
            f"produce others (omit dimensions, or send it as {n_embd})",
            param="dimensions",
        )


class GenerationProgress:
    """Counters one generation updates as it runs (read by the engine for usage/metrics).

    Written only by the producer (its thread), read by the engine after the producer
    has finished, so no lock is needed.
    """

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "control",
        "disk_tokens",
        "draft_accepted",
        "draft_proposed",
        "host_tokens",
        "inference_ended",
        "lease",
        "piece_per_token",
        "preemption",
        "prefill_seconds",
        "prefilled_tokens",
        "prompt_tokens",
        "reasoning_end_asked",
    )

    def __init__(self, prompt_tokens: int, lease: SlotLease | None = None) -> None:
        self.prompt_tokens = prompt_tokens
        #: prompt tokens reused from the prompt cache (not evaluated)
        self.cached_tokens = 0
        #: of those, restored from the host-memory tier and from the disk tier (the rest
        #: were still in the KV cells)
        self.host_tokens = 0
        self.disk_tokens = 0
        #: prompt tokens in the KV cells so far (reused or evaluated): prefill progress
        self.prefilled_tokens = 0
        self.completion_tokens = 0
        #: the producer sends one piece per token it counts in ``completion_tokens``
        #: (then a stream cut by a stop sequence counts the tokens up to the stop, not
        #: those the producer made past it before it was cancelled); an upstream's text
        #: chunks are not tokens
        self.piece_per_token = False
        #: speculative decoding: tokens guessed and verified, and how many were right
        self.draft_proposed = 0
        self.draft_accepted = 0
        self.prefill_seconds = 0.0
        #: ``time.perf_counter()`` when inference returned (its thread left the model);
        #: with the time a cancel was requested, this gives the cancel latency
        self.inference_ended: float | None = None
        #: the lease to pause, where the backend is pausable and the request holds one
        #: slot (the engine sets it)
        self.preemption: SlotLease | None = None
        #: the lease its slots are held by (the engine sets it; any backend): what
        #: gives them to a waiter when nobody reads the stream (docs/resumable-streams.md)
        self.lease = lease
        #: ending the reasoning on request: the backend's hook while its work runs
        #: (called from Trio: the module docstring), and an ask made before it was
        #: installed (the engine sets it; the backend reads it when it installs the hook)
        self.control: Callable[[], ControlOutcome] | None = None
        self.reasoning_end_asked = False

    @property
    def served_tokens(self) -> int:
        """Tokens evaluated and generated so far (the fair share's measure)."""
        return self.prefilled_tokens - self.cached_tokens + self.completion_tokens


class Backend(ABC):
    """What makes tokens. See the module docstring for the cancellation contract."""

    @property
    @abstractmethod
    def info(self) -> ModelInfo: ...

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many generations may run at once."""

    #: whether :meth:`generate` can set a running generation aside and resume it
    #: (preemption by pause: the module docstring)
    pausable: bool = False
    #: whether :meth:`generate` can end a running generation's reasoning on request
    #: (``progress.control``: the module docstring)
    ends_reasoning: bool = False

    @abstractmethod
    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Tokenize and validate. Raises :class:`InvalidRequestError` subclasses."""

    @abstractmethod
    async def generate(
        self,
        prompt: PreparedPrompt,
        channel: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        """Generate into ``channel`` until end-of-sequence (``"stop"``) or the token limit
        (``"length"``). Cancellation: see the module docstring."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release the model. Called once, when the engine closes."""

    @property
    def failure(self) -> BaseException | None:
        """Why the backend can no longer serve, if it broke (``/health`` then answers
        503). Default: never."""
        return None

    @functools.cached_property
    def generations(self) -> GenerationCounter:
        """The generations inside this backend (``/health``: ``generations_running``).
        A backend enters it for the whole of each :meth:`generate`."""
        return GenerationCounter()

    def stats(self) -> dict[str, object] | None:
        """Backend-specific figures for ``/health`` (the llama backend: its batch).
        Default: none."""
        return None

    def platform(self) -> dict[str, object] | None:
        """What the backend runs on, for ``/health`` (the llama backend: llama.cpp's
        system info and whether weights were repacked, and why). Default: none."""
        return None

    # LoRA adapters at run time (``POST /v1/load_lora_adapter`` and its kin:
    # docs/lora.md): optional. The defaults answer 501.

    async def load_adapter(
        self, name: str, path: str, *, scale: float = 1.0, check_room: Callable[[int], None] | None = None
    ) -> None:
        """Load the LoRA adapter file at ``path`` (on the server) as ``name``;
        ``check_room(bytes)`` raises if its file does not fit the model's memory.
        Cancellation: before the file is read, nothing is loaded; after, it is freed."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) loads no LoRA adapters", code="no_lora"
        )

    async def unload_adapter(self, name: str) -> None:
        """Unload ``name``: requests can no longer name it; streams using it finish."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) loads no LoRA adapters", code="no_lora"
        )

    def set_adapter_scales(self, scales: Sequence[tuple[int, float]]) -> None:
        """Set adapters' default scales by id (llama-server's ``POST /lora-adapters``)."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) has no LoRA adapters", code="no_lora"
        )

    @property
    def adapter_bytes(self) -> int:
        """Bytes of the adapter files loaded at run time (the model's memory budget
        counts them)."""
        return 0

    # Tokenizing (``POST /tokenize``, ``POST /detokenize``): optional. A backend without
    # a tokenizer keeps these defaults, which answer 501 (:class:`NotSupportedError`).

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        """Text → token ids, as llama.cpp's ``common_tokenize``: ``add_special`` adds the
        special tokens the model puts around a text (BOS for most models);
        ``parse_special`` reads special tokens written in the text (``<start_of_turn>``)
        as themselves, otherwise they are plain text. Must not block the event loop on
        long texts. Default: :class:`NotSupportedError` (501)."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) has no tokenizer", code="no_tokenizer"
        )

    async def count_text_tokens(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> int:
        """How many tokens :meth:`tokenize_text` gives (token counting: a backend may
        count without building the list). Default: the list's length."""
        return len(await self.tokenize_text(text, add_special=add_special, parse_special=parse_special))

    # Embeddings (``POST /v1/embeddings``): optional. The endpoint calls
    # :meth:`embed_inputs`; its default tokenizes here and calls :meth:`embed`, so a
    # backend with a local model implements ``embedding_size`` and ``embed``; one that
    # forwards the request elsewhere (the upstream relay) overrides ``embed_inputs``.

    @property
    def embedding_size(self) -> int | None:
        """The length of the vectors :meth:`embed` returns (``None``: :meth:`embed` computes
        none; a backend that overrides :meth:`embed_inputs` may still serve embeddings,
        of a size it does not know in advance)."""
        return None

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each input's (token ids') embedding, pooled and L2-normalised. Must stop
        promptly when cancelled, leaving nothing behind. Default:
        :class:`NotSupportedError` (501)."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) computes no embeddings", code="no_embeddings"
        )

    async def embed_inputs(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        dimensions: int | None = None,
        max_tokens: int | None = None,
    ) -> tuple[list[list[float]], int]:
        """One request's embeddings: ``(vectors, prompt tokens)``, a vector per input
        (a text or token ids), in order. ``dimensions``: the length the client asked for
        (``None``: the model's); ``max_tokens``: the most tokens the inputs may hold
        together (``None``: no limit). Cancellation: as :meth:`embed`.

        Default: :class:`NotSupportedError` (501) when :attr:`embedding_size` is ``None``;
        else :func:`check_dimensions`, each text tokenized with the model's special
        tokens (as llama-server does), the total checked against ``max_tokens`` (400
        naming both) before anything is evaluated, :meth:`embed`, and the tokens
        evaluated."""
        size = self.embedding_size
        if size is None:
            raise NotSupportedError(
                f"this server's backend ({type(self).__name__}) computes no embeddings", code="no_embeddings"
            )
        check_dimensions(dimensions, size)
        tokens: list[Sequence[int]] = []
        for item in inputs:
            if isinstance(item, str):
                tokens.append(await self.tokenize_text(item, add_special=True, parse_special=True))
                await trio.lowlevel.checkpoint()  # (many short texts: the event loop goes on)
            else:
                tokens.append(item)
        total = sum(len(item) for item in tokens)
        if max_tokens is not None and total > max_tokens:
            raise InvalidRequestError(
                f"the inputs hold {total} tokens together; a request may hold at most {max_tokens} "
                "(--max-embedding-tokens): send fewer or shorter inputs per request",
                param="input",
                code="too_many_tokens",
            )
        vectors = await self.embed(tokens)
        return vectors, sum(len(item) for item in tokens)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str | None = None,
        max_tokens_per_doc: int | None = None,
        max_tokens: int | None = None,
    ) -> Ranking:
        """Score each document's relevance to ``query`` (docs/rerank.md). Must stop
        promptly when cancelled, leaving nothing behind. Default: a 400
        (``rerank_not_supported``): the backend has no reranker."""
        raise InvalidRequestError(
            f"reranking is not supported by this server's backend ({type(self).__name__}): it needs a "
            "local model that is a cross-encoder or a yes-no reranker",
            param="model",
            code="rerank_not_supported",
        )

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """The bytes of each token, special tokens rendered as their text (``<bos>``),
        as llama.cpp's ``common_token_to_piece``. Raises :class:`InvalidRequestError`
        (``param`` ``tokens[i]``: :func:`check_token_ids`) for an id outside the
        vocabulary. Default: :class:`NotSupportedError` (501)."""
        raise NotSupportedError(
            f"this server's backend ({type(self).__name__}) has no tokenizer", code="no_tokenizer"
        )


class GenerationCounter:
    """Counts generations inside a backend: entered :meth:`Backend.generate` and not yet
    out of it. A cancelled generation counts until its backend has let go of it (its
    thread out of llama.cpp, its sequence's cells removed, its upstream request closed),
    so ``running == 0`` proves that a cancel really stopped the work.

    Thread-safe: worker threads enter and leave it."""

    __slots__ = ("_lock", "_running", "started")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        #: generations ever started
        self.started = 0

    def __enter__(self) -> None:
        with self._lock:
            self._running += 1
            self.started += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._running -= 1

    @property
    def running(self) -> int:
        """Generations inside the backend now."""
        return self._running
