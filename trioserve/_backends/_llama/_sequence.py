"""One request inside the batch (:class:`Sequence`): what the scheduler thread keeps
of it from admission until it hands it back (:func:`hand_back`), and its phase."""

from __future__ import annotations

import enum
import logging
from typing import Any, Literal

import trio

from ..._core._backend import ChoiceGroup, GenerationProgress, PreparedPrompt
from ..._core._channel import PieceChannel
from ..._core._types import GenerationEnd
from .._disk_cache import DiskEntry
from .._draw import LogitBias
from .._grammar import TokenMask
from .._memory import StateBuffer
from .._speculation import Drafter

__all__ = ["CANCELLED", "Phase", "Sequence", "hand_back"]

logger = logging.getLogger("trioserve.llama")

#: the result of a sequence dropped because its request was cancelled
CANCELLED: Literal["cancelled"] = "cancelled"


class Phase(enum.Enum):
    """Where a sequence is (``Sequence.phase``): queued without an id, waiting for its
    leader's prompt (a later choice of ``n`` > 1), evaluating its prompt, decoding, or
    handed back with its result."""

    QUEUED = "queued"
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Sequence:
    """One request inside the batch. Fields are written by one side only:

    * Trio side: ``cancelled``;
    * scheduler thread: everything else until it hands the sequence back.
    """

    __slots__ = (
        "bias",
        "cache_prompt",
        "cancelled",
        "channel",
        "checkpoint",
        "choice",
        "cuts",
        "draft",
        "drafter",
        "first_chunk_at",
        "followers",
        "generated",
        "generated_tokens",
        "greedy",
        "group",
        "leader",
        "logprobs",
        "mask",
        "max_new",
        "next_token",
        "pos",
        "prefilled",
        "progress",
        "prompt",
        "removed",
        "restore",
        "result",
        "salt",
        "sampler",
        "save",
        "save_salt",
        "seq_id",
        "special",
        "speculate",
        "token",
    )

    def __init__(
        self,
        prompt: PreparedPrompt,
        progress: GenerationProgress,
        sampler: Any,
        channel: PieceChannel,
        bias: LogitBias | None = None,
    ) -> None:
        tokens = prompt.tokens
        self.prompt: list[int] = tokens if isinstance(tokens, list) else list(tokens)
        self.max_new = prompt.max_new_tokens
        self.cache_prompt = prompt.request.cache_prompt
        #: only cells of the same salt are reused (``GenerationRequest.cache_salt``)
        self.salt = prompt.request.cache_salt
        self.progress = progress
        progress.piece_per_token = True  # _emit: one piece per token drawn
        self.sampler = sampler
        #: plain greedy (temperature 0, no logit bias): the scheduler takes the argmax of
        #: the logits itself — the token llama.cpp's greedy sampler picks (the first
        #: maximum), without building its 262,144-entry candidate array per token
        sampling = prompt.request.sampling
        self.greedy = sampling.plain_greedy
        #: the logit bias as arrays (made once per request: ``LlamaModel.prepare``), for
        #: the log-probabilities' distribution (the sampler chain has its own copy)
        self.bias = bias
        #: constrained decoding: the mask applied to the logits before each draw
        self.mask: TokenMask | None = None
        compiled = prompt.compiled
        if isinstance(compiled, TokenMask):
            # a copy: the compiled mask stays fresh for the other choices (and for a
            # prepared prompt streamed again)
            self.mask = compiled.copy()
        #: report log-probabilities (and this many alternatives)
        self.logprobs = prompt.request.logprobs
        #: needs the slow path per token: a mask, or log-probabilities
        self.special = self.mask is not None or self.logprobs is not None
        #: ``n`` > 1: the request's choices; a follower waits for its leader's prompt
        #: evaluation and starts from a copy of its cells
        self.group: ChoiceGroup | None = prompt.group
        self.choice = prompt.choice
        self.leader: Sequence | None = None
        self.followers: list[Sequence] = []
        self.token = trio.lowlevel.current_trio_token()
        self.channel = channel
        self.removed = trio.Event()
        self.result: GenerationEnd | Literal["cancelled"] | BaseException | None = None
        self.cancelled = False
        self.seq_id = -1
        self.prefilled = 0
        #: where the canonical rule cuts the prompt (``_pieces.PieceRule``), set at admission
        self.cuts: list[int] = []
        self.pos = 0
        self.generated = 0
        #: the tokens generated so far (the reply, for the idle recompute of its chunks)
        self.generated_tokens: list[int] = []
        self.next_token = -1
        self.first_chunk_at = 0.0
        #: admission's plan, carried out by the scheduler thread before the first chunk:
        #: the cached prefix to save to host memory before it is overwritten, and the
        #: host-memory state to restore
        self.save: list[int] | None = None
        self.save_salt = ""
        self.checkpoint = 0
        self.restore: StateBuffer | bytes | DiskEntry | None = None
        #: speculative decoding (docs/speculation.md): every draw, greedy or sampled. A
        #: guess is accepted when the row's own draw (argmax, or the request's sampler
        #: chain, advanced token by token) equals it: for a draft that is one token per
        #: position, this is the standard acceptance rule (accept with probability
        #: p(guess), else draw from p without the guess), and it consumes the sampler's
        #: random numbers as a one-token step does: a seeded text is unchanged
        self.speculate = prompt.request.speculate
        self.drafter: Drafter | None = None
        #: the tokens guessed for the decode call being planned or in flight
        self.draft: list[int] = []

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def phase(self) -> Phase:
        """Derived from the fields the scheduler thread writes (one truth, no second
        copy to keep in step)."""
        if self.result is not None:
            return Phase.DONE
        if self.seq_id < 0:
            return Phase.QUEUED
        if self.leader is not None:
            return Phase.WAITING
        return Phase.DECODE if self.decoding else Phase.PREFILL


def hand_back(sequence: Sequence) -> None:
    """Tell the request that the scheduler is done with ``sequence`` (after its last
    piece: the channel keeps their order)."""
    try:
        sequence.token.run_sync_soon(sequence.removed.set)
    except trio.RunFinishedError:  # pragma: no cover - its run ended without waiting
        logger.warning("a sequence outlived its Trio run")
