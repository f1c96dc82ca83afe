"""Reranking's pure parts (docs/rerank.md): the yes/no prompt, a cross-encoder's pair
as llama-server lays it, the "yes" probability. No llama.cpp, no Trio (unit-tested:
tests/unit/backends/test_rerank_layout.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_TEMPLATE",
    "SOFTMAX_ARCHITECTURES",
    "RerankKind",
    "YesNoTemplate",
    "pair_tokens",
    "templated_pair",
    "yes_probability",
]

RerankKind = Literal["cross-encoder", "yes-no"]
#: Qwen3-Reranker's default task line
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
#: a yes/no prompt for a model without one of its own (Qwen3-Reranker's wording; its
#: published template, with its chat markers, is in docs/rerank.md for its preset)
DEFAULT_TEMPLATE = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}\nAnswer (yes or no):\n"
)
#: the architectures whose rank graph ends in a softmax (llama.cpp's build_pooling)
SOFTMAX_ARCHITECTURES = frozenset({"qwen3", "qwen3vl"})


@dataclass(frozen=True, slots=True)
class YesNoTemplate:
    """A ``yes-no`` reranker's prompt: the text before ``{document}`` (holding
    ``{query}`` and, optionally, ``{instruction}``) and the text after it. Filled by
    splitting, never by ``str.format``: braces in a query or a document are text."""

    head: str
    tail: str

    @classmethod
    def parse(cls, text: str) -> YesNoTemplate:
        """Raises ``ValueError`` naming what is wrong."""
        for name in ("{query}", "{document}"):
            if text.count(name) != 1:
                raise ValueError(
                    f"a rerank template must hold {name} exactly once (found {text.count(name)})"
                )
        if text.count("{instruction}") > 1:
            raise ValueError("a rerank template may hold {instruction} at most once")
        head, tail = text.split("{document}")
        if "{query}" not in head or "{instruction}" in tail:
            raise ValueError(
                "a rerank template must place {query} (and {instruction}) before {document}: "
                "the text before the document is the prefix every document shares"
            )
        return cls(head, tail)

    def prefix(self, query: str, instruction: str) -> str:
        return "".join(text for text, _ in self.prefix_segments(query, instruction))

    def prefix_segments(self, query: str, instruction: str) -> list[tuple[str, bool]]:
        """The prefix as ``(text, is_template)`` pieces, in order: the template's own
        text (its special tokens read as such) and the user's (read as plain text, so a
        query cannot close the turn the template opened). Empty pieces are left out."""
        out: list[tuple[str, bool]] = []
        for i, part in enumerate(self.head.split("{query}")):
            if i:
                out.append((query, False))
            for j, piece in enumerate(part.split("{instruction}")):
                if j:
                    out.append((instruction, False))
                out.append((piece, True))
        return [(text, template) for text, template in out if text]

    @property
    def has_instruction(self) -> bool:
        return "{instruction}" in self.head


def pair_tokens(
    query: Sequence[int],
    document: Sequence[int],
    *,
    bos: int,
    eos: int,
    sep: int,
    add_bos: bool,
    add_eos: bool,
    add_sep: bool,
) -> list[int]:
    """A cross-encoder's pair as llama-server lays it without a rerank template
    (``format_prompt_rerank``): BOS? query EOS? SEP? document EOS? — EOS falling back to
    SEP when the vocabulary has none."""
    end = eos if eos >= 0 else sep
    out: list[int] = []
    if add_bos:
        out.append(bos)
    out.extend(query)
    if add_eos:
        out.append(end)
    if add_sep:
        out.append(sep)
    out.extend(document)
    if add_eos:
        out.append(end)
    return out


def templated_pair(template: str, query: str, document: str) -> str:
    """A cross-encoder's pair through the GGUF's rerank template (``{query}``,
    ``{document}``): each placeholder filled once, user text never re-read for
    placeholders."""
    return document.join(part.replace("{query}", query) for part in template.split("{document}"))


def yes_probability(yes: float, no: float) -> float:
    """``exp(yes) / (exp(yes) + exp(no))`` in float64, stable for any logits."""
    return 1.0 / (1.0 + math.exp(min(700.0, float(no) - float(yes))))
