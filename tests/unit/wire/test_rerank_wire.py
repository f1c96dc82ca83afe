"""Reranking's wire shapes (``_wire/_rerank.py``): llama-server's / Jina's, TEI's and
Cohere's (v1 and v2) bodies read into one request, the fields not honoured refused by
name, and the answer in each shape, best first, cut to ``top_n``."""

from __future__ import annotations

import json

import pytest

from trioserve._core._exceptions import InvalidRequestError
from trioserve._wire._rerank import MAX_DOCUMENTS, decode_rerank_request, rerank_response


def read(body: dict[str, object], path: str = "/v1/rerank"):  # type: ignore[no-untyped-def]
    return decode_rerank_request(json.dumps(body).encode(), path)


def answer(body: dict[str, object], scores: list[float], path: str = "/v1/rerank") -> object:
    request = read(body, path)
    return json.loads(
        rerank_response(
            request, scores, model="m", prompt_tokens=42, request_id="r1", extension={"score": "logit"}
        )
    )


def test_jina_and_cohere_v1_documents_are_texts_or_objects_with_text() -> None:
    request = read({"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1, "return_documents": True})
    assert request.documents == ["a", "b"]
    assert (request.top_n, request.return_documents, request.shape) == (1, True, "jina")


def test_the_answer_is_best_first_cut_to_top_n_with_documents_when_asked() -> None:
    body = answer(
        {"query": "q", "documents": ["a", "b", "c"], "top_n": 2, "return_documents": True}, [0.1, 0.9, 0.5]
    )
    assert body["results"] == [  # type: ignore[index]
        {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
        {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
    ]
    assert body["usage"] == {"prompt_tokens": 42, "total_tokens": 42}  # type: ignore[index]
    assert body["meta"]["api_version"] == {"version": "1"}  # type: ignore[index]
    assert body["trioserve"] == {"request_id": "r1", "score": "logit"}  # type: ignore[index]


def test_ties_keep_the_documents_order() -> None:
    body = answer({"query": "q", "documents": ["a", "b", "c"]}, [0.5, 0.7, 0.5])
    assert [r["index"] for r in body["results"]] == [1, 0, 2]  # type: ignore[index]


def test_cohere_v2_has_its_meta_and_no_documents() -> None:
    body = answer({"model": "m", "query": "q", "documents": ["a", "b"]}, [0.2, 0.1], path="/v2/rerank")
    assert body["meta"]["api_version"] == {"version": "2"}  # type: ignore[index]
    assert body["meta"]["tokens"] == {"input_tokens": 42, "output_tokens": 0}  # type: ignore[index]
    assert "document" not in body["results"][0]  # type: ignore[index]
    with pytest.raises(InvalidRequestError) as caught:
        read({"query": "q", "documents": ["a"], "return_documents": True}, "/v2/rerank")
    assert caught.value.param == "return_documents"


def test_tei_texts_answer_as_a_list_with_text_when_asked() -> None:
    body = answer({"query": "q", "texts": ["a", "b"], "return_text": True}, [0.1, 0.2])
    assert body == [{"index": 1, "score": 0.2, "text": "b"}, {"index": 0, "score": 0.1, "text": "a"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", ""]}, "documents[1]"),
        ({"query": "q", "documents": ["a"], "texts": ["b"]}, "texts"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ({"query": "q", "documents": ["a"], "rank_fields": ["title"]}, "rank_fields"),
        ({"query": "q", "documents": ["a"], "max_chunks_per_doc": 10}, "max_chunks_per_doc"),
        ({"query": "q", "documents": ["a"], "relevant_spans": {"mode": "enabled"}}, "relevant_spans"),
        ({"query": "q", "documents": ["a"], "return_text": True}, "return_text"),
        ({"query": "q", "documents": ["a"] * (MAX_DOCUMENTS + 1)}, "documents"),
        ({"query": "q", "documents": [{"title": "no text"}]}, "documents[0]"),
        ({"query": 3, "documents": ["a"]}, "query"),
        ({"query": "q", "texts": ["a"], "raw_scores": False}, "raw_scores"),
        ({"query": "q", "texts": ["a"], "truncate": True}, "truncate"),
        ({"query": "q", "texts": ["a"], "truncation_direction": "Left"}, "truncation_direction"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        read(body)
    assert caught.value.param == param, caught.value.message


def test_relevant_spans_disabled_is_accepted() -> None:
    assert read({"query": "q", "documents": ["a"], "relevant_spans": {"mode": "disabled"}}).documents == ["a"]
