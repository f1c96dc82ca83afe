"""LoRA adapters loaded and unloaded while the model serves (docs/lora.md, "Hot load
and unload"): ``POST /v1/load_lora_adapter`` and its kin call :class:`AdapterLoads`.

A load waits in line (one per model at a time: a client that leaves there loads
nothing), then reads the file in a worker thread (its digest, which keys its cache
entries; stopped between MiBs when the client leaves), then — holding the cores' turn,
as a decode call does, since llama.cpp adds the adapter to the model's list that a
context's graph reservation reads — runs ``llama_adapter_lora_init`` on the file just
read (from the page cache); the adapter is listed on the Trio thread. A client that
leaves during the init: the adapter is freed when it returns, nothing listed. An
unload takes the name off the list at once; the file is freed when no sequence uses it
(``LoraAdapters.release``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import outcome
import trio

from ..._core._exceptions import BackendError, InvalidRequestError, NotFoundError
from ._adapters import LoadCancelled, LoraAdapter, check_adapter_name, read_adapter_file
from ._model import LlamaModel

__all__ = ["AdapterLoads"]

logger = logging.getLogger("trioserve.llama")

Turn = Callable[[], AbstractContextManager[None]]


class AdapterLoads:
    """The run-time loads and unloads of one model's adapters (the Trio thread)."""

    def __init__(self, model: LlamaModel, turn: Turn) -> None:
        self._model = model
        self._turn = turn
        #: one load at a time per model: a load waits here (cancellable: nothing loaded)
        self.line = trio.Lock()
        #: loads waiting in line (tests wait on it to reach that phase)
        self.waiting = 0
        #: ``llama_adapter_lora_init`` calls made at run time
        self.inits = 0

    async def load(
        self, name: str, path: str, scale: float = 1.0, *, check_room: Callable[[int], None] | None = None
    ) -> LoraAdapter:
        """Load the GGUF LoRA at ``path`` (a path on this server) as ``name``.
        ``check_room(bytes)``: raises if the file does not fit the model's memory."""
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="lora_name") from None
        adapters = self._model.adapters
        limit = self._model.settings.lora_max
        file = Path(path)
        if not file.is_absolute():
            raise InvalidRequestError(
                f"lora_path must be an absolute path on the server, got {path!r}", param="lora_path"
            )
        self.waiting += 1
        try:
            await self.line.acquire()
        finally:
            self.waiting -= 1
        try:
            if adapters.get(name) is not None:
                raise InvalidRequestError(
                    f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            if len(adapters) >= limit:
                raise InvalidRequestError(
                    f"this model has {len(adapters)} LoRA adapters, the most it may hold (--lora-max "
                    f"{limit}): unload one first (POST /v1/unload_lora_adapter)",
                    param="lora_name",
                    code="too_many_adapters",
                )
            stop = threading.Event()
            try:
                digest, size = await _abortable(lambda: read_adapter_file(file, stop.is_set), stop)
            except BackendError as exc:
                raise InvalidRequestError(exc.message, param="lora_path") from None
            if check_room is not None:
                check_room(size)
            again = adapters.reusable(name, digest)
            if again is not None:  # (the same file, unloaded and still in use: taken back)
                adapter = dataclasses.replace(again, path=file, scale=float(scale))
            else:
                adapter = await self._init(name, file, scale, digest, size)
            adapters.add(adapter)
            self._model.refresh_adapters()
        finally:
            self.line.release()
        logger.info("LoRA adapter %s loaded at run time: %s (scale %g, %d bytes)", name, file, scale, size)
        return adapter

    async def _init(self, name: str, file: Path, scale: float, digest: str, size: int) -> LoraAdapter:
        adapters = self._model.adapters

        def init() -> LoraAdapter:
            with self._turn():
                self.inits += 1
                return adapters.open(name, file, scale, digest, size, hot=True)

        try:
            # (not abandoned: llama.cpp's init cannot be stopped; a cancel meanwhile is
            # delivered once it returns, and the adapter is freed then)
            adapter = await trio.to_thread.run_sync(init)
        except BackendError as exc:
            raise InvalidRequestError(exc.message, param="lora_path", code="invalid_lora_adapter") from None
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(adapters.free, [adapter], self._turn)
            raise
        return adapter

    async def unload(self, name: str) -> None:
        """Take ``name`` off the list; its file is freed now if no sequence uses it,
        else by the last one's end (which finishes with it, unchanged)."""
        adapters = self._model.adapters
        if adapters.get(name) is None:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        doomed = adapters.remove(name)
        self._model.refresh_adapters()
        if doomed is not None:
            with trio.CancelScope(shield=True):  # (off the list already: freed whatever happens)
                await trio.to_thread.run_sync(adapters.free, [doomed], self._turn)
        logger.info("LoRA adapter %s unloaded%s", name, "" if doomed else " (freed when its streams end)")

    def set_scales(self, scales: Sequence[tuple[int, float]]) -> None:
        """llama-server's ``POST /lora-adapters``: each adapter's default scale, by id."""
        adapters = self._model.adapters
        names = [adapters.by_id(index) for index, _ in scales]
        for name, (_, scale) in zip(names, scales, strict=True):
            adapters.set_scale(name, scale)
        self._model.refresh_adapters()

    async def release(self, keyed: tuple[tuple[str, float], ...]) -> None:
        """A sequence is done with its set: the files it was the last user of, freed."""
        adapters = self._model.adapters
        doomed = adapters.release(keyed)
        if doomed:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(adapters.free, doomed, self._turn)


async def _abortable[T](work: Callable[[], T], stop: threading.Event) -> T:
    """``work()`` in a worker thread; a cancel sets ``stop`` (``work`` looks at it) and
    the cancel is raised once the thread has returned. ``work``'s error: raised as it is."""
    done = False

    async def stop_on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            if not done:
                stop.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_cancel)
        ended = await outcome.acapture(trio.to_thread.run_sync, work)
        done = True
        nursery.cancel_scope.cancel()
    if isinstance(ended, outcome.Error) and isinstance(ended.error, LoadCancelled):
        await trio.lowlevel.checkpoint()  # (the cancel that set the flag)
        raise BackendError("the load was cancelled")
    return ended.unwrap()
