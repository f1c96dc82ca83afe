"""Decoding's parts that hold no scheduler state: what shapes the tokens drawn from a
decode call's logits, and which decode calls keep those logits exact (docs/batching.md,
docs/structured-output.md, docs/speculation.md).

One job per module, from the face down::

    _draw          one token drawn from one output's logits, its log-probabilities;
                   a request's LogitBias
    _grammar       constrained decoding with llguidance: GrammarCompiler, one TokenMask
                   per sequence
    _speculation   prompt-lookup drafting (Drafter), pure Python
    _reasoning     ReasoningTracker: where a reasoning model's text is, pure Python
    _invariance    load-time probes: which decode calls are batch-invariant on this
                   machine's kernels

Imports :mod:`trioserve._core` at most: nothing of a backend.
"""

from ._draw import LogitBias, draw, draw_special, logits_row, logprob_entry
from ._grammar import GrammarCompiler, TokenMask
from ._invariance import ProbeCalls, probe_invariant_width, probe_shared_context_limit, probe_verify_width
from ._reasoning import ReasoningTracker, marker_tokens
from ._speculation import (
    FAST_DRAFT,
    MAX_DRAFT,
    SHORTEST_DRAFT,
    SPLIT_KV_CONTEXT,
    Drafter,
    SpeculationStats,
)

__all__ = [
    "FAST_DRAFT",
    "MAX_DRAFT",
    "SHORTEST_DRAFT",
    "SPLIT_KV_CONTEXT",
    "Drafter",
    "GrammarCompiler",
    "LogitBias",
    "ProbeCalls",
    "ReasoningTracker",
    "SpeculationStats",
    "TokenMask",
    "draw",
    "draw_special",
    "logits_row",
    "logprob_entry",
    "marker_tokens",
    "probe_invariant_width",
    "probe_shared_context_limit",
    "probe_verify_width",
]
