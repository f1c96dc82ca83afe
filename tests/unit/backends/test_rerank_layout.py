"""Reranking's pure parts (``_backends/_retrieval/_rerank_layout.py``): the yes/no template, the
cross-encoder's pair as llama-server lays it (``format_prompt_rerank``), and the "yes"
probability. The same layouts on real files beside llama-server: tests/e2e/test_rerank.py."""

from __future__ import annotations

import math

import pytest

from trioserve._backends._retrieval._rerank_layout import (
    DEFAULT_TEMPLATE,
    YesNoTemplate,
    pair_tokens,
    templated_pair,
    yes_probability,
)

BOS, EOS, SEP = 101, 1, 102


def test_the_default_template_parses_and_splits_at_the_document() -> None:
    template = YesNoTemplate.parse(DEFAULT_TEMPLATE)
    assert template.has_instruction
    prefix = template.prefix("Where is Rome?", "Find the place")
    assert prefix.endswith("<Query>: Where is Rome?\n<Document>: ")
    assert "<Instruct>: Find the place\n" in prefix
    assert template.tail == "\nAnswer (yes or no):\n"


def test_the_prefix_keeps_the_users_text_apart_from_the_templates() -> None:
    template = YesNoTemplate.parse("<s>I: {instruction}\nQ: {query}\nD: {document}</s>")
    assert template.prefix_segments("q <end>", "task") == [
        ("<s>I: ", True),
        ("task", False),
        ("\nQ: ", True),
        ("q <end>", False),
        ("\nD: ", True),
    ]


def test_braces_in_the_query_are_text_never_placeholders() -> None:
    template = YesNoTemplate.parse("Q: {query} I: {instruction} D: {document}!")
    assert (
        template.prefix("{instruction} {document} {0}", "task")
        == "Q: {instruction} {document} {0} I: task D: "
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("no placeholders", "{query} exactly once"),
        ("{query} {query} {document}", "{query} exactly once"),
        ("{query}", "{document} exactly once"),
        ("{document} {query}", "before {document}"),
        ("{query} {document} {instruction}", "before {document}"),
        ("{instruction}{instruction} {query} {document}", "at most once"),
    ],
)
def test_a_bad_template_is_refused_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match="rerank template") as caught:
        YesNoTemplate.parse(text)
    assert problem in str(caught.value)


def test_a_bert_pair_is_cls_query_sep_document() -> None:
    # WordPiece: add_bos (CLS) and add_sep, no EOS (llama.cpp's defaults for "bert")
    flags = dict(bos=BOS, eos=-1, sep=SEP, add_bos=True, add_eos=False, add_sep=True)
    assert pair_tokens([5, 6], [7], **flags) == [BOS, 5, 6, SEP, 7]


def test_a_pair_with_eos_closes_both_texts_and_falls_back_to_sep() -> None:
    # XLM-R (bge-reranker): add_eos, its EOS after the query and the document
    flags = dict(bos=BOS, eos=EOS, sep=SEP, add_bos=True, add_eos=True, add_sep=True)
    assert pair_tokens([5], [7], **flags) == [BOS, 5, EOS, SEP, 7, EOS]
    # no EOS in the vocabulary: SEP stands for it
    flags["eos"] = -1
    assert pair_tokens([5], [7], **flags) == [BOS, 5, SEP, SEP, 7, SEP]
    flags.update(add_bos=False, add_sep=False)
    assert pair_tokens([5], [7], **flags) == [5, SEP, 7, SEP]


def test_a_gguf_rerank_template_fills_each_placeholder_once() -> None:
    template = "<q>{query}</q><d>{document}</d>"
    assert templated_pair(template, "a {document}", "b {query}") == "<q>a {document}</q><d>b {query}</d>"
    assert templated_pair(template, "a\x00b", "DOC") == "<q>a\x00b</q><d>DOC</d>"


def test_the_yes_probability_is_the_two_way_softmax_and_never_overflows() -> None:
    assert yes_probability(0.0, 0.0) == 0.5
    assert math.isclose(yes_probability(2.0, 1.0), math.exp(2) / (math.exp(2) + math.exp(1)))
    assert yes_probability(1e6, -1e6) == 1.0
    assert 0.0 <= yes_probability(-1e6, 1e6) < 1e-300
