"""A scripted backend: deterministic tokens at a set pace, for tests and benchmarks.

It behaves like the llama.cpp backend where the engine can tell: it runs in a worker
thread (:class:`~trioserve._backends._threaded.ThreadedBackend`), "prefills" for a time
proportional to the prompt, emits one piece per ``token_interval``, and checks the abort
flag between tokens and every millisecond inside prefill and decode steps. Its tokenizer
is UTF-8 bytes: one token per byte (a vocabulary of 256 ids, no special tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .._core._backend import (
    GenerationProgress,
    ModelInfo,
    PreparedPrompt,
    check_token_ids,
    fit_to_context,
    refuse_unsupported,
)
from .._core._channel import Aborted, PieceChannel
from .._core._types import GenerationEnd, GenerationRequest
from ._threaded import Emit, ThreadedBackend

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
            tokens: Sequence[int] = list(request.prompt.encode())
        else:
            tokens = list(request.prompt)
        return fit_to_context(request, tokens, self._info.context_length)

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        return list(text.encode())  # no special tokens: both flags change nothing

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        check_token_ids(tokens, 256)
        return [bytes((token,)) for token in tokens]

    async def generate(
        self,
        prompt: PreparedPrompt,
        channel: PieceChannel,
        progress: GenerationProgress,
    ) -> GenerationEnd:
        return await self.run_in_thread(self._infer, prompt, channel, progress)

    def _infer(
        self, prompt: PreparedPrompt, emit: Emit, aborted: Callable[[], bool], progress: GenerationProgress
    ) -> GenerationEnd:
        emitted = 0
        progress.piece_per_token = True  # each piece of the script counts as a token
        try:
            started = time.perf_counter()
            _busy_wait(len(prompt.tokens) * self.prefill_seconds_per_token, aborted)
            progress.prefill_seconds = time.perf_counter() - started
            for piece in self.script:
                if emitted >= prompt.max_new_tokens:
                    return "length"
                _busy_wait(self.token_interval, aborted)
                progress.completion_tokens += 1
                emit(piece)
                emitted += 1
            return "stop"
        finally:
            self.completed_runs.append(emitted)


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
