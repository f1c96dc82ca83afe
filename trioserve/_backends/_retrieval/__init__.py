"""Retrieval on a loaded model: embeddings and rerank (docs/embeddings.md, docs/rerank.md).

One job per module, from the face down::

    _rerank          Reranker: a cross-encoder's pairs through a rank context, or a
                     generative model's "yes" probability (YesNoContext)
    _embeddings      EmbeddingContext (one llama context with embeddings on: batches,
                     pooling), Embedder (one request at a time, abort on cancel)
    _turns           CpuTurns: the cores' first-come turns, one decode call at a time,
                     shared with the generation scheduler
    _rerank_layout   the pure parts: the yes/no template, a pair's tokens, the probability
    _model_view      ModelView: what retrieval reads of the loaded model, a protocol, so
                     that the model imports its retrieval and never the reverse

Imports :mod:`trioserve._core` and the backends' abort callback, nothing of a backend.
"""

from ._embeddings import Embedder, EmbeddingContext
from ._model_view import ModelView
from ._rerank import Reranker, reranker_kind
from ._rerank_layout import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, YesNoTemplate
from ._turns import CpuTurns

__all__ = [
    "DEFAULT_INSTRUCTION",
    "DEFAULT_TEMPLATE",
    "CpuTurns",
    "Embedder",
    "EmbeddingContext",
    "ModelView",
    "Reranker",
    "YesNoTemplate",
    "reranker_kind",
]
