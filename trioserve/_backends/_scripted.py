"""A scripted backend: deterministic tokens at a set pace, for tests and benchmarks.

It behaves like the llama.cpp backend where the engine can tell: it runs in a worker
thread (:class:`~trioserve._backends._threaded.ThreadedBackend`), "prefills" for a time
proportional to the prompt, emits one piece per ``token_interval``, and checks the abort
flag between tokens and every millisecond inside prefill; a decode step waits on the
abort flag (:class:`~trioserve._backends._threaded.AbortFlag`: one wake per step, an
abort wakes it at once), so a paced stream costs the stack's work, not a poll loop's. Its tokenizer
is UTF-8 bytes: one token per byte (a vocabulary of 256 ids, no special tokens).

It plays a reasoning model when its chat template has reasoning markers and its script
holds the reasoning (``SCRIPT`` in ``tests/e2e/test_reasoning.py``): asked to end the
reasoning (``EventStream.end_reasoning``), it writes the end marker as its next piece,
then goes on with the script after the script's own end marker — the answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import trio

from .._core._backend import (
    ControlOutcome,
    GenerationProgress,
    ModelInfo,
    PreparedPrompt,
    check_token_ids,
    fit_to_context,
    refuse_unsupported,
)
from .._core._channel import Aborted, PieceChannel
from .._core._types import GenerationEnd, GenerationRequest, ReasoningMarkers
from ._decoding import ReasoningTracker
from ._threaded import AbortFlag, Emit, ThreadedBackend

__all__ = ["ScriptedBackend"]

#: granularity of the abort check inside a simulated prefill or decode step
_ABORT_CHECK_INTERVAL = 0.001


def _default_script() -> list[bytes]:
    return [f" tok{i}".encode() for i in range(100_000)]


class ScriptedBackend(ThreadedBackend):
    """Emits ``script`` one piece at a time, then end-of-sequence.

    Args:
        script: the pieces (bytes, so tests can split UTF-8 characters across pieces).
            Default: `` tok0``, `` tok1``, … (long enough never to end on its own).
        token_interval: seconds per decode step.
        prefill_seconds_per_token: seconds of simulated prompt processing per prompt byte.
        slots: concurrent generations.
        context_length: the simulated context size.
        model_id: the name ``/v1/models`` reports.
        chat_template: a Jinja chat template for the chat endpoints (default: none, the
            fallback format).
    """

    ends_reasoning = True

    def __init__(
        self,
        script: Sequence[bytes] | None = None,
        *,
        token_interval: float = 0.0,
        prefill_seconds_per_token: float = 0.0,
        slots: int = 1,
        context_length: int = 4096,
        model_id: str = "scripted",
        chat_template: str | None = None,
    ) -> None:
        super().__init__()
        self.script = list(script) if script is not None else _default_script()
        self.token_interval = token_interval
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self._slots = slots
        self._info = ModelInfo(
            id=model_id, context_length=context_length, architecture="scripted", chat_template=chat_template
        )
        #: per finished or cancelled generation: how many pieces it emitted
        self.completed_runs: list[int] = []

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def slots(self) -> int:
        return self._slots

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        refuse_unsupported(request, "scripted")
        if isinstance(request.prompt, str):
            data = request.prompt.encode()
            if len(data) >= self._info.context_length:
                return fit_to_context(request, data, self._info.context_length)  # (refused)
            tokens: Sequence[int] = await _byte_tokens(data)
        else:
            tokens = list(request.prompt)
        return fit_to_context(request, tokens, self._info.context_length)

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return await _byte_tokens(text.encode())  # no special tokens: both flags change nothing

    async def count_text_tokens(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> int:
        return len(text.encode())  # (a copy at memory speed: no list of ints)

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        check_token_ids(tokens, 256)
        return [bytes((token,)) for token in tokens]

    async def generate(
        self,
        prompt: PreparedPrompt,
        channel: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        markers = prompt.request.reasoning
        if markers is None or not prompt.request.reasoning_control:
            return await self.run_in_thread(self._infer, prompt, channel, progress)
        control = _Control(markers)
        control.asked = progress.reasoning_end_asked
        progress.control = control.ask
        try:
            return await self.run_in_thread(
                lambda *args: self._infer(*args, control=control), prompt, channel, progress
            )
        finally:
            progress.control = None

    def _infer(
        self,
        prompt: PreparedPrompt,
        emit: Emit,
        aborted: Callable[[], bool],
        progress: GenerationProgress,
        *,
        control: _Control | None = None,
    ) -> GenerationEnd:
        emitted = 0
        progress.piece_per_token = True  # each piece of the script counts as a token
        try:
            started = time.perf_counter()
            _busy_wait(len(prompt.tokens) * self.prefill_seconds_per_token, aborted)
            progress.prefill_seconds = time.perf_counter() - started
            script = self.script
            index = 0
            while index < len(script):
                piece = script[index]
                index += 1
                if emitted >= prompt.max_new_tokens:
                    return "length"
                if isinstance(aborted, AbortFlag) and self.token_interval > 0:
                    if aborted() or aborted.wait(self.token_interval):
                        raise Aborted
                else:
                    _busy_wait(self.token_interval, aborted)
                if control is not None:
                    if control.asked:
                        control.asked = False
                        forced = control.tracker.text_to_force().encode()
                        if forced:  # (none: the script's own marker came first)
                            piece = forced
                            index = _after_marker(script, control.markers, index - 1)
                    control.tracker.feed(piece)
                progress.completion_tokens += 1
                emit(piece)
                emitted += 1
            return "stop"
        finally:
            if control is not None:
                control.finished = True
            self.completed_runs.append(emitted)


class _Control:
    """The scripted backend's reasoning control: the ask (set from Trio, taken by the
    worker thread before its next piece) and the text's place."""

    __slots__ = ("_lock", "asked", "finished", "markers", "tracker")

    def __init__(self, markers: ReasoningMarkers) -> None:
        self.markers = markers
        self.tracker = ReasoningTracker(markers.start, markers.end, opened=markers.opened)
        self.asked = False
        self.finished = False
        self._lock = threading.Lock()

    def ask(self) -> ControlOutcome:
        with self._lock:
            if self.finished:
                return "finished"
            if self.asked:
                return "forced"
            if self.tracker.state == "answer":
                return "already_ended"
            self.asked = True
            return "forced"


def _after_marker(script: Sequence[bytes], markers: ReasoningMarkers, index: int) -> int:
    """Where the script goes on after a forced marker in place of piece ``index``: after
    the piece that completes the script's own end marker (its answer), or at ``index``
    if the script has none after it."""
    probe = ReasoningTracker(markers.start, markers.end, opened=True)
    for position in range(index, len(script)):
        probe.feed(script[position])
        if probe.state == "answer":
            return position + 1
    return index


#: a text longer than this is made tokens in a worker thread (as the llama backend's
#: tokenizer does), in slices: each slice's ``list`` is one C call that holds the GIL,
#: so the event loop gets it back between slices
_INLINE_TOKEN_BYTES = 64 * 1024


async def _byte_tokens(data: bytes) -> list[int]:
    """``data``'s byte values, the scripted tokenizer's tokens (off the loop when long)."""
    if len(data) <= _INLINE_TOKEN_BYTES:
        return list(data)
    return await trio.to_thread.run_sync(_sliced_tokens, data)


def _sliced_tokens(data: bytes) -> list[int]:
    out: list[int] = []
    view = memoryview(data)
    for start in range(0, len(data), _INLINE_TOKEN_BYTES):
        out += view[start : start + _INLINE_TOKEN_BYTES]
    return out


def _busy_wait(seconds: float, aborted: Callable[[], bool]) -> None:
    """Sleep ``seconds`` in small steps, checking the abort flag at each one."""
    if aborted():
        raise Aborted
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    while (remaining := deadline - time.perf_counter()) > 0:
        time.sleep(min(remaining, _ABORT_CHECK_INTERVAL))
        if aborted():
            raise Aborted
