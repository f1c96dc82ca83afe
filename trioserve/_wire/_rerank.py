"""Reranking's wire shapes, sans-IO (docs/rerank.md): a body of llama-server's / Jina's,
TEI's or Cohere's (v1, v2) shape in, one :class:`RerankQuery` out; the scores in, the
answer in the shape the route and the body asked for out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from ._codec import decode as _decode
from ._codec import encode_json

__all__ = ["RerankQuery", "decode_rerank_request", "rerank_response"]

#: documents per request, at most (Cohere's limit)
MAX_DOCUMENTS = 1000
Shape = Literal["jina", "cohere-v2", "tei"]


class _Document(msgspec.Struct):
    text: str


class _RelevantSpans(msgspec.Struct):
    mode: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str | None = None
    #: texts, or objects with ``text`` (Jina, Cohere v1)
    documents: list[str | _Document] | None = None
    #: TEI's name for the documents
    texts: list[str] | None = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = False
    return_text: bool = False
    max_tokens_per_doc: int | None = None
    instruction: str | None = None
    priority: int | None = None
    user: str | None = None
    # TEI's: its scores are the model's raw ones here (as llama-server's)
    raw_scores: bool | None = None
    truncate: bool | None = None
    truncation_direction: str | None = None
    # known, not honoured: refused by name when given
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None
    relevant_spans: _RelevantSpans | None = None


_decoder = msgspec.json.Decoder(RerankRequest)


@dataclass(frozen=True, slots=True)
class RerankQuery:
    """A rerank request, read: what the backend needs and how to answer."""

    query: str
    documents: list[str]
    model: str | None
    top_n: int
    return_documents: bool
    max_tokens_per_doc: int | None
    instruction: str | None
    priority: int | None
    shape: Shape


def decode_rerank_request(body: bytes, path: str) -> RerankQuery:
    """The body of ``POST path``; a 400 naming the field for anything wrong."""
    raw = _decode(_decoder, body)
    if raw.rank_fields is not None:
        raise InvalidRequestError(
            "rank_fields is not supported: documents are ranked by their text; send documents as texts "
            "or objects with a text field",
            param="rank_fields",
        )
    if raw.max_chunks_per_doc is not None:
        raise InvalidRequestError(
            "max_chunks_per_doc is not supported: a document is scored whole; send max_tokens_per_doc to "
            "cut long documents",
            param="max_chunks_per_doc",
        )
    if raw.relevant_spans is not None and raw.relevant_spans.mode != "disabled":
        raise InvalidRequestError(
            "relevant_spans is not supported: only a score per document is computed", param="relevant_spans"
        )
    if raw.raw_scores is False:
        raise InvalidRequestError(
            "raw_scores false (TEI's sigmoid) is not supported: the scores are the model's own "
            "(trioserve.score says whether a logit or a probability); send raw_scores true or leave it out",
            param="raw_scores",
        )
    if raw.truncate:
        raise InvalidRequestError(
            "truncate is not supported: send max_tokens_per_doc to cut long documents", param="truncate"
        )
    if raw.truncation_direction is not None:
        raise InvalidRequestError(
            "truncation_direction is not supported: max_tokens_per_doc keeps a document's start",
            param="truncation_direction",
        )
    if raw.query is None:
        raise InvalidRequestError(
            "query must be given: the text the documents are ranked against", param="query"
        )
    if not raw.query:
        raise InvalidRequestError("query is empty", param="query")
    if raw.documents is not None and raw.texts is not None:
        raise InvalidRequestError("send documents or texts (TEI's name), not both", param="texts")
    tei = raw.texts is not None
    given = raw.texts if tei else raw.documents
    if not given:
        name = "texts" if tei else "documents"
        raise InvalidRequestError(f"{name} must be a non-empty list of texts", param=name)
    if len(given) > MAX_DOCUMENTS:
        raise InvalidRequestError(
            f"at most {MAX_DOCUMENTS} documents per request; got {len(given)}", param="documents"
        )
    documents = [item if isinstance(item, str) else item.text for item in given]
    for i, document in enumerate(documents):
        if not document:
            raise InvalidRequestError(f"documents[{i}] is empty", param=f"documents[{i}]")
    if raw.top_n is not None and raw.top_n < 1:
        raise InvalidRequestError(f"top_n must be at least 1; got {raw.top_n}", param="top_n")
    if raw.max_tokens_per_doc is not None and raw.max_tokens_per_doc < 1:
        raise InvalidRequestError(
            f"max_tokens_per_doc must be at least 1; got {raw.max_tokens_per_doc}", param="max_tokens_per_doc"
        )
    if raw.return_text and not tei:
        raise InvalidRequestError(
            "return_text is TEI's (with texts); with documents send return_documents", param="return_text"
        )
    shape: Shape = "tei" if tei else ("cohere-v2" if path.startswith("/v2/") else "jina")
    if shape == "cohere-v2" and raw.return_documents:
        raise InvalidRequestError(
            "return_documents is not part of Cohere's v2 rerank (the results hold indexes); use /v1/rerank "
            "for documents in the answer",
            param="return_documents",
        )
    return RerankQuery(
        query=raw.query,
        documents=documents,
        model=raw.model,
        top_n=min(raw.top_n or len(documents), len(documents)),
        return_documents=raw.return_documents or raw.return_text,
        max_tokens_per_doc=raw.max_tokens_per_doc,
        instruction=raw.instruction,
        priority=raw.priority,
        shape=shape,
    )


def rerank_response(
    request: RerankQuery,
    scores: Sequence[float],
    *,
    model: str,
    prompt_tokens: int,
    request_id: str,
    extension: dict[str, Any],
) -> bytes:
    """The answer: results best first (ties: the earlier document first), ``top_n`` of
    them, in the request's shape."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: request.top_n]
    documents = request.documents
    if request.shape == "tei":
        return encode_json(
            [
                {
                    "index": i,
                    "score": scores[i],
                    **({"text": documents[i]} if request.return_documents else {}),
                }
                for i in order
            ]
        )
    results = [
        {
            "index": i,
            "relevance_score": scores[i],
            **({"document": {"text": documents[i]}} if request.return_documents else {}),
        }
        for i in order
    ]
    version = "2" if request.shape == "cohere-v2" else "1"
    meta: dict[str, Any] = {"api_version": {"version": version}, "billed_units": {"search_units": 1}}
    if version == "2":
        meta["tokens"] = {"input_tokens": prompt_tokens, "output_tokens": 0}
    return encode_json(
        {
            "id": request_id,
            "object": "list",
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "meta": meta,
            "trioserve": {"request_id": request_id, **extension},
        }
    )
