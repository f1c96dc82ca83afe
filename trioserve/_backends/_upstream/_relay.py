"""Each kind of request, relayed to the upstreams: its body (the payload of
:mod:`trioserve._wire._upstream`, each upstream's own fields and model id), one attempt
after another on the upstreams the balancer picks (:mod:`._attempts`) with the kind's
errors (:mod:`._errors`), and what the answers show an upstream can do.

:class:`~._backend.UpstreamBackend` owns a :class:`Relay` and checks each request before
handing it on; the stream itself is the client's (:mod:`._client`), so nothing here
runs per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..._core._backend import GenerationProgress, ModelInfo, PreparedPrompt, Ranking
from ..._core._channel import PieceChannel
from ..._core._exceptions import BackendError, TrioserveError
from ..._core._types import GenerationEnd
from ..._wire._upstream import completion_payload, infill_payload, rerank_payload
from . import _errors
from ._attempts import Attempt, attempt_each
from ._balancer import Balancer, UpstreamState
from ._client import Sink, UpstreamClient

__all__ = ["Relay"]


class Relay:
    """Completions, ``/infill``, embeddings and rerank requests through ``client`` to
    the upstreams of ``balancer``.

    ``info`` says the model as clients see it (its id goes in a request's ``model``
    when the upstream's own is unknown; its BOS token is stripped from prompts);
    ``extra_body`` is merged into every completion and ``/infill`` request; ``learn``
    hears what an answer showed an upstream can do (``"infill"``, ``"rerank"``)."""

    __slots__ = ("_info", "_learn", "balancer", "client", "extra_body")

    def __init__(
        self,
        client: UpstreamClient,
        balancer: Balancer,
        *,
        info: Callable[[], ModelInfo],
        learn: Callable[[UpstreamState, str, bool], None],
        extra_body: Mapping[str, object],
    ) -> None:
        self.client = client
        self.balancer = balancer
        self.extra_body = extra_body
        self._info = info
        self._learn = learn

    def _model(self, upstream: UpstreamState) -> str:
        return upstream.model_id or self._info().id

    async def _stream_each(
        self,
        attempt: Attempt[GenerationEnd],
        sink: Sink,
        exhausted: Callable[[Balancer, list[TrioserveError]], TrioserveError],
    ) -> GenerationEnd:
        """A streamed request's attempts (a completion, ``/infill``): retried on another
        upstream while nothing has reached ``sink``, an overloaded last one the
        request's error, ``exhausted`` the client's error when none served."""
        return await attempt_each(
            self.balancer,
            attempt,
            unavailable=BackendError,
            exhausted=functools.partial(exhausted, self.balancer),
            committed=lambda: sink.sent,
            overload_ends=True,
        )

    async def _read_each[T](self, attempt: Attempt[T]) -> T:
        """A request read whole (embeddings, rerank): every failed attempt retried, as
        embeddings' errors say."""
        return await attempt_each(
            self.balancer,
            attempt,
            unavailable=functools.partial(_errors.unavailable_for_embeddings, self.balancer),
            exhausted=functools.partial(_errors.embeddings_failed, self.balancer),
        )

    async def generate(
        self,
        prompt: PreparedPrompt,
        send: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        """Stream a completion (or fill in the middle: :meth:`infill`) from the
        upstreams, retried on another while no byte has been sent."""
        if prompt.request.infill is not None:
            return await self.infill(prompt, send, progress)
        payload = completion_payload(
            prompt.request, bos_token=self._info().bos_token, extra_body=self.extra_body
        )
        sink = Sink(send, progress)

        async def attempt(upstream: UpstreamState, answered: Callable[[], None]) -> GenerationEnd:
            body = {**upstream.request_fields, **payload, "model": self._model(upstream)}
            return await self.client.stream(upstream, body, sink, answered)

        return await self._stream_each(attempt, sink, _errors.generation_failed)

    async def infill(
        self,
        prompt: PreparedPrompt,
        send: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        """Fill in the middle through llama-server's ``POST /infill``: the same
        attempts, retries and promises as a completion; an upstream without it
        (404/405/501, or a 4xx saying so) is a retry, and when every one tried lacks
        it, the client's 400 ``infill_not_supported`` names each's answer."""
        payload = infill_payload(prompt.request, extra_body=self.extra_body)
        sink = Sink(send, progress)

        async def attempt(upstream: UpstreamState, answered: Callable[[], None]) -> GenerationEnd:
            body = {**upstream.request_fields, **payload, "model": self._model(upstream)}
            try:
                end = await self.client.infill(upstream, body, sink, answered)
            except _errors.Retry as retry:
                if retry.error.code == "infill_not_supported":
                    self._learn(upstream, "infill", False)
                raise
            finally:
                if sink.sent:
                    self._learn(upstream, "infill", True)
            self._learn(upstream, "infill", True)
            return end

        return await self._stream_each(attempt, sink, _errors.infill_failed)

    async def embeddings(
        self, inputs: Sequence[str | Sequence[int]], dimensions: int | None
    ) -> tuple[list[list[float]], int]:
        """The upstream's ``POST /v1/embeddings`` of ``inputs`` (as given; ``dimensions``
        if asked): its vectors and ``usage.prompt_tokens``, every failed attempt retried
        (nothing reaches the client before the whole answer)."""
        _errors.refuse_if_all_cooling_down(self.balancer)
        payload: dict[str, Any] = {
            "input": [item if isinstance(item, str) else list(item) for item in inputs],
            "encoding_format": "float",
        }
        if dimensions is not None:
            payload["dimensions"] = dimensions

        async def attempt(
            upstream: UpstreamState, answered: Callable[[], None]
        ) -> tuple[list[list[float]], int]:
            body = {"model": self._model(upstream), **payload}
            return await self.client.embeddings(upstream, body, answered)

        return await self._read_each(attempt)

    async def rerank(self, query: str, documents: Sequence[str]) -> Ranking:
        """The upstream's ``POST /v1/rerank`` of ``documents`` against ``query``, read
        whole and retried as :meth:`embeddings` is; an upstream that does not rerank is
        a retry, learnt from (the ranking's kind and score: the upstream's own words,
        a trioserve's, else ``"upstream"``, ``"unknown"``)."""
        _errors.refuse_if_all_cooling_down(self.balancer)
        payload = rerank_payload(query, list(documents))

        async def attempt(upstream: UpstreamState, answered: Callable[[], None]) -> Ranking:
            body = {"model": self._model(upstream), **payload}
            try:
                answer, scores, prompt_tokens = await self.client.rerank(upstream, body, answered)
            except _errors.Retry as retry:
                if retry.error.code == "rerank_not_supported":
                    self._learn(upstream, "rerank", False)
                raise
            self._learn(upstream, "rerank", True)
            said = answer.trioserve
            return Ranking(
                scores=scores,
                prompt_tokens=prompt_tokens,
                kind=said.reranker if said is not None and said.reranker else "upstream",
                score=said.score if said is not None and said.score else "unknown",
            )

        return await self._read_each(attempt)
