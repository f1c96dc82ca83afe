"""The server's text-to-speech model (docs/audio.md, "Speech"): what the route needs of
it (:class:`SpeechModel`: ``_backends/_media/_speech.py``'s ``SpeechEngine``), how it is named
and loaded (:class:`SpeechSource`), and :class:`SpeechService`, which
:class:`~trioserve._http._state.ServerState` holds: the load in a worker thread at start,
one generation at a time (an :class:`~trioserve._core._admission.Admission` of one slot
and ``--max-queue`` places), the counters, the close at shutdown once no thread uses it.
The route: ``_speech.py``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import trio

from .._core._admission import Admission
from .._core._exceptions import ServiceUnavailableError

__all__ = ["SpeechModel", "SpeechOutcome", "SpeechService", "SpeechSource"]

logger = logging.getLogger("trioserve.speech")
#: how long the shutdown waits for a generation's thread before it closes the model
#: (a cancelled generation stops within one frame: milliseconds)
_CLOSE_WAIT = 10.0


class SpeechOutcome(Protocol):
    frames: int
    samples: int
    tokens: int
    stopped: bool


class SpeechModel(Protocol):
    """What the route needs of a loaded speech model (``_backends/_media/_speech.py``'s
    ``SpeechEngine``): every method is blocking CPU work, called in a worker thread."""

    sample_rate: int
    #: frames made since the load (a generation's progress, read from any thread)
    frames_made: int

    def check_input(self, text: str) -> int: ...

    def generate(
        self,
        text: str,
        *,
        emit: Callable[[bytes], None],
        cancelled: Callable[[], bool],
        seed: int | None = None,
    ) -> SpeechOutcome: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SpeechSource:
    """How the server's speech model is named and loaded (``load``: blocking, run in a
    worker thread at start)."""

    name: str
    load: Callable[[], SpeechModel]
    description: str = ""


class SpeechService:
    """The server's speech model: its load, its queue (one generation at a time), its
    counters, its close (module docstring)."""

    def __init__(self, source: SpeechSource, *, max_queue: int) -> None:
        self.name = source.name
        self.source = source
        self.model: SpeechModel | None = None
        self.state: Literal["loading", "loaded", "failed", "closed"] = "loading"
        self.error: str | None = None
        #: set once the load has ended, well or not
        self.settled = trio.Event()
        self.admission = Admission(1, max_queue)
        #: held while a worker thread uses the model (the close waits for it)
        self.busy = trio.Lock()
        #: generations begun, and those a cancel stopped (the client gone, a deadline…)
        self.generations = 0
        self.stopped = 0
        #: a generation's thread is running
        self.running = 0

    async def load(self) -> None:
        """Load the model in a worker thread (not abandoned on a cancel: a load the
        shutdown interrupts finishes, then :meth:`aclose` frees it)."""
        try:
            model = await trio.to_thread.run_sync(self.source.load)
        except Exception as exc:
            self.state, self.error = "failed", str(exc)
            logger.error("the speech model %s failed to load: %s", self.name, exc)
        else:
            if self.state == "closed":  # (the shutdown came during the load)
                model.close()
            else:
                self.model, self.state = model, "loaded"
                logger.info("speech model %s loaded (%d Hz)", self.name, model.sample_rate)
        finally:
            self.settled.set()

    def serving(self) -> SpeechModel:
        """The loaded model, or the 503 a request gets while it loads, after it failed,
        or during shutdown."""
        if self.state == "loaded" and self.model is not None:
            return self.model
        if self.state == "loading":
            raise ServiceUnavailableError(
                "the speech model is still loading; retry shortly", retry_after=1, code="loading"
            )
        if self.state == "failed":
            raise ServiceUnavailableError(f"the speech model failed to load: {self.error}")
        raise ServiceUnavailableError("the server is shutting down; retry on another instance", retry_after=1)

    async def aclose(self) -> None:
        """Close the model once no thread uses it (shielded, bounded: a cancelled
        generation stops within one frame)."""
        self.state = "closed"
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_CLOSE_WAIT) as waited:
                await self.busy.acquire()
            if waited.cancelled_caught:
                logger.error(
                    "a speech generation did not stop within %g s: its model is left open", _CLOSE_WAIT
                )
                return
            try:
                model, self.model = self.model, None
                if model is not None:
                    model.close()
            finally:
                self.busy.release()
