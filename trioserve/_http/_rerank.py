"""``POST /v1/rerank`` (and ``/rerank``, ``/v1/reranking``, ``/reranking``, ``/v2/rerank``):
the retrieval flow of ``_http/_embeddings.py`` — one cancel scope, the disconnect
watcher, the model's lease and retrieval queue — with a rerank's body and answer
(docs/rerank.md)."""

from __future__ import annotations

from typing import Any

from .._core._admission import Ticket
from .._core._backend import Backend, Ranking
from .._wire import RerankQuery, decode_rerank_request, rerank_response
from ._embeddings import RetrievalHandler
from ._request import InFlightRequest

__all__ = ["RERANK_PATHS", "RerankHandler"]

#: llama-server's four, and Cohere's v2 (as vLLM serves it)
RERANK_PATHS = frozenset({"/v1/rerank", "/rerank", "/v1/reranking", "/reranking", "/v2/rerank"})


class RerankHandler(RetrievalHandler):
    path = "/v1/rerank"
    kind = "rerank"
    noun = "the scores"

    def parse(self, body: bytes, path: str) -> RerankQuery:
        return decode_rerank_request(body, path.rstrip("/"))

    def count(self, parsed: RerankQuery) -> int:
        return len(parsed.documents)

    def ticket(self, request: InFlightRequest, parsed: RerankQuery) -> Ticket:
        """Its place in the retrieval queue: its ``priority`` (Cohere v2's, lower first),
        within what its API key may ask for (403 otherwise)."""
        accounts = self.state.accounts
        key = None
        if self.access is not None and self.access.requires_key:
            from ._access import presented_key

            key = presented_key(request.asgi)
        account = request.account = accounts.account(key)
        ticket = accounts.ticket(account, request.owner, parsed.priority)
        # its key's rate limits: 429 before any work, the headers on every answer
        request.exchange.extra_headers = accounts.admit(request.owner, account)
        return ticket

    def charge(self, request: InFlightRequest, tokens: int) -> None:
        if request.account is not None:
            self.state.accounts.charge(request.owner, request.account, tokens)

    async def compute(self, backend: Backend, parsed: RerankQuery) -> tuple[Ranking, int]:
        ranking = await backend.rerank(
            parsed.query,
            parsed.documents,
            instruction=parsed.instruction,
            max_tokens_per_doc=parsed.max_tokens_per_doc,
            max_tokens=self.state.settings.max_embedding_tokens,
        )
        return ranking, ranking.prompt_tokens

    def encode(self, request: InFlightRequest, parsed: RerankQuery, result: Any, tokens: int) -> bytes:
        ranking: Ranking = result
        return rerank_response(
            parsed,
            ranking.scores,
            model=request.model or "",
            prompt_tokens=tokens,
            request_id=request.exchange.request_id,
            extension={
                "reranker": ranking.kind,
                "score": ranking.score,
                "prefix_tokens": ranking.prefix_tokens,
            },
        )

    def path_of(self, request: InFlightRequest) -> str:
        path = request.asgi["path"].rstrip("/")
        return path if path in RERANK_PATHS else self.path

    def encode_inline(self, result: Any) -> bool:
        return True  # (≤ 1,000 numbers)
