"""One request inside the batch (:class:`Sequence`): what the scheduler thread keeps
of it from admission until it hands it back (:func:`hand_back`), grouped in small
records made once per sequence — what was asked (:class:`Asked`), the prompt cache's
bookkeeping (:class:`CacheWork`), speculation (:class:`Speculation`), what was
generated (:class:`Output`) — and its phase."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from typing import Any, Literal

import trio

from ..._core._backend import ChoiceGroup, GenerationProgress, PreparedPrompt
from ..._core._channel import PieceChannel
from ..._core._types import GenerationEnd
from .._cache import DiskEntry, StateBuffer, WindowMark, switched_salt
from .._decoding import Drafter, LogitBias, ReasoningTracker, TokenMask
from .._media import VisionPrompt
from ._adapters import AdapterSet, adapter_salt

__all__ = [
    "CANCELLED",
    "Asked",
    "CacheWork",
    "Output",
    "Phase",
    "Sequence",
    "Speculation",
    "hand_back",
    "hand_park",
]

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


@dataclasses.dataclass(slots=True, eq=False)
class Asked:
    """What the request asked for (``Sequence.asked``), fixed at submission — only the
    constraint's mask advances, token by token."""

    prompt: list[int]
    max_new: int
    #: its LoRA adapter set (docs/lora.md): its calls run with it, beside no other set
    adapters: AdapterSet
    #: whether its prompt's cells may be kept and reused (``GenerationRequest.cache_prompt``)
    cache_prompt: bool
    #: only cells of the same salt are reused (``GenerationRequest.cache_salt``, and
    #: the adapter set: :func:`~._adapters.adapter_salt`)
    salt: str
    #: plain greedy (temperature 0, no logit bias): the scheduler takes the argmax of
    #: the logits itself — the token llama.cpp's greedy sampler picks (the first
    #: maximum), without building its 262,144-entry candidate array per token
    greedy: bool
    #: the logit bias as arrays (made once per request: ``LlamaModel.prepare``), for
    #: the log-probabilities' distribution (the sampler chain has its own copy)
    bias: LogitBias | None
    #: constrained decoding: the mask applied to the logits before each draw
    mask: TokenMask | None
    #: report log-probabilities (and this many alternatives)
    logprobs: int | None
    #: needs the slow path per token: a mask, or log-probabilities
    special: bool
    #: its images (``_vision.VisionPrompt``: where they sit, what encodes them), if any
    media: VisionPrompt | None = None
    #: an activated LoRA's request (docs/lora.md, "Activated LoRA"): the prompt
    #: positions before ``switch`` run with ``prefix_adapters`` (its set less the aLoRA;
    #: a cut of its prompt), the rest with ``adapters``; 0: all with ``adapters``
    switch: int = 0
    prefix_adapters: AdapterSet = ()


@dataclasses.dataclass(slots=True, eq=False)
class CacheWork:
    """The prompt cache's bookkeeping of a sequence (``Sequence.cache``): where the
    canonical rule cuts its prompt (``_pieces.PieceRule``, set at admission), and
    admission's plan, carried out by the scheduler thread before the first chunk: the
    cached prefix to save to host memory before it is overwritten (``save``, under
    ``save_salt``), and the host-memory state to restore (``restore``, ``checkpoint``
    tokens)."""

    cuts: list[int] = dataclasses.field(default_factory=list)
    save: list[int] | None = None
    save_salt: str = ""
    checkpoint: int = 0
    restore: StateBuffer | bytes | DiskEntry | None = None
    #: admission found the whole prompt cached with its last logits (a full hit: the
    #: first token is drawn from the kept row, no call)
    whole: bool = False
    #: its id keeps the prompt's last logits (copied when its prompt ended on a cut,
    #: or kept by a full hit), for the next request of the same prompt
    row_kept: bool = False
    #: the checkpoint of the id's window cells to restore before the first call
    #: (``Placement.window``: the cells alone no longer give back the reused prefix)
    window: WindowMark | None = None


@dataclasses.dataclass(slots=True, eq=False)
class Speculation:
    """Speculative decoding (``Sequence.spec``, docs/speculation.md): every draw, greedy
    or sampled. A guess is accepted when the row's own draw (argmax, or the request's
    sampler chain, advanced token by token) equals it: for a draft that is one token
    per position, this is the standard acceptance rule (accept with probability
    p(guess), else draw from p without the guess), and it consumes the sampler's random
    numbers as a one-token step does: a seeded text is unchanged."""

    #: the request's ``speculate``
    speculate: bool
    drafter: Drafter | None = None
    #: the tokens guessed for the decode call being planned or in flight
    draft: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True, eq=False)
class Output:
    """What a sequence has generated (``Sequence.out``)."""

    generated: int = 0
    #: the tokens generated so far (the reply, for the idle recompute of its chunks)
    generated_tokens: list[int] = dataclasses.field(default_factory=list)
    #: the token drawn and not yet decoded (-1: none)
    next_token: int = -1
    first_chunk_at: float = 0.0


class Sequence:
    """One request inside the batch: its records (:class:`Asked`, :class:`CacheWork`,
    :class:`Speculation`, :class:`Output`), made once per sequence, and where it is.
    Fields are written by one side only:

    * Trio side: ``cancelled``, ``pause_asked``, ``force_asked`` (set only; the thread
      clears it); everything while it is parked (``parked_out``);
    * scheduler thread: everything else until it hands the sequence back.
    """

    __slots__ = (
        "asked",
        "cache",
        "cancelled",
        "channel",
        "choice",
        "followers",
        "force_asked",
        "forced",
        "group",
        "leader",
        "out",
        "park",
        "parked_out",
        "pause_asked",
        "pos",
        "prefilled",
        "priority",
        "progress",
        "reasoning",
        "reasoning_tokens",
        "removed",
        "result",
        "sampler",
        "saved",
        "saved_window",
        "seq_id",
        "spec",
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
        request = prompt.request
        mask: TokenMask | None = None
        compiled = prompt.compiled
        if isinstance(compiled, TokenMask):
            # a copy: the compiled mask stays fresh for the other choices (and for a
            # prepared prompt streamed again)
            mask = compiled.copy()
        adapters = prompt.adapters
        switch = prompt.alora[1] if prompt.alora is not None else 0
        prefix = tuple(a for a in adapters if prompt.alora is None or a[0] != prompt.alora[0])
        # (an aLoRA's prompt: the cells before its switch are cached as its prefix set's)
        salt = adapter_salt(request.cache_salt, adapters)
        salt = switched_salt(adapter_salt(request.cache_salt, prefix), switch, salt)
        self.asked = Asked(
            prompt=tokens if isinstance(tokens, list) else list(tokens),
            max_new=prompt.max_new_tokens,
            adapters=adapters,
            cache_prompt=request.cache_prompt,
            salt=salt,
            greedy=request.sampling.plain_greedy,
            bias=bias,
            mask=mask,
            logprobs=request.logprobs,
            special=mask is not None or request.logprobs is not None,
            media=prompt.media if isinstance(prompt.media, VisionPrompt) else None,
            switch=switch,
            prefix_adapters=prefix,
        )
        self.cache = CacheWork()
        # (no guesses with LoRA adapters: a verify call's rows are exact only where the
        # widths measured at load say so, and those were measured on the base weights;
        # the adapters' own matmuls take other kernels by width — docs/lora.md)
        self.spec = Speculation(speculate=request.speculate and not prompt.adapters)
        self.out = Output()
        self.progress = progress
        progress.piece_per_token = True  # _emit: one piece per token drawn
        self.sampler = sampler
        #: ``n`` > 1: the request's choices; a follower waits for its leader's prompt
        #: evaluation and starts from a copy of its cells
        self.group: ChoiceGroup | None = prompt.group
        self.choice = prompt.choice
        self.leader: Sequence | None = None
        self.followers: list[Sequence] = []
        self.token = trio.lowlevel.current_trio_token()
        self.channel = channel
        #: set when the scheduler hands it back — removed (``result`` set) or set aside
        #: (``park``); a new one for each resume
        self.removed = trio.Event()
        #: preemption (docs/scheduling.md): asked to pause (the Trio side, under the
        #: lock); set aside with its state (``saved``) and out of the scheduler, owned by
        #: the Trio side until it resumes (``parked_out``, under the lock); what the last
        #: ask came to
        #: its request's priority (lower first), for the planner
        self.priority = progress.preemption.ticket.priority if progress.preemption is not None else 0
        self.pause_asked = False
        self.parked_out = False
        self.saved: StateBuffer | None = None
        #: the first position whose window cells ``saved`` really holds (its id's cells
        #: were set from a state: :meth:`~._kv.KvCells.set_state`)
        self.saved_window = 0
        self.park: Literal["parked", "declined"] | None = None
        self.result: GenerationEnd | Literal["cancelled"] | BaseException | None = None
        self.cancelled = False
        #: ending the reasoning on request (docs/dialects.md, "Ending the reasoning"): where
        #: the text is (``None``: not armed — the model does not reason here, or the
        #: request said ``reasoning_control: false``), the markers' tokens, the ask (from
        #: Trio: ``Inbox.force``) and the tokens it still forces, one per draw
        #: (``Outputs.emit``)
        markers = request.reasoning
        self.reasoning: ReasoningTracker | None = None
        self.reasoning_tokens = prompt.reasoning_tokens or ((), ())
        if markers is not None and prompt.reasoning_tokens is not None and mask is None:
            self.reasoning = ReasoningTracker(markers.start, markers.end, opened=markers.opened)
        self.force_asked = progress.reasoning_end_asked
        self.forced: deque[int] = deque()
        self.seq_id = -1
        self.prefilled = 0
        self.pos = 0

    @property
    def adapters(self) -> AdapterSet:
        """The adapter set of its next call: before an aLoRA's switch, its prefix set."""
        asked = self.asked
        return asked.prefix_adapters if self.prefilled < asked.switch else asked.adapters

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.asked.prompt)

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


def hand_park(sequence: Sequence, outcome: Literal["parked", "declined"]) -> None:
    """Tell the request that ``sequence`` was set aside (``parked``: out of the
    scheduler, its state in ``saved``) or will not be (``declined``)."""
    sequence.park = outcome
    hand_back(sequence)


def hand_back(sequence: Sequence) -> None:
    """Tell the request that the scheduler is done with ``sequence`` (after its last
    piece: the channel keeps their order)."""
    try:
        sequence.token.run_sync_soon(sequence.removed.set)
    except trio.RunFinishedError:  # pragma: no cover - its run ended without waiting
        logger.warning("a sequence outlived its Trio run")
