"""The loaded llama.cpp model, on llama-cpp-python's low-level (C API) bindings: its
vocabulary, tokenizer, metadata, adapters, projector, grammars and sampler chains
(:class:`LlamaModel`) — what does not depend on how requests are scheduled. A request's
prompt (``prepare``) is its :class:`~._prompts.Prompts`'; the backend
(:class:`~._backend.LlamaBackend`) holds one and owns the contexts that run it; loading
is :mod:`._loading`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any, Self, Unpack

import numpy

from ..._core._backend import ModelInfo, PreparedPrompt
from ..._core._exceptions import BackendError
from ..._core._types import GenerationRequest, SamplingParams
from .._cache import classify_piece, make_rule
from .._decoding import GrammarCompiler, LogitBias
from .._media import Projector
from .._platform import RepackDecision
from .._retrieval import reranker_kind
from ._adapters import AdapterSet, LoraAdapters
from ._alora import invocations
from ._loading import LoadControls, load
from ._native import LoadAborted, LoadLog, make_log_callback, meta_value
from ._prompts import Prompts, fim_tokens
from ._ring_layout import RING_ARCHITECTURES
from ._sampler import sampler_chain
from ._settings import LlamaSettings

__all__ = ["LlamaModel"]

logger = logging.getLogger("trioserve.llama")

#: ``LLAMA_TOKEN_ATTR_CONTROL`` (llama.h)
_ATTR_CONTROL = 1 << 3


class LlamaModel:
    """The loaded model, its vocabulary, metadata, tokenizing and sampler chains; a
    request's prompt is its :attr:`prompts`' (:mod:`._prompts`). The backend that serves
    it (``LlamaBackend``) holds it and owns the contexts and the inference loop; it frees
    them before it closes the model."""

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
        abort: threading.Event | None = None,
    ) -> None:
        #: set when the load should stop (checked between its phases: the weights, the
        #: contexts, the warm-up)
        self._load_abort = abort
        self.system_info = system_info
        self.repack = repack
        self._freed = False
        self.settings = settings
        self.lib = lib
        self.model = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab: int = lib.llama_vocab_n_tokens(self.vocab)
        #: the BOS token id (-1: none): the warm-up decodes it
        self.bos: int = lib.llama_vocab_bos(self.vocab)
        #: its fill-in-the-middle tokens (``None``: it has none: no ``/infill``)
        self.fim = fim_tokens(lib, self.vocab)
        self._piece_cache: dict[int, bytes] = {}
        #: the constraint compiler (its view of the vocabulary is built on first use)
        self.grammars = GrammarCompiler(lib, self.vocab, self.n_vocab, self.token_bytes)
        #: a request's prompt for it (``prepare``) and ``/tokenize``'s work (:mod:`._prompts`)
        self.prompts = Prompts(self)
        self._piece_lock = threading.Lock()
        #: where prompts are cut into prefill calls (docs/prompt-cache.md, "The cut")
        self.piece_rule = make_rule(
            settings.piece_rule,
            settings.prefill_chunk,
            classify=self._classify_token,
            n_vocab=self.n_vocab,
            deep_from=settings.deep_from,
            deep_piece=settings.deep_chunk,
        )
        train_ctx = lib.llama_model_n_ctx_train(model)
        if settings.n_ctx > train_ctx:
            logger.warning("n_ctx %d exceeds the model's training context %d", settings.n_ctx, train_ctx)
        #: ``general.architecture`` (``bert``, ``gemma3``…)
        self.architecture = self._meta("general.architecture") or ""
        # the window layers' default (every cell, or a ring where it is laid out exactly)
        window = max(0, int(lib.llama_model_n_swa(model)))
        settings.resolve_window(window if self.architecture in RING_ARCHITECTURES else 0)
        #: the model generates text (an encoder — BERT and its kin — does not: its
        #: attention sees the whole input; it embeds and ranks only)
        self.generates = (self._meta(f"{self.architecture}.attention.causal") or "true").strip() != "false"
        #: what reranking it can do (docs/rerank.md)
        self.rerank_kind = reranker_kind(self)
        if self.rerank_kind == "yes-no":
            self.yes_no_tokens()  # (a vocabulary without them fails the load, not a request)
        self._info = ModelInfo(
            id=settings.model_id,
            context_length=settings.n_ctx,
            chat_template=self._meta("tokenizer.chat_template"),
            architecture=self.architecture or None,
            bos_token=self._token_text(self.bos),
            eos_token=self._token_text(lib.llama_vocab_eos(self.vocab)),
            infill=self.fim is not None,
            rerank=self.rerank_kind,
            generates=self.generates,
        )
        #: its vision projector (``settings.mmproj``: :meth:`load_projector`), or None
        self.projector: Projector | None = None
        #: its LoRA adapters (``settings.lora``: :meth:`load_adapters`; docs/lora.md)
        self.adapters = LoraAdapters(lib, model)
        with LlamaModel._count_lock:
            LlamaModel.loaded += 1

    def load_adapters(self) -> None:
        """Load ``settings.lora`` (a load's phase after the weights: blocking)."""
        for name, path, scale in self.settings.lora:
            self.check_abort()
            adapter = self.adapters.load(name, path, scale)
            logger.info("LoRA adapter %s: %s (scale %g, alpha %g)", name, path, scale, adapter.alpha)
        self.refresh_adapters()

    def refresh_adapters(self) -> None:
        """``info.adapters``: the adapters listed now (after a load, an unload, a scale
        set at run time: ``_lora_loads``)."""
        listed = tuple((a.name, a.scale, str(a.path)) for a in self.adapters.listed)
        alora = invocations(self.adapters.listed, self.special_piece)
        self._info = dataclasses.replace(self._info, adapters=listed, alora=alora)

    def load_projector(self) -> None:
        """Load ``settings.mmproj`` (the load's last phase: blocking, aborted with it)."""
        path = self.settings.mmproj
        if path is None:
            return
        self.check_abort()
        if LoadLog.callback is None:  # (libmtmd logs as llama.cpp does: to our logger)
            LoadLog.callback = make_log_callback()
        self.projector = Projector(
            self.model,
            path,
            n_vocab=self.n_vocab,
            n_embd=self.n_embd,
            n_threads=self.settings.n_threads,
            abort=self._load_abort,
            log_callback=LoadLog.callback,
        )
        projector = self.projector
        self._info = dataclasses.replace(self._info, vision=projector.vision, audio=projector.audio)
        self.check_abort()

    def _classify_token(self, token: int) -> int:
        """A token's class for the cut (``_pieces``): control or not, its text. (The BOS
        token opens a sequence, not a turn: it is no header.)"""
        lib = self.lib
        control = token != self.bos and bool(lib.llama_vocab_get_attr(self.vocab, token) & _ATTR_CONTROL)
        end = control and bool(lib.llama_vocab_is_eog(self.vocab, token))
        return classify_piece(self.token_bytes(token, special=False), control=control, end=end)

    def check_abort(self) -> None:
        """Between the load's phases: raise :class:`LoadAborted` if the load was aborted."""
        if self._load_abort is not None and self._load_abort.is_set():
            raise LoadAborted(f"the load of {self.settings.model_path} was aborted")

    # ----------------------------------------------------------------- loading

    @classmethod
    def load(cls, settings: LlamaSettings, **controls: Unpack[LoadControls]) -> Self:
        """Load the weights (blocking: :func:`._loading.load`); ``abort`` stays this
        model's :meth:`check_abort` flag for the rest of the load (contexts, warm-up)."""
        return load(cls, settings, **controls)

    def close(self) -> None:
        """Free the model (blocking; a second call does nothing). Whatever holds
        contexts of it frees them first (``LlamaBackend.close``)."""
        if self._freed:
            return
        self._freed = True
        if self.projector is not None:
            self.projector.free()
        self.grammars.wait_idle()  # a compile a cancel abandoned still reads the vocabulary
        self.lib.llama_model_free(self.model)
        with LlamaModel._count_lock:
            LlamaModel.loaded -= 1

    # ------------------------------------------------------------- metadata

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (``None``: the file has no such key)."""
        return self._meta(key)

    def yes_no_tokens(self) -> tuple[int, int]:
        """The single tokens of "yes" and "no" (a ``yes-no`` reranker's answer); a
        vocabulary that spells either in several tokens cannot be one."""
        out = []
        for word in ("yes", "no"):
            tokens = self.tokenize(word, add_bos=False, parse_special=False)
            if len(tokens) != 1:
                raise BackendError(
                    f"rerank = 'yes-no' needs {word!r} to be one token of the model's vocabulary; "
                    f"it is {len(tokens)}: this model cannot be a yes/no reranker"
                )
            out.append(tokens[0])
        return out[0], out[1]

    def pair_flags(self) -> dict[str, Any]:
        """The vocabulary's special tokens and add-flags, as a cross-encoder's pair
        layout reads them (``_backends/_retrieval/_rerank.py::pair_tokens``)."""
        lib, vocab = self.lib, self.vocab
        return {
            "bos": int(lib.llama_vocab_bos(vocab)),
            "eos": int(lib.llama_vocab_eos(vocab)),
            "sep": int(lib.llama_vocab_sep(vocab)),
            "add_bos": bool(lib.llama_vocab_get_add_bos(vocab)),
            "add_eos": bool(lib.llama_vocab_get_add_eos(vocab)),
            "add_sep": bool(lib.llama_vocab_get_add_sep(vocab)),
        }

    def _meta(self, key: str) -> str | None:
        return meta_value(self.lib, self.model, key)

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        text = self.lib.llama_vocab_get_text(self.vocab, token)
        return text.decode("utf-8", errors="replace") if text else ""

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def n_embd(self) -> int:
        """The length of the model's embeddings."""
        return int(self.lib.llama_model_n_embd(self.model))

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

    # -------------------------------------------------------------- prompts

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """``request`` as this model's prompt (:meth:`._prompts.Prompts.prepare`)."""
        return await self.prompts.prepare(request)

    def infill_prompt(self, request: GenerationRequest) -> list[int]:
        """A fill-in-the-middle request's prompt tokens (:meth:`._prompts.Prompts.infill_prompt`)."""
        return self.prompts.infill_prompt(request)

    def adapter_set(self, request: GenerationRequest) -> AdapterSet:
        """``request.lora`` as an adapter set (:meth:`._prompts.Prompts.adapter_set`)."""
        return self.prompts.adapter_set(request)

    def sampler(
        self,
        params: SamplingParams,
        *,
        max_new_tokens: int = 0,
        seed_offset: int = 0,
        bias: LogitBias | None = None,
    ) -> Any:
        """llama.cpp's sampler chain for ``params`` (:func:`._sampler.sampler_chain`)."""
        return sampler_chain(
            self.lib,
            self.n_vocab,
            self.settings.n_ctx,
            params,
            max_new_tokens=max_new_tokens,
            seed_offset=seed_offset,
            bias=bias,
            vocab=self.vocab,
        )
