"""The llama.cpp model, on llama-cpp-python's low-level (C API) bindings.

What does not depend on how requests are scheduled: :class:`LlamaSettings`, the loaded
model with its vocabulary, tokenizer, metadata and sampler chains (:class:`LlamaModel`),
and one llama context with its batch and abort flag (:class:`_Context`), whose abort
callback (``_abort.c``) reads that flag between graph nodes without the GIL. The backend
itself is :class:`~trioserve._backends._scheduler.LlamaBackend`. Why the low-level API
and a C callback: ``docs/architecture.md``, "The per-token path".
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Self

import numpy
import trio

from .._core._backend import Backend, ModelInfo, PreparedPrompt, check_token_ids, fit_to_context
from .._core._errors import unwrap_group
from .._core._exceptions import BackendError, InvalidRequestError
from .._core._types import GenerationRequest, SamplingParams
from ._draw import LogitBias
from ._grammar import GrammarCompiler
from ._pieces import classify_piece, make_rule
from ._platform import RepackDecision, decide_repack
from ._prompt_cache import HostCache
from ._side_work import run_side_work

__all__ = ["LlamaModel", "LlamaSettings", "LoadAborted"]

logger = logging.getLogger("trioserve.llama")

#: ``LLAMA_TOKEN_ATTR_CONTROL`` (llama.h)
_ATTR_CONTROL = 1 << 3

#: prompts shorter than this (characters) are tokenized on the Trio thread: cheaper than
#: a thread hop. Longer ones go to a worker thread so the event loop never stalls.
_INLINE_TOKENIZE_CHARS = 4096
#: constraint compiles running at once (each holds a worker thread until it ends)
_COMPILE_THREADS = 2
#: the same for turning token ids into their pieces (``/detokenize``, ``/tokenize``'s
#: ``with_pieces``): more ids than this go to a worker thread
_INLINE_PIECES = 1024
#: a logit bias with more entries than this is turned into arrays in a worker thread
_INLINE_BIAS = 4096


def _abort_requested(data: int) -> bool:
    """The pure-Python abort callback, used only if the C one (``_abort.c``) was not
    built: reads the flag byte at ``data``. Called from C; it must never raise."""
    return bool(ctypes.c_ubyte.from_address(data).value)


def _make_abort_callback(lib: Any) -> tuple[Any, bool]:
    """The abort callback, and whether it is the C one."""
    try:
        from . import _abort
    except ImportError:  # pragma: no cover - the extension is built on install
        logger.warning(
            "trioserve._backends._abort (C) is not built: using a Python abort callback, which "
            "costs ~10%% of decode speed; reinstall trioserve with a C compiler"
        )
        return lib.ggml_abort_callback(_abort_requested), False
    return lib.ggml_abort_callback(_abort.ABORT_CHECK_ADDRESS), True


_llama_cpp_logger = logging.getLogger("trioserve.llama_cpp")


def _forward_log(level: int, text: bytes, _data: object) -> None:
    """llama.cpp's log lines → Python logging, at DEBUG — except errors while a model
    loads, which go to WARNING (they say why a GGUF cannot be used). After loading,
    llama.cpp's errors come back as return codes, which trioserve reports itself (an
    aborted decode logs three error lines that are not errors here)."""
    if level == 4 and _LazyLogCallback.loading:  # GGML_LOG_LEVEL_ERROR (NONE, DEBUG, INFO, WARN, ERROR, CONT)
        line = text.decode("utf-8", errors="replace").rstrip()
        _llama_cpp_logger.warning("%s", line)
        errors = getattr(_load_errors, "lines", None)
        if errors is not None and len(errors) < 8:
            errors.append(line)  # this thread's load: its error names the cause
    elif _llama_cpp_logger.isEnabledFor(logging.DEBUG):
        _llama_cpp_logger.debug("%s", text.decode("utf-8", errors="replace").rstrip())


def _make_log_callback() -> Any:
    import llama_cpp

    return llama_cpp.llama_log_callback(_forward_log)


class LoadAborted(BackendError):
    """A load stopped because nobody wanted it any more (``aload``'s cancel)."""


#: the llama.cpp error lines of the load running in this thread
_load_errors = threading.local()


class _LazyLogCallback:
    callback: Any = None
    loading = 0


class LlamaSettings:
    """How to load the model and run it. Defaults suit a CPU machine.

    Args:
        model_path: path to a GGUF file.
        n_ctx: context length per sequence (tokens).
        n_threads: threads of the one context; default: all cores (every step decodes
            every running sequence).
        n_batch: llama.cpp's batch size (at least ``prefill_chunk``).
        slots: sequences decoded together, i.e. generations that run at once (each
            with ``n_ctx`` KV cells).
        prefill_chunk: the most prompt tokens per ``llama_decode`` call: a prompt is
            evaluated in the pieces of a canonical cut (``piece_rule``), whatever the
            load, so cached pieces are exact.
        piece_rule: ``"text"`` (cut after turn headers, lines and sentences, pieces of
            at most ``prefill_chunk``: a conversation's turns end on cuts the next turn
            shares) or ``"aligned"`` (every ``prefill_chunk`` tokens from position 0);
            ``docs/prompt-cache.md``, "The cut".
        prompt_cache: keep the KV cells of finished prompts' whole pieces and reuse the
            longest cached prefix (``docs/prompt-cache.md``).
        cache_ram_bytes: host memory for cached prefixes evicted from KV cells (their
            sequence states), least recently used out first; 0: none.
        idle_recompute: while nothing else runs, evaluate a finished conversation's reply
            in the canonical pieces, so the next turn reuses it (aborted by any request).
        cache_mode: ``"exact"`` (reuse only whole prompt pieces: a cached answer
            equals a fresh server's) or ``"fast"`` (reuse every cell that matches, the
            reply's too, as llama-server does: answers may differ).
        batch_invariant: make every stream's numerics independent of what else runs
            (decode calls no wider than the width measured to be exact, and a sequence
            past the measured shared-context limit decodes alone; turns off weight
            repacking).
        model_id: the name clients use; default: the file name without ``.gguf``.
        repack: let llama.cpp repack weights for this CPU's SIMD kernels
            (``use_extra_bufts``): ``True`` (on), ``False`` (off), ``None`` (auto: on,
            unless the loaded llama.cpp has AMX kernels, which crash: ``_platform.py``);
            off in batch-invariant mode.
        warm_up: decode one token at load (as llama-server does), so a llama.cpp that
            cannot run on this CPU fails at startup, not at the first request.
        speculate: prompt-lookup speculative decoding of a stream that decodes alone
            (``docs/speculation.md``): ``"auto"`` (the default: only where the verify
            call's rows are computed exactly as one-token steps — the widths measured at
            load, contexts where a lone step takes the same attention path — so the
            text never changes), ``"fast"`` (wide verify calls at any context, as
            llama-server's n-gram modes: faster, and a temperature-0 text may change) or
            ``"off"``.
        pooling: how ``/v1/embeddings`` pools a model's token vectors: ``None`` (the
            GGUF's; mean for a model that has none), ``"mean"``, ``"cls"``, ``"last"``
            (docs/embeddings.md).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        slots: int = 8,
        prefill_chunk: int = 128,
        piece_rule: Literal["text", "aligned"] = "text",
        prompt_cache: bool = True,
        cache_ram_bytes: int = 1 << 30,
        idle_recompute: bool = True,
        cache_mode: Literal["exact", "fast"] = "exact",
        batch_invariant: bool = False,
        model_id: str | None = None,
        repack: bool | None = None,
        warm_up: bool = True,
        pooling: Literal["mean", "cls", "last"] | None = None,
        speculate: Literal["off", "auto", "fast"] = "auto",
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if slots > n_batch:
            # every step decodes one token of each sequence in one batch of n_batch rows
            raise ValueError(f"slots ({slots}) may be at most n_batch ({n_batch}): raise the batch size")
        if not 1 <= prefill_chunk <= n_batch:
            raise ValueError(f"prefill_chunk must be in [1, n_batch={n_batch}], got {prefill_chunk}")
        self.model_path = Path(model_path)
        self.batch_invariant = batch_invariant
        self.repack = repack
        self.warm_up = warm_up
        self.n_ctx = n_ctx
        # llama.cpp's threads spin while they wait for each other: more threads than
        # cores makes every decode slower, so one context gets exactly the cores.
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_batch = n_batch
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        if piece_rule not in ("text", "aligned"):
            raise ValueError(f"piece_rule must be 'text' or 'aligned', got {piece_rule!r}")
        self.piece_rule: Literal["text", "aligned"] = piece_rule
        self.prompt_cache = prompt_cache
        if cache_ram_bytes < 0:
            raise ValueError(f"cache_ram_bytes must be at least 0, got {cache_ram_bytes}")
        self.cache_ram_bytes = cache_ram_bytes
        self.idle_recompute = idle_recompute
        if cache_mode not in ("exact", "fast"):
            raise ValueError(f"cache_mode must be 'exact' or 'fast', got {cache_mode!r}")
        self.cache_mode = cache_mode
        if speculate not in ("off", "auto", "fast"):
            raise ValueError(f"speculate must be 'off', 'auto' or 'fast', got {speculate!r}")
        self.speculate: Literal["off", "auto", "fast"] = speculate
        self.model_id = model_id or self.model_path.name.removesuffix(".gguf")
        if pooling not in (None, "mean", "cls", "last"):
            raise ValueError(f"pooling must be 'mean', 'cls' or 'last', got {pooling!r}")
        self.pooling: Literal["mean", "cls", "last"] | None = pooling


class _Context:
    """One llama context with its batch and abort flag. Used by one thread at a time.

    Room for ``sequences`` sequences of ``settings.n_ctx`` tokens each, in a non-unified
    KV cache (each sequence owns its cells; attention never reads another sequence's)."""

    def __init__(self, backend: LlamaModel, *, sequences: int = 1) -> None:
        lib = backend.lib
        settings = backend.settings
        params = lib.llama_context_default_params()
        params.n_ctx = settings.n_ctx * sequences
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.n_seq_max = sequences
        # sliding-window layers keep every cell too (llama.cpp's default): a cached
        # prefix's cells must all be there when a later request reuses it
        params.swa_full = True
        if sequences > 1:
            params.kv_unified = False
        ctx = lib.llama_init_from_model(backend.model, params)
        if not ctx:
            raise BackendError(
                f"llama.cpp could not create a context for {sequences} sequence(s) of {settings.n_ctx} tokens"
            )
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self.n_batch = settings.n_batch
        self.batch = lib.llama_batch_init(settings.n_batch, 0, 1)
        for i in range(settings.n_batch):
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = 0
        # The callback object and its flag must outlive the context: keep references.
        self.abort_flag = ctypes.c_ubyte(0)
        self._abort_callback, self.abort_flag_used = _make_abort_callback(lib)
        lib.llama_set_abort_callback(ctx, self._abort_callback, ctypes.addressof(self.abort_flag))

    def free(self, lib: Any) -> None:
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)


class LlamaModel(Backend):
    """The loaded model, its vocabulary, metadata, tokenizing, validation and sampler
    chains. The subclass owns the context and the inference loop (``LlamaBackend``)."""

    #: models loaded and not yet freed, in this process (tests check that none leaks)
    loaded = 0
    _count_lock = threading.Lock()

    #: ``llama_print_system_info()`` of the loaded llama.cpp, and the repack decision
    system_info = ""
    repack: RepackDecision | None = None

    def __init__(
        self,
        settings: LlamaSettings,
        lib: Any,
        model: Any,
        *,
        system_info: str = "",
        repack: RepackDecision | None = None,
        host_cache: HostCache | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        super().__init__()
        #: the prompt cache's host tier to use (a registry entry's, kept across loads)
        self._host_cache = host_cache
        #: set when the load should stop (checked between its phases)
        self._load_abort = abort
        self.system_info = system_info
        self.repack = repack
        self._freed = False
        self.settings = settings
        self.lib = lib
        self.model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self._bos: int = lib.llama_vocab_bos(self.vocab)
        self._piece_cache: dict[int, bytes] = {}
        #: the constraint compiler (its view of the vocabulary is built on first use)
        self.grammars = GrammarCompiler(lib, self.vocab, self.n_vocab, self.token_bytes)
        #: worker threads for compiles: a compile a cancel abandoned keeps its thread
        #: until it ends, so compiles get threads of their own (two at a time) and never
        #: take those of tokenization, template rendering or a model load
        self.compile_threads = trio.CapacityLimiter(_COMPILE_THREADS)
        self._piece_lock = threading.Lock()
        #: where prompts are cut into prefill calls (docs/prompt-cache.md, "The cut")
        self.piece_rule = make_rule(
            settings.piece_rule, settings.prefill_chunk, classify=self._classify_token, n_vocab=self.n_vocab
        )
        train_ctx = lib.llama_model_n_ctx_train(model)
        if settings.n_ctx > train_ctx:
            logger.warning("n_ctx %d exceeds the model's training context %d", settings.n_ctx, train_ctx)
        self._info = ModelInfo(
            id=settings.model_id,
            context_length=settings.n_ctx,
            chat_template=self._meta("tokenizer.chat_template"),
            architecture=self._meta("general.architecture"),
            bos_token=self._token_text(self._bos),
            eos_token=self._token_text(lib.llama_vocab_eos(self.vocab)),
        )
        self.check_abort()
        self._create_contexts()
        with LlamaModel._count_lock:
            LlamaModel.loaded += 1

    def _classify_token(self, token: int) -> int:
        """A token's class for the cut (``_pieces``): control or not, its text. (The BOS
        token opens a sequence, not a turn: it is no header.)"""
        lib = self.lib
        control = token != self._bos and bool(lib.llama_vocab_get_attr(self.vocab, token) & _ATTR_CONTROL)
        end = control and bool(lib.llama_vocab_is_eog(self.vocab, token))
        return classify_piece(self.token_bytes(token, special=False), control=control, end=end)

    def check_abort(self) -> None:
        """Between the load's phases: raise :class:`LoadAborted` if the load was aborted."""
        if self._load_abort is not None and self._load_abort.is_set():
            raise LoadAborted(f"the load of {self.settings.model_path} was aborted")

    def _create_contexts(self) -> None:
        """Create the llama contexts (called once the model and vocabulary are ready)."""
        raise NotImplementedError

    def _release_contexts(self) -> None:
        """Free the contexts (the model is freed after them)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        settings: LlamaSettings,
        *,
        progress: Callable[[float], None] | None = None,
        abort: threading.Event | None = None,
        host_cache: HostCache | None = None,
    ) -> Self:
        """Load the model and create the contexts (blocking: seconds for big models).

        ``progress`` is called (in this thread) with llama.cpp's load progress, 0…1;
        once ``abort`` is set, the progress callback returns false — llama.cpp stops
        reading and frees the partial model — and the phases after the weights
        (contexts, warm-up) are skipped: :class:`LoadAborted` is raised, nothing stays
        allocated. ``host_cache``: the prompt cache's host tier to start with (a
        registry entry's, which outlives an unload)."""
        import llama_cpp

        if not settings.model_path.is_file():
            raise FileNotFoundError(f"model file not found: {settings.model_path}")
        if _LazyLogCallback.callback is None:  # keep a reference: C holds the pointer
            _LazyLogCallback.callback = _make_log_callback()
        llama_cpp.llama_log_set(_LazyLogCallback.callback, None)
        llama_cpp.llama_backend_init()
        _LazyLogCallback.loading += 1
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
            _load_errors.lines = []
            try:
                model = llama_cpp.llama_model_load_from_file(str(settings.model_path).encode(), params)
            finally:
                said, _load_errors.lines = _load_errors.lines, None
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
                return cls(
                    settings,
                    llama_cpp,
                    model,
                    system_info=system_info,
                    repack=decision,
                    host_cache=host_cache,
                    abort=abort,
                )
            except BaseException:
                llama_cpp.llama_model_free(model)
                raise
        finally:
            _LazyLogCallback.loading -= 1

    @classmethod
    async def aload(
        cls,
        settings: LlamaSettings,
        *,
        progress: Callable[[float], None] | None = None,
        host_cache: HostCache | None = None,
    ) -> Self:
        """:meth:`load` in a worker thread.

        Cancellation: a cancel aborts the load — llama.cpp's progress callback returns
        false at its next tensor, or the next phase (contexts, warm-up) is skipped — and
        waits until the thread has freed what it had allocated; then the ``Cancelled``
        propagates. A load that completes as the cancel arrives is freed."""
        abort = threading.Event()
        box: list[Self] = []

        def run() -> None:
            box.append(cls.load(settings, progress=progress, abort=abort, host_cache=host_cache))

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
                    await trio.to_thread.run_sync(box[0]._free)
            raise
        if not box:  # pragma: no cover - aborted without a cancel: cannot happen
            raise LoadAborted(f"the load of {settings.model_path} was aborted")
        return box[0]

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._free)

    def _free(self) -> None:
        if self._freed:
            return
        self._freed = True
        self.grammars.wait_idle()  # a compile a cancel abandoned still reads the vocabulary
        self._release_contexts()
        self.lib.llama_model_free(self.model)
        with LlamaModel._count_lock:
            LlamaModel.loaded -= 1

    # ------------------------------------------------------------- metadata

    def _meta(self, key: str) -> str | None:
        size = 1 << 16
        buffer = ctypes.create_string_buffer(size)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, size)
        if n < 0:
            return None
        if n >= size:  # a huge chat template: ask again with room for it
            buffer = ctypes.create_string_buffer(n + 1)
            self.lib.llama_model_meta_val_str(self.model, key.encode(), buffer, n + 1)
        return buffer.value.decode("utf-8", errors="replace")

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = self.lib.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def slots(self) -> int:
        return self.settings.slots

    # ----------------------------------------------------------- tokenizing

    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]:
        """Text → token ids. ``add_bos``: add the model's special tokens around the text
        (its BOS); ``parse_special``: special tokens written in the text, such as
        ``<start_of_turn>``, are parsed as themselves (otherwise: as plain text)."""
        data = text.encode()
        capacity = len(data) + 8
        tokens = (self.lib.llama_token * capacity)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_bos, parse_special)
        if n < 0:  # too small: -n is the size needed
            capacity = -n
            tokens = (self.lib.llama_token * capacity)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_bos, parse_special)
        return numpy.frombuffer(tokens, numpy.int32, count=n).tolist()  # (twice as fast as a slice)

    def count_tokens(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> int:
        """How many tokens :meth:`tokenize` gives, without building the list (1.8M
        tokens' list holds the GIL for 55 ms)."""
        data = text.encode()
        n: int = self.lib.llama_tokenize(self.vocab, data, len(data), None, 0, add_bos, parse_special)
        return -n if n < 0 else n

    def piece(self, token: int) -> bytes:
        """The bytes of one token (cached: the vocabulary is fixed)."""
        cached = self._piece_cache.get(token)
        if cached is not None:
            return cached
        piece = self.token_bytes(token, special=False)
        with self._piece_lock:
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(token) for token in tokens)

    def special_piece(self, token: int) -> bytes:
        """The bytes of one token, control tokens rendered as their text (``<bos>``), as
        llama.cpp's ``common_token_to_piece``. :meth:`piece` renders those as nothing
        (generated text never shows them); every other token is the same in both."""
        piece = self.piece(token)
        return piece if piece else self.token_bytes(token, special=True)

    def token_bytes(self, token: int, *, special: bool) -> bytes:
        """llama.cpp's ``llama_token_to_piece`` (uncached): ``special`` renders control
        tokens as their text."""
        buffer = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 256, 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, special)
        return buffer.raw[:n]

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        if len(text) > _INLINE_TOKENIZE_CHARS:  # the same rule as prompts: see prepare
            # (/tokenize, not a generation's own work: niced, _side_work.py)
            return await run_side_work(
                lambda: self.tokenize(text, add_bos=add_special, parse_special=parse_special)
            )
        return self.tokenize(text, add_bos=add_special, parse_special=parse_special)

    async def count_text_tokens(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> int:
        if len(text) > _INLINE_TOKENIZE_CHARS:  # (token counting: niced, _side_work.py)
            return await run_side_work(
                lambda: self.count_tokens(text, add_bos=add_special, parse_special=parse_special)
            )
        return self.count_tokens(text, add_bos=add_special, parse_special=parse_special)

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        check_token_ids(tokens, self.n_vocab)  # an id out of range would crash llama.cpp
        if len(tokens) > _INLINE_PIECES:
            return await run_side_work(lambda: [self.special_piece(t) for t in tokens])
        return [self.special_piece(t) for t in tokens]

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        if isinstance(request.prompt, str):
            if len(request.prompt) > _INLINE_TOKENIZE_CHARS:
                tokens = await trio.to_thread.run_sync(
                    lambda: self.tokenize(request.prompt, add_bos=request.add_bos)  # type: ignore[arg-type]
                )
            else:
                tokens = self.tokenize(request.prompt, add_bos=request.add_bos)
        else:
            tokens = list(request.prompt)
            bad = [t for t in tokens if not 0 <= t < self.n_vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {self.n_vocab}); got {bad[0]}", param="prompt"
                )
        bias = await self._logit_bias(request.sampling)
        prepared = fit_to_context(request, tokens, self.settings.n_ctx)
        if bias is not None:
            prepared = dataclasses.replace(prepared, logit_bias=bias)
        if request.constraint is not None:
            # compiling (and, the first time, building the grammar engine's view of the
            # vocabulary) can take a while: off the event loop. A cancel returns at
            # once; the thread finishes its bounded compile and the result is dropped.
            constraint = request.constraint
            mask = await trio.to_thread.run_sync(
                lambda: self.grammars.compile(constraint),
                abandon_on_cancel=True,
                limiter=self.compile_threads,
            )
            prepared = dataclasses.replace(prepared, compiled=mask)
        return prepared

    async def _logit_bias(self, params: SamplingParams) -> LogitBias | None:
        """The request's logit bias as arrays (``None``: none), made once: the draws and
        the sampler chain of every choice use them. A bias naming a token id outside the
        vocabulary is refused (400)."""
        if not params.logit_bias:
            return None
        try:
            if len(params.logit_bias) > _INLINE_BIAS:  # (a whole vocabulary: milliseconds)
                bias = await trio.to_thread.run_sync(LogitBias, params.logit_bias)
            else:
                bias = LogitBias(params.logit_bias)
            low, high = bias.bounds()
        except OverflowError:  # (a key past int64)
            low, high = -1, -1
        if low < 0 or high >= self.n_vocab:
            token = high if high >= self.n_vocab else low
            raise InvalidRequestError(
                f"logit_bias key {token} is not a token id of this model (vocabulary: {self.n_vocab})"
                if token >= 0
                else f"logit_bias keys must be token ids of this model (vocabulary: {self.n_vocab})",
                param="logit_bias",
            )
        return bias

    def _sampler(
        self,
        params: SamplingParams,
        *,
        max_new_tokens: int = 0,
        seed_offset: int = 0,
        bias: LogitBias | None = None,
    ) -> Any:
        """llama.cpp's sampler chain for ``params``, in llama-server's order: logit
        bias, penalties, top-k, top-p, min-p, temperature, then the draw (or greedy).
        ``bias``: ``params.logit_bias`` as arrays, if the request's prepare made them."""
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lib.llama_sampler_chain_add
        if params.logit_bias:
            if bias is None:
                bias = LogitBias(params.logit_bias)
            # OpenAI: -100 bans a token (-inf), +100 forces it
            entries = bias.entries(lib.llama_logit_bias)
            add(chain, lib.llama_sampler_init_logit_bias(self.n_vocab, len(entries), entries))
        # (llama-cpp-python 0.3.36's llama.h: the vocabulary size comes first)
        penalties = lib.llama_sampler_init_penalties
        if params.repeat_penalty != 1:
            last_n = params.repeat_last_n if params.repeat_last_n >= 0 else max(1, max_new_tokens)
            add(chain, penalties(self.n_vocab, last_n, params.repeat_penalty, 0.0, 0.0))
        if params.frequency_penalty or params.presence_penalty:
            # OpenAI's penalties count every token generated so far: a window as long
            # as the generation
            window = max(1, max_new_tokens or self.settings.n_ctx)
            frequency, presence = params.frequency_penalty, params.presence_penalty
            add(chain, penalties(self.n_vocab, window, 1.0, frequency, presence))
        if params.temperature == 0:
            add(chain, lib.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(chain, lib.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0:
                add(chain, lib.llama_sampler_init_min_p(params.min_p, 1))
            add(chain, lib.llama_sampler_init_temp(params.temperature))
            seed = params.seed + seed_offset if params.seed is not None else random.getrandbits(32)
            add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain
