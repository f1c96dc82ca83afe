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

The backends that fit it: ``docs/embedding.md``. The data that crosses the seam:
:mod:`._backend_data`; the checks every backend shares: :mod:`._backend_checks` (both
re-exported here).
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Unpack

import trio

from ._admission import SlotLease
from ._backend_checks import (
    check_dimensions,
    check_options,
    check_token_ids,
    fit_to_context,
    refuse_unsupported,
)
from ._backend_data import (
    ChoiceGroup,
    ControlOutcome,
    EmbeddingOptions,
    ModelInfo,
    PreparedPrompt,
    Ranking,
    RerankOptions,
)
from ._channel import PieceChannel
from ._exceptions import InvalidRequestError, NotSupportedError
from ._types import GenerationEnd, GenerationRequest

__all__ = [
    "Backend",
    "ChoiceGroup",
    "ControlOutcome",
    "EmbeddingOptions",
    "GenerationCounter",
    "GenerationProgress",
    "ModelInfo",
    "PreparedPrompt",
    "Ranking",
    "RerankOptions",
    "check_dimensions",
    "check_options",
    "check_token_ids",
    "fit_to_context",
    "refuse_unsupported",
]


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
        self, inputs: Sequence[str | Sequence[int]], **options: Unpack[EmbeddingOptions]
    ) -> tuple[list[list[float]], int]:
        """One request's embeddings: ``(vectors, prompt tokens)``, a vector per input
        (a text or token ids), in order, as ``options`` ask (:class:`EmbeddingOptions`:
        ``dimensions``, ``max_tokens``). Cancellation: as :meth:`embed`.

        Default: :class:`NotSupportedError` (501) when :attr:`embedding_size` is ``None``;
        else :func:`check_dimensions`, each text tokenized with the model's special
        tokens (as llama-server does), the total checked against ``max_tokens`` (400
        naming both) before anything is evaluated, :meth:`embed`, and the tokens
        evaluated."""
        check_options(options, EmbeddingOptions)
        size = self.embedding_size
        if size is None:
            raise NotSupportedError(
                f"this server's backend ({type(self).__name__}) computes no embeddings", code="no_embeddings"
            )
        check_dimensions(options.get("dimensions"), size)
        tokens: list[Sequence[int]] = []
        for item in inputs:
            if isinstance(item, str):
                tokens.append(await self.tokenize_text(item, add_special=True, parse_special=True))
                await trio.lowlevel.checkpoint()  # (many short texts: the event loop goes on)
            else:
                tokens.append(item)
        total = sum(len(item) for item in tokens)
        max_tokens = options.get("max_tokens")
        if max_tokens is not None and total > max_tokens:
            raise InvalidRequestError(
                f"the inputs hold {total} tokens together; a request may hold at most {max_tokens} "
                "(--max-embedding-tokens): send fewer or shorter inputs per request",
                param="input",
                code="too_many_tokens",
            )
        vectors = await self.embed(tokens)
        return vectors, sum(len(item) for item in tokens)

    async def rerank(self, query: str, documents: Sequence[str], **options: Unpack[RerankOptions]) -> Ranking:
        """Score each document's relevance to ``query`` (docs/rerank.md), as ``options``
        ask (:class:`RerankOptions`). Must stop promptly when cancelled, leaving nothing
        behind. Default: a 400 (``rerank_not_supported``): the backend has no reranker."""
        check_options(options, RerankOptions)
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
