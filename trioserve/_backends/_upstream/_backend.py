"""The upstream backend: trioserve in front of OpenAI-compatible servers, with the
semantics of a local model: backpressure passes through, a cancel closes the upstream
request before ``Cancelled`` propagates, the deadline travels (:mod:`._client`).

Upstreams are chosen by :mod:`._balancer`. A request whose upstream fails before a byte
reached the client is retried on another; after the first byte it ends with an error
(:mod:`._attempts`, one loop for completions and embeddings; :mod:`._errors` maps
each failure). Each kind of request is relayed by the backend's :class:`~._relay.Relay`
once the backend has checked it.
There is no local tokenizer: token counts come from the upstream's usage chunk, else
``completion_tokens`` counts text chunks. ``POST /v1/embeddings`` is forwarded as it
came (:meth:`UpstreamBackend.embed_inputs`), a rerank to the upstream's
``/v1/rerank`` (:meth:`UpstreamBackend.rerank`), and fill in the middle (``/infill``,
``suffix``) to llama-server's ``/infill``, whose model lays out the prompt with its own
FIM tokens. Whether the upstreams can do the last two is learnt from their answers
(``info.infill``, ``info.rerank``). ``docs/deployment.md`` has the why.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

import trio

from ..._core._backend import (
    Backend,
    EmbeddingOptions,
    GenerationProgress,
    ModelInfo,
    PreparedPrompt,
    Ranking,
    RerankOptions,
    check_options,
    refuse_unsupported,
)
from ..._core._channel import PieceChannel
from ..._core._exceptions import (
    InvalidRequestError,
)
from ..._core._types import GenerationEnd, GenerationRequest
from ..._wire._upstream import base_url
from . import _errors
from ._balancer import Balancer, UpstreamState
from ._client import UpstreamClient
from ._discovery import describe_upstreams
from ._relay import Relay

__all__ = ["UpstreamBackend", "UpstreamState"]

logger = logging.getLogger("trioserve.upstream")

#: the context length reported when no upstream says what it is
UNKNOWN_CONTEXT_LENGTH = 1 << 20


class UpstreamBackend(Backend):
    """Generates by streaming from OpenAI-compatible upstream servers.

    Create it with :meth:`aload`, which asks the upstreams for their model. Use the
    constructor to skip that (``info`` then says what to report).

    Args:
        urls: base URLs of the upstreams (``http://host:port``; a trailing ``/v1`` is
            accepted).
        info: the model as clients see it (the id goes in each upstream request's
            ``model`` when the upstream's own id is unknown).
        slots_per_upstream: the capacity each upstream adds: ``slots`` (what runs at
            once; trioserve queues the rest, ``--max-queue``) is this times the number
            of upstreams. Not a per-upstream cap: while one upstream is down, the others
            take its share (their own queues absorb it).
        cooldown: seconds a failed upstream is skipped before one request probes it.
        connect_timeout: seconds to open a connection to an upstream.
        read_timeout: seconds an upstream may stay silent mid-request (queueing and
            prefill included: trioserve upstreams send heartbeats every 15 s). The
            request's own deadline, if any, applies too.
        receive_buffer_bytes: ``SO_RCVBUF`` of upstream connections: how much of an
            upstream's stream the kernel holds for a client that is not reading. Small,
            so a slow client slows the upstream soon.
        api_key: sent upstream as ``Authorization: Bearer …``.
        extra_body: fields merged into every upstream completion and ``/infill``
            request (e.g. ``{"repeat_penalty": 1.0}`` for llama-cpp-python, whose
            default is 1.1); not into embeddings or rerank requests.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        info: ModelInfo,
        slots_per_upstream: int = 8,
        cooldown: float = 5.0,
        connect_timeout: float = 5.0,
        read_timeout: float | None = 300.0,
        receive_buffer_bytes: int | None = 16 * 1024,
        api_key: str | None = None,
        extra_body: Mapping[str, object] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("UpstreamBackend needs at least one upstream URL")
        if slots_per_upstream < 1:
            raise ValueError(f"slots_per_upstream must be at least 1, got {slots_per_upstream}")
        self.balancer = Balancer([base_url(url) for url in urls], cooldown=cooldown)
        self._info = info
        self.slots_per_upstream = slots_per_upstream
        self.extra_body = dict(extra_body or {})
        client = UpstreamClient(
            connections=slots_per_upstream * len(urls),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            receive_buffer_bytes=receive_buffer_bytes,
            api_key=api_key,
        )
        #: each kind of request, sent to the upstreams (its body, attempts, errors),
        #: through the client it owns
        self._relay = Relay(
            client, self.balancer, info=lambda: self._info, learn=self._learn, extra_body=self.extra_body
        )
        self._closed = False

    @property
    def upstreams(self) -> list[UpstreamState]:
        return self.balancer.upstreams

    @property
    def cooldown(self) -> float:
        return self.balancer.cooldown

    # ----------------------------------------------------------------- loading

    @classmethod
    async def aload(
        cls,
        urls: Sequence[str],
        *,
        model_id: str | None = None,
        chat_template: str | None = None,
        architecture: str | None = None,
        load_timeout: float = 60.0,
        **settings: Any,
    ) -> UpstreamBackend:
        """Ask each upstream for its model (``GET /v1/models``, first model) and
        build the backend. Waits, retrying once a second for up to ``load_timeout``
        seconds, until at least one upstream answers (an upstream still loading its
        model answers 503); those that do not are put in cooldown (:mod:`._discovery`).

        llama-server's ``GET /props`` is read too when it exists, for the chat template
        and the context size. Args: ``model_id`` (the name clients use; default: the
        first upstream's), ``chat_template`` and ``architecture`` (override what the
        upstream reports, for chat rendering), and the constructor's keyword arguments.

        Raises:
            BackendError: no upstream answered within ``load_timeout``.
        """
        backend = cls(
            urls,
            info=ModelInfo(id=model_id or "upstream", context_length=UNKNOWN_CONTEXT_LENGTH, infill=None),
            **settings,
        )
        try:
            first = await describe_upstreams(backend._relay.client, backend.balancer, load_timeout)
            backend._info = ModelInfo(
                id=model_id or first.id,
                context_length=first.context_length or UNKNOWN_CONTEXT_LENGTH,
                chat_template=chat_template or first.chat_template,
                architecture=architecture,
                bos_token=first.bos_token,
                eos_token=first.eos_token,
                infill=None,  # (no upstream says; learnt from its answers: _learn)
            )
        except BaseException:
            with trio.CancelScope(shield=True):
                await backend.aclose()
            raise
        logger.info(
            "upstream model %s via %s (%d slot(s) each)",
            backend._info.id,
            ", ".join(u.url for u in backend.upstreams),
            backend.slots_per_upstream,
        )
        return backend

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._relay.client.aclose()

    # ---------------------------------------------------------------- properties

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def slots(self) -> int:
        """``slots_per_upstream`` × the number of upstreams."""
        return self.slots_per_upstream * len(self.upstreams)

    def _learn(self, upstream: UpstreamState, capability: str, able: bool) -> None:
        """What an upstream's answer showed it can do (``"infill"``, ``"rerank"``),
        and so what ``info`` says: ``infill`` ``True`` while one upstream last served
        one, ``False`` while every one last refused, ``None`` (unknown) otherwise;
        ``rerank`` ``"upstream"`` while one last reranked, else ``None``. No upstream
        says in advance (llama-server's ``/props`` and ``/v1/models`` name no FIM
        tokens and no ``--reranking``), and a probe would cost each a request."""
        if upstream.capabilities.get(capability) is able:
            return
        upstream.capabilities[capability] = able
        known = [u.capabilities.get("infill") for u in self.upstreams]
        infill = True if True in known else False if all(k is False for k in known) else None
        ranks = any(u.capabilities.get("rerank") for u in self.upstreams)
        self._info = dataclasses.replace(self._info, infill=infill, rerank="upstream" if ranks else None)

    # ----------------------------------------------------------------- requests

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """Check what can be checked without the model: a text prompt, and an upstream
        to send it to. The prompt's token count is unknown (0) until the upstream says.
        Fill in the middle goes as it came (the middle's start, ``prompt``, may be
        empty; the prefix and suffix may hold token ids: llama-server takes them).

        Raises:
            InvalidRequestError: a token-id prompt (there is no local tokenizer to
                check the ids against, and not every upstream accepts them).
            ServiceUnavailableError: every upstream is in its cooldown (503 with
                ``Retry-After``).
        """
        refuse_unsupported(request, "upstream", infill=True)
        if not isinstance(request.prompt, str):
            raise InvalidRequestError(
                "token-id prompts are not supported by this server (it forwards text to an "
                "upstream server and has no tokenizer of its own); send the prompt as text",
                param="prompt",
            )
        if not request.prompt and request.infill is None:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        _errors.refuse_if_all_cooling_down(self.balancer)
        max_new = request.max_tokens if request.max_tokens is not None else self._info.context_length
        return PreparedPrompt(request=request, tokens=(), max_new_tokens=max_new)

    async def generate(
        self,
        prompt: PreparedPrompt,
        send: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        """Stream from the least busy available upstream; retry on another while no
        byte has been sent. Cancellation: the upstream connection is closed before
        this raises ``Cancelled``."""
        with self.generations:
            try:
                return await self._relay.generate(prompt, send, progress)
            finally:
                progress.inference_ended = time.perf_counter()

    # --------------------------------------------------------------- embeddings

    async def embed_inputs(
        self, inputs: Sequence[str | Sequence[int]], **options: Unpack[EmbeddingOptions]
    ) -> tuple[list[list[float]], int]:
        """Forward the inputs (texts and token ids as given) to an upstream's
        ``POST /v1/embeddings`` (``encoding_format`` float; ``dimensions`` if asked:
        the upstream checks it): its vectors and ``usage.prompt_tokens`` (0 if it sends
        no usage). ``max_tokens`` is not checked here (no local tokenizer: the upstream
        enforces its own limits). Upstreams are picked as for :meth:`generate`, and since nothing
        reaches the client before the whole answer, a failed attempt is always retried
        on another upstream. Cancellation: the upstream connection is closed before
        this raises ``Cancelled``.

        Raises:
            InvalidRequestError: the upstream's 4xx, with its message (not retried).
            ServiceUnavailableError: no upstream could be reached (every one is in its
                cooldown, unreachable, or answered 502/503/504): 503 ``Retry-After``.
            NotSupportedError: every upstream tried answered 501 (not an embedding
                model, or llama-server without ``--embeddings``).
            OverloadedError: every upstream answered 429.
            BackendError: the upstreams failed otherwise (5xx, a malformed answer).
        """
        check_options(options, EmbeddingOptions)
        return await self._relay.embeddings(inputs, options.get("dimensions"))

    # ------------------------------------------------------------------- rerank

    async def rerank(self, query: str, documents: Sequence[str], **options: Unpack[RerankOptions]) -> Ranking:
        """Forward the query and documents to an upstream's ``POST /v1/rerank``
        (llama-server ``--reranking``, vLLM, trioserve): its scores in the documents'
        order and its ``usage.prompt_tokens`` (0 if it sends none). Read whole and
        retried as :meth:`embed_inputs` is, with the same errors and the same cancel
        promise; an upstream that does not rerank (404/405/501, or a 4xx saying so) is
        a retry, and when every one tried does not, the client's 400
        ``rerank_not_supported`` names each's answer. ``max_tokens`` is not checked
        here (no local tokenizer). The ranking's kind is ``"upstream"`` and its score
        ``"unknown"`` (llama-server's cross-encoder sends a logit, vLLM a probability;
        neither says which) unless the upstream is a trioserve, which says both.

        Raises:
            InvalidRequestError: ``instruction`` or ``max_tokens_per_doc`` (llama-server
                takes neither: it would ignore them), or an upstream's 4xx.
        """
        check_options(options, RerankOptions)
        for name in ("instruction", "max_tokens_per_doc"):
            if options.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} is not supported by this server: it forwards reranking to an upstream "
                    "server that does not take it (llama-server would ignore it); send the request "
                    f"without {name}",
                    param=name,
                )
        return await self._relay.rerank(query, documents)
