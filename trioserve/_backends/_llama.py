"""The llama.cpp backend, on llama-cpp-python's low-level (C API) bindings.

Why the low-level API: the per-token loop is the hot path, and the high-level
``Llama.create_completion`` costs about 14 % per token in Python bookkeeping; and
cancellation must reach *inside* ``llama_decode``, which needs the raw context.

One model (memory-mapped weights) is shared by ``slots`` contexts; each generation runs
on one context, in one Trio worker thread:

1. clear the context's memory (KV cache) — every request starts from the state a fresh
   server has, so output at temperature 0 never depends on what ran before;
2. prefill the prompt in ``n_batch`` chunks;
3. decode: sample → emit the piece (blocks while the client is not reading) → decode.

Cancellation reaches the thread three ways, all driven by the request's cancel scope:

* llama.cpp calls the context's **abort callback** between graph nodes (~400 times per
  decode step for Gemma 3 270M, also during prefill). It is a C function
  (``trioserve/_abort.c``) that reads one byte, the context's abort flag; a Trio task
  in the request's scope raises that flag when the scope is cancelled
  (:func:`_raise_on_cancel`). So ``llama_decode`` returns 2 (aborted) within a
  fraction of a millisecond, without taking the GIL 400 times per token;
* ``check_cancelled()`` between prefill chunks and decode steps;
* ``emit`` itself (``trio.from_thread.run``) raises ``Cancelled`` when the thread is
  blocked on a slow reader.

Whatever the exit, the ``finally`` clears the memory again: an aborted decode leaves
partially processed ubatches in the KV cache ("processed ubatches will remain in the
context's memory", llama.h), which must not leak into the next request.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Self

import trio

from .._exceptions import BackendError, InvalidRequestError
from .._types import GenerationRequest, SamplingParams
from ._base import Backend, GenerationProgress, ModelInfo, PreparedPrompt, fit_to_context
from ._threaded import Emit, ThreadedBackend

__all__ = ["LlamaBackend", "LlamaModel", "LlamaSettings"]

logger = logging.getLogger("trioserve.llama")

#: prompts shorter than this (characters) are tokenized on the Trio thread: cheaper than
#: a thread hop. Longer ones go to a worker thread so the event loop never stalls.
_INLINE_TOKENIZE_CHARS = 4096
_DECODE_ABORTED = 2


def _abort_requested(_data: object) -> bool:
    """The pure-Python abort callback, used only if the C one (``_abort.c``) was not
    built: true once the request running on this thread is cancelled. Called from C on
    the thread that called ``llama_decode``; it must never raise."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    except RuntimeError:
        return False  # not a Trio worker thread: nothing can cancel it
    return False


def _make_abort_callback(lib: Any) -> tuple[Any, bool]:
    """The abort callback, and whether it is the C one that reads a flag."""
    try:
        from .._abort import ABORT_CHECK_ADDRESS
    except ImportError:  # pragma: no cover - the extension is built on install
        logger.warning(
            "trioserve._abort (C) is not built: using a Python abort callback, which "
            "costs ~10%% of decode speed; reinstall trioserve with a C compiler"
        )
        return lib.ggml_abort_callback(_abort_requested), False
    return lib.ggml_abort_callback(ABORT_CHECK_ADDRESS), True


async def _raise_on_cancel(flag: ctypes.c_ubyte) -> None:
    """Sleep until cancelled, then raise the context's abort flag.

    This is how a cancel reaches *inside* ``llama_decode``: Trio delivers the request's
    cancellation to this task, which sets the byte that the C abort callback reads
    between graph nodes. Nothing polls; the event loop is not involved in the decode.
    """
    try:
        await trio.sleep_forever()
    finally:
        flag.value = 1


_llama_cpp_logger = logging.getLogger("trioserve.llama_cpp")


def _forward_log(level: int, text: bytes, _data: object) -> None:
    """llama.cpp's log lines → Python logging, at DEBUG — except errors while a model
    loads, which go to WARNING (they say why a GGUF cannot be used). After loading,
    llama.cpp's errors come back as return codes, which trioserve reports itself (an
    aborted decode logs three error lines that are not errors here)."""
    if level == 4 and _LazyLogCallback.loading:  # GGML_LOG_LEVEL_ERROR (NONE, DEBUG, INFO, WARN, ERROR, CONT)
        _llama_cpp_logger.warning("%s", text.decode("utf-8", errors="replace").rstrip())
    elif _llama_cpp_logger.isEnabledFor(logging.DEBUG):
        _llama_cpp_logger.debug("%s", text.decode("utf-8", errors="replace").rstrip())


def _make_log_callback() -> Any:
    import llama_cpp

    return llama_cpp.llama_log_callback(_forward_log)


class _LazyLogCallback:
    callback: Any = None
    loading = 0


class LlamaSettings:
    """How to load the model. Defaults suit a small CPU machine.

    Args:
        model_path: path to a GGUF file.
        n_ctx: context length per slot (tokens).
        n_threads: threads per decode; default: the CPU cores divided among the slots.
        n_batch: prompt tokens per ``llama_decode`` call during prefill.
        slots: contexts, i.e. generations that can run at once.
        model_id: the name clients use; default: the file name without ``.gguf``.
        repack: let llama.cpp repack weights for this CPU's SIMD kernels
            (``use_extra_bufts``); the batched backend turns it off in batch-invariant mode.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        slots: int = 1,
        model_id: str | None = None,
        repack: bool = True,
    ) -> None:
        self.model_path = Path(model_path)
        self.repack = repack
        self.n_ctx = n_ctx
        # Default: share the cores between the slots. llama.cpp's threads spin while they
        # wait for each other, so more threads than cores makes every decode slower
        # (measured: 4 slots x 2 threads on 2 cores gave 68 tok/s in total, 4 x 1 gave 89).
        self.n_threads = n_threads or self._default_threads(slots)
        self.n_batch = n_batch
        self.slots = slots
        self.model_id = model_id or self.model_path.name.removesuffix(".gguf")

    @staticmethod
    def _default_threads(slots: int) -> int:
        return max(1, (os.cpu_count() or 1) // slots)


class _Context:
    """One llama context with its batch and abort flag. Used by one thread at a time.

    ``sequences`` > 1 (the batched backend): room for that many sequences of
    ``settings.n_ctx`` tokens each, in a non-unified KV cache (each sequence owns its
    cells; attention never reads another sequence's)."""

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
    """What both llama.cpp backends share: the loaded model, its vocabulary, metadata,
    tokenizing, validation and sampler chains. Subclasses own the contexts and the
    inference loop (:class:`LlamaBackend`: one context per slot; ``BatchedLlamaBackend``:
    one context, many sequences)."""

    def __init__(self, settings: LlamaSettings, lib: Any, model: Any) -> None:
        super().__init__()
        self.settings = settings
        self.lib = lib
        self.model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        self._bos: int = lib.llama_vocab_bos(self.vocab)
        self._piece_cache: dict[int, bytes] = {}
        self._piece_lock = threading.Lock()
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
        self._create_contexts()

    def _create_contexts(self) -> None:
        """Create the llama contexts (called once the model and vocabulary are ready)."""
        raise NotImplementedError

    def _release_contexts(self) -> None:
        """Free the contexts (the model is freed after them)."""
        raise NotImplementedError

    # ----------------------------------------------------------------- loading

    @classmethod
    def load(cls, settings: LlamaSettings) -> Self:
        """Load the model and create the contexts (blocking: seconds for big models)."""
        import llama_cpp

        if not settings.model_path.is_file():
            raise FileNotFoundError(f"model file not found: {settings.model_path}")
        if _LazyLogCallback.callback is None:  # keep a reference: C holds the pointer
            _LazyLogCallback.callback = _make_log_callback()
        llama_cpp.llama_log_set(_LazyLogCallback.callback, None)
        llama_cpp.llama_backend_init()
        _LazyLogCallback.loading += 1
        try:
            params = llama_cpp.llama_model_default_params()
            params.use_extra_bufts = settings.repack
            model = llama_cpp.llama_model_load_from_file(str(settings.model_path).encode(), params)
            if not model:
                raise BackendError(f"llama.cpp could not load {settings.model_path}")
            return cls(settings, llama_cpp, model)
        finally:
            _LazyLogCallback.loading -= 1

    @classmethod
    async def aload(cls, settings: LlamaSettings) -> Self:
        """:meth:`load` in a worker thread. Cancellation: waits for the load to finish,
        then frees the model."""
        return await trio.to_thread.run_sync(cls.load, settings)

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self._free)

    def _free(self) -> None:
        self._release_contexts()
        self.lib.llama_model_free(self.model)

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

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Text → token ids (special tokens such as ``<start_of_turn>`` are parsed)."""
        data = text.encode()
        capacity = len(data) + 8
        tokens = (self.lib.llama_token * capacity)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_bos, True)
        if n < 0:  # too small: -n is the size needed
            capacity = -n
            tokens = (self.lib.llama_token * capacity)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_bos, True)
        return list(tokens[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (cached: the vocabulary is fixed)."""
        cached = self._piece_cache.get(token)
        if cached is not None:
            return cached
        buffer = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buffer, 256, 0, False)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buffer, -n, 0, False)
        piece = buffer.raw[:n]
        with self._piece_lock:
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(token) for token in tokens)

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
        for token in request.sampling.logit_bias:
            if token >= self.n_vocab:
                raise InvalidRequestError(
                    f"logit_bias key {token} is not a token id of this model (vocabulary: {self.n_vocab})",
                    param="logit_bias",
                )
        return fit_to_context(request, tokens, self.settings.n_ctx)

    def _sampler(self, params: SamplingParams) -> Any:
        lib = self.lib
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if params.logit_bias:
            biases = (lib.llama_logit_bias * len(params.logit_bias))()
            for i, (token, bias) in enumerate(params.logit_bias.items()):
                biases[i].token = token
                # OpenAI: -100 bans a token, +100 forces it
                biases[i].bias = -math.inf if bias <= -100 else bias
            lib.llama_sampler_chain_add(
                chain, lib.llama_sampler_init_logit_bias(self.n_vocab, len(params.logit_bias), biases)
            )
        if params.temperature == 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:
            if params.top_p < 1.0:
                lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(params.top_p, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(params.temperature))
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain


class LlamaBackend(LlamaModel, ThreadedBackend):
    """llama.cpp inference, one context per slot, each generation in its own worker
    thread. Create it with :meth:`load` (blocking) or :meth:`aload`."""

    def _create_contexts(self) -> None:
        self._contexts = [_Context(self) for _ in range(self.settings.slots)]
        self._free_contexts = list(self._contexts)

    def _release_contexts(self) -> None:
        for context in self._contexts:
            context.free(self.lib)
        self._contexts = []
        self._free_contexts = []

    # ------------------------------------------------------------ inference

    async def generate(
        self,
        prompt: PreparedPrompt,
        send: trio.MemorySendChannel[bytes],
        progress: GenerationProgress,
    ) -> Literal["stop", "length"]:
        # Admission guarantees at most `slots` generations, so a context is free.
        context = self._free_contexts.pop()
        context.abort_flag.value = 0
        try:
            async with trio.open_nursery() as nursery:
                if context.abort_flag_used:
                    nursery.start_soon(_raise_on_cancel, context.abort_flag)
                try:
                    return await self.run_in_thread(
                        functools.partial(self._infer, context), prompt, send, progress
                    )
                finally:
                    nursery.cancel_scope.cancel()  # inference is over: stop the flag task
        finally:
            self._free_contexts.append(context)

    def _infer(
        self, context: _Context, prompt: PreparedPrompt, emit: Emit, progress: GenerationProgress
    ) -> Literal["stop", "length"]:
        lib = self.lib
        sampler = self._sampler(prompt.request.sampling)
        lib.llama_memory_clear(context.memory, True)
        try:
            started = time.perf_counter()
            self._prefill(context, prompt.tokens)
            progress.prefill_seconds = time.perf_counter() - started
            ctx = context.ctx
            batch = context.batch
            decode = lib.llama_decode
            sample = lib.llama_sampler_sample
            is_eog = lib.llama_vocab_is_eog
            vocab = self.vocab
            piece = self.piece
            position = len(prompt.tokens)
            batch.n_tokens = 1
            batch.logits[0] = 1
            for remaining in range(prompt.max_new_tokens, 0, -1):
                token = sample(sampler, ctx, -1)
                if is_eog(vocab, token):
                    return "stop"
                progress.completion_tokens += 1
                emit(piece(token))
                if remaining == 1:
                    break
                batch.token[0] = token
                batch.pos[0] = position
                position += 1
                result = decode(ctx, batch)
                if result != 0:
                    self._decode_failed(result)
            return "length"
        finally:
            lib.llama_memory_clear(context.memory, True)
            lib.llama_sampler_free(sampler)

    def _prefill(self, context: _Context, tokens: Sequence[int]) -> None:
        lib = self.lib
        batch = context.batch
        n_batch = context.n_batch
        total = len(tokens)
        for start in range(0, total, n_batch):
            trio.from_thread.check_cancelled()
            chunk = tokens[start : start + n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.logits[i] = 0
            if start + len(chunk) == total:
                batch.logits[len(chunk) - 1] = 1  # logits of the last prompt token only
            result = lib.llama_decode(context.ctx, batch)
            if result != 0:
                self._decode_failed(result)

    def _decode_failed(self, result: int) -> None:
        if result == _DECODE_ABORTED:
            # The abort callback fired: the request was cancelled; raise its Cancelled.
            # (Trio marks this thread's task cancelled before the flag task runs.)
            trio.from_thread.check_cancelled()
            raise BackendError("llama_decode was aborted, but the request was not cancelled")
        raise BackendError(f"llama_decode failed with code {result}")
