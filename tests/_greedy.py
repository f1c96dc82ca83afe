"""Two programs' greedy texts, compared as far as their numbers allow.

trioserve beside llama-server on the same files: the same prompt in other calls (other
widths, another cut) gives log-probabilities that differ by up to ~0.1 nat (measured on
the default model, docs/lora.md; on an Intel Xeon with AVX-512, 0.1 nat where one image
chat's texts part, docs/vision.md). A greedy text turns on a near tie now and then, and
which near tie depends on the CPU's kernels: a test that asks for equal texts passes on
one machine and fails on another. So: equal texts, or texts equal up to a token where
both programs saw the same two candidates at the top within :data:`NEAR` of each other
and each took one of them — with every shared token's log-probability within
:data:`NEAR` of the other program's. A real difference (a lost adapter, an image in the
wrong place, another prompt) moves log-probabilities by far more and fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: how far apart two programs' log-probabilities of one token may be, and how close two
#: candidates must be for a greedy choice between them to turn on that (nats)
NEAR = 0.25


@dataclass(frozen=True)
class Step:
    token: str
    logprob: float
    #: the best candidates at this step: text → log-probability
    top: dict[str, float]


def steps(logprobs: dict[str, Any]) -> list[Step]:
    """A choice's ``logprobs`` as steps: the chat shape (``content``: a list of tokens
    with ``top_logprobs``, which llama-server also answers completions with) or the
    legacy completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``)."""
    if "content" in logprobs:
        return [
            Step(
                e["token"],
                e["logprob"],
                {alt["token"]: alt["logprob"] for alt in e.get("top_logprobs") or ()},
            )
            for e in logprobs["content"]
        ]
    return [
        Step(token, logprob, dict(top or {}))
        for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        )
    ]


def assert_same_greedy_text(label: object, ours: list[Step], theirs: list[Step]) -> None:
    mine = [s.token for s in ours]
    other = [s.token for s in theirs]
    at = next(
        (i for i, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), min(len(mine), len(other))
    )
    for i in range(at):  # the shared tokens: each as likely in both programs
        assert abs(ours[i].logprob - theirs[i].logprob) < NEAR, (label, i, ours[i], theirs[i])
    if mine == other:
        return
    assert at < min(len(mine), len(other)), (label, "one text is the other's beginning", mine, other)
    # where they part: the same two candidates at the top of both, a near tie in each,
    # and each program took one of them
    tops = [ours[at].top, theirs[at].top]
    assert set(tops[0]) == set(tops[1]) == {mine[at], other[at]}, (label, at, mine, other, tops)
    for top in tops:
        first, second = sorted(top.values(), reverse=True)
        assert first - second < NEAR, (label, at, mine, other, tops)
