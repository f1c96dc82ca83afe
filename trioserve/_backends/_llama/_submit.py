"""A generation request's way through the scheduler (:class:`Submitter`, which the
backend owns): its adapters held, its sampler made, its sequence submitted to the
scheduler thread's inbox and waited for — through preemption's pauses and resumes, and
a cancel that waits, shielded, until the sequence is out of the batch — and the result
turned into the request's end or error. The backend's lifecycle (load, the contexts,
close) and its observables are :class:`~._backend.LlamaBackend`'s.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import trio

from ..._core._backend import GenerationCounter, GenerationProgress, PreparedPrompt
from ..._core._channel import PieceChannel
from ..._core._exceptions import BackendError
from ..._core._types import GenerationEnd
from .._decoding import LogitBias
from ._alora import activated
from ._sequence import CANCELLED, Sequence

if TYPE_CHECKING:
    from ._loop import Scheduler
    from ._lora_loads import AdapterLoads
    from ._model import LlamaModel

__all__ = ["Submitter"]


class Submitter:
    """``LlamaBackend.generate``: one request's generation, submitted to the scheduler
    thread and waited for on the Trio side."""

    def __init__(
        self,
        model: LlamaModel,
        scheduler: Scheduler,
        adapter_loads: AdapterLoads,
        generations: GenerationCounter,
    ) -> None:
        self._model = model
        self._scheduler = scheduler
        self._adapter_loads = adapter_loads
        #: the backend's count of the generations inside it
        self._generations = generations

    async def generate(
        self, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        """Run ``prompt`` as a sequence of the scheduler: its pieces go to ``channel``;
        the end (``stop``, ``length``), the request's ``Cancelled``, or a
        :class:`BackendError` (``LlamaBackend.generate``'s promises)."""
        if not prompt.adapters:
            return await self._generate(prompt, channel, progress)
        # its adapters' names bound to the files loaded under them now, held until its
        # sequence is out of the scheduler (an unload meanwhile frees them after it)
        keyed = self._model.adapters.acquire(prompt.adapters)
        try:
            # (an aLoRA: from where its invocation tokens last occur; absent, not at all)
            prompt = activated(prompt, keyed, self._model.adapters.key_invocation, self._model.n_vocab)
            return await self._generate(prompt, channel, progress)
        finally:
            await self._adapter_loads.release(keyed)

    async def _generate(
        self, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        if prompt.max_new_tokens <= 0 and not (prompt.request.cache_prompt and self._scheduler.cache_enabled):
            await trio.lowlevel.checkpoint()
            return "length"  # nothing to generate, nothing to keep
        # (no token asked, but a prompt to cache: an editor's warm-up of its extra
        # context — the prompt is evaluated into the cache, nothing is drawn)
        scheduler = self._scheduler
        bias = prompt.logit_bias if isinstance(prompt.logit_bias, LogitBias) else None
        if bias is None and prompt.request.sampling.logit_bias:  # (a prompt not from prepare)
            bias = LogitBias(prompt.request.sampling.logit_bias)
        model = self._model
        sampler = model.sampler(
            prompt.request.sampling,
            max_new_tokens=prompt.max_new_tokens,
            seed_offset=prompt.choice,
            bias=bias,
        )
        sequence = Sequence(prompt, progress, sampler, channel, bias)
        inbox = scheduler.inbox
        channel.on_room = inbox.wake
        lease = progress.preemption
        with self._generations:
            try:
                inbox.submit(sequence)
            except BaseException:
                model.lib.llama_sampler_free(sequence.sampler)
                raise
            if sequence.reasoning is not None:
                # (an ask made before this: Sequence took progress.reasoning_end_asked)
                progress.control = functools.partial(inbox.force, sequence)
            if lease is not None:
                kv = scheduler.kv
                lease.enable_pause(
                    functools.partial(inbox.pause, sequence),
                    state_bytes=lambda: int(sequence.pos * kv.kv_bytes_per_token),
                )
            try:
                while True:
                    await sequence.removed.wait()
                    park = sequence.park
                    if park is None:
                        break  # removed: it has its result
                    # preemption (docs/scheduling.md): set aside, or declined
                    assert lease is not None
                    sequence.park = None
                    # a new event first, then the result read: a removal that follows
                    # a decline at once is seen either way (it sets the new event, or
                    # its result is read here)
                    sequence.removed = trio.Event()
                    if sequence.result is not None:
                        break
                    if park == "declined":
                        lease.decline()
                        continue
                    saved = sequence.saved
                    # the slot goes back; held again on return
                    await lease.pause(saved_bytes=len(saved) if saved is not None else 0)
                    inbox.resume(sequence)
            finally:
                progress.control = None
                if lease is not None:
                    lease.disable_pause()
                if sequence.result is None and not sequence.removed.is_set():
                    if inbox.withdraw(sequence):
                        # parked: out of the scheduler, so freed here
                        self._free_parked(sequence)
                    else:
                        with trio.CancelScope(shield=True):
                            await sequence.removed.wait()
        result = sequence.result
        if isinstance(result, BaseException):
            # one error object can end several sequences (a failed call, a dead
            # scheduler): give each request its own
            retry = result.should_retry if isinstance(result, BackendError) else None
            raise BackendError(str(result), should_retry=retry) from None
        if result == "stop" or result == "length":
            return result
        # removed as cancelled: the request's own Cancelled is raised here
        await trio.lowlevel.checkpoint_if_cancelled()
        raise BackendError("the sequence was dropped, but its request was not cancelled")

    def _free_parked(self, sequence: Sequence) -> None:
        """A parked sequence whose request ended: its sampler and saved state go."""
        if sequence.sampler is not None:
            self._model.lib.llama_sampler_free(sequence.sampler)
            sequence.sampler = None
        sequence.saved = None
        sequence.result = CANCELLED
        sequence.progress.inference_ended = time.perf_counter()
