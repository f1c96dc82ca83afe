"""Loading a llama.cpp model: the weights, with progress and an abort between tensors
(:func:`load`, which ``LlamaModel.load`` calls); :func:`aload` runs a whole load — the
backend's: the weights, then the contexts and the checks of load — in a worker thread
that a cancel aborts (``LlamaBackend.aload`` calls it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypedDict, Unpack

import trio

from ..._core._backend_checks import check_options
from ..._core._errors import unwrap_group
from ..._core._exceptions import BackendError
from .._platform import RepackDecision, decide_repack
from ._native import LoadAborted, LoadLog, load_errors, make_log_callback
from ._settings import LlamaSettings

__all__ = ["LoadControls", "aload", "load"]

logger = logging.getLogger("trioserve.llama")


class LoadControls(TypedDict, total=False):
    """What a caller of a blocking load (:func:`load`, ``LlamaModel.load``,
    ``LlamaBackend.load``) sees of it and may stop it with; each one absent or ``None``:
    none."""

    #: called (in the loading thread) with llama.cpp's load progress, 0…1
    progress: Callable[[float], None] | None
    #: once set, the load stops (:class:`LoadAborted`, nothing left allocated)
    abort: threading.Event | None


class _Closable(Protocol):
    def close(self) -> None: ...


class Loadable(Protocol):
    """What :func:`load` makes (``LlamaModel``): built from the loaded weights, then
    its adapters and projector loaded, or closed."""

    def __init__(
        self,
        settings: LlamaSettings,
        lib: Any,
        model: Any,
        *,
        system_info: str,
        repack: RepackDecision,
        abort: threading.Event | None,
    ) -> None: ...

    def load_adapters(self) -> None: ...

    def load_projector(self) -> None: ...

    def close(self) -> None: ...


def load[M: Loadable](cls: type[M], settings: LlamaSettings, **controls: Unpack[LoadControls]) -> M:
    """Load the weights into a ``cls`` (blocking: seconds for big models).

    ``progress`` is called (in this thread) with llama.cpp's load progress, 0…1;
    once ``abort`` is set, the progress callback returns false — llama.cpp stops
    reading and frees the partial model: :class:`LoadAborted` is raised, nothing stays
    allocated. The model keeps ``abort`` (``check_abort``): the phases after the
    weights (contexts, warm-up) are skipped once it is set."""
    import llama_cpp

    check_options(controls, LoadControls)
    progress, abort = controls.get("progress"), controls.get("abort")

    if not settings.model_path.is_file():
        raise FileNotFoundError(f"model file not found: {settings.model_path}")
    if LoadLog.callback is None:  # keep a reference: C holds the pointer
        LoadLog.callback = make_log_callback()
    llama_cpp.llama_log_set(LoadLog.callback, None)
    llama_cpp.llama_backend_init()
    LoadLog.loading += 1
    try:
        system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        decision = decide_repack(system_info, settings.repack, batch_invariant=settings.batch_invariant)
        logger.info("llama.cpp system info: %s", system_info)
        (logger.warning if decision.amx else logger.info)(
            "weights %s: %s",
            "repacked (extra buffer types)" if decision.extra_buffers else "not repacked",
            decision.reason,
        )
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = decision.extra_buffers

        def on_progress(value: float, _data: object) -> bool:
            # called by llama.cpp from this thread; it must never raise
            try:
                if progress is not None:
                    progress(min(max(float(value), 0.0), 1.0))
            except Exception:  # pragma: no cover - a listener's bug
                logger.exception("the load progress listener failed")
            return abort is None or not abort.is_set()

        callback = llama_cpp.llama_progress_callback(on_progress)  # referenced until the load returns
        params.progress_callback = callback
        load_errors.lines = []
        try:
            model = llama_cpp.llama_model_load_from_file(str(settings.model_path).encode(), params)
        finally:
            said, load_errors.lines = load_errors.lines, None
        if not model:
            if abort is not None and abort.is_set():
                raise LoadAborted(f"the load of {settings.model_path} was aborted")
            cause = "; ".join(line.strip() for line in said if line.strip())
            raise BackendError(
                f"llama.cpp could not load {settings.model_path}" + (f": {cause}" if cause else "")
            )
        try:
            if abort is not None and abort.is_set():
                raise LoadAborted(f"the load of {settings.model_path} was aborted")
            loaded = cls(
                settings,
                llama_cpp,
                model,
                system_info=system_info,
                repack=decision,
                abort=abort,
            )
        except BaseException:
            llama_cpp.llama_model_free(model)
            raise
        try:
            # its adapters and its projector, in the same load (docs/lora.md, docs/vision.md)
            loaded.load_adapters()
            loaded.load_projector()
            return loaded
        except BaseException:
            loaded.close()
            raise
    finally:
        LoadLog.loading -= 1


async def aload[M: _Closable](load: Callable[[threading.Event], M], what: object) -> M:
    """``load(abort)`` (a blocking load, which stops with :class:`LoadAborted` once
    ``abort`` is set) in a worker thread; ``what`` names what it loads, for the error.

    Cancellation: a cancel aborts the load — llama.cpp's progress callback returns
    false at its next tensor, or the next phase (contexts, warm-up) is skipped — and
    waits until the thread has freed what it had allocated; then the ``Cancelled``
    propagates. A load that completes as the cancel arrives is closed."""
    abort = threading.Event()
    box: list[M] = []

    def run() -> None:
        box.append(load(abort))

    async def watch() -> None:
        try:
            await trio.sleep_forever()
        finally:
            abort.set()

    try:
        with unwrap_group():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                try:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(run)
                except LoadAborted:
                    pass  # (the cancel that set the flag comes out of the nursery)
                nursery.cancel_scope.cancel()
    except BaseException:
        if box:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(box[0].close)
        raise
    if not box:  # pragma: no cover - aborted without a cancel: cannot happen
        raise LoadAborted(f"the load of {what} was aborted")
    return box[0]
