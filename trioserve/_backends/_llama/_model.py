"""The loaded llama.cpp model, on llama-cpp-python's low-level (C API) bindings: its
vocabulary, tokenizer, metadata, validation (``prepare``), grammars and sampler chains
(:class:`LlamaModel`) — what does not depend on how requests are scheduled. The backend
(:class:`~._backend.LlamaBackend`) holds one and owns the contexts that run it; loading
is :mod:`._loading`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy
import trio

from ..._core._backend import ModelInfo, PreparedPrompt, check_token_ids, fit_to_context
from ..._core._exceptions import BackendError, InvalidRequestError
from ..._core._media import AudioClip, RemoteImage, split_at_markers
from ..._core._types import GenerationRequest, SamplingParams
from .._cache import classify_piece, make_rule
from .._decoding import GrammarCompiler, LogitBias, marker_tokens
from .._infill import FimTokens, InfillParts, infill_tokens
from .._media import (
    DECODED_BYTES_PER_SECOND,
    DECODING_PER_PIXEL,
    HELD_PER_PIXEL,
    Projector,
    VisionPrompt,
    check_media_support,
    decode_bytes,
    decoded_bytes,
    probe_seconds,
)
from .._platform import RepackDecision
from .._retrieval import reranker_kind
from .._side_work import run_side_work
from ._adapters import AdapterSet, LoraAdapters
from ._alora import MULTIPLE, invocations
from ._loading import load
from ._native import LoadAborted, LoadLog, make_log_callback, meta_value
from ._sampler import logit_bias, sampler_chain
from ._settings import LlamaSettings

__all__ = ["LlamaModel"]

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


class LlamaModel:
    """The loaded model, its vocabulary, metadata, tokenizing, validation and sampler
    chains. The backend that serves it (``LlamaBackend``) holds it and owns the
    contexts and the inference loop; it frees them before it closes the model."""

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
        self.fim = self._fim_tokens()
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
        #: ``general.architecture`` (``bert``, ``gemma3``…)
        self.architecture = self._meta("general.architecture") or ""
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

    def _fim_tokens(self) -> FimTokens | None:
        lib, vocab = self.lib, self.vocab
        ids = [
            int(read(vocab))
            for read in (lib.llama_vocab_fim_pre, lib.llama_vocab_fim_suf, lib.llama_vocab_fim_mid)
        ]
        if any(token < 0 for token in ids):
            return None
        repo, separator = int(lib.llama_vocab_fim_rep(vocab)), int(lib.llama_vocab_fim_sep(vocab))
        return FimTokens(
            ids[0],
            ids[1],
            ids[2],
            repo=repo if repo >= 0 else None,
            separator=separator if separator >= 0 else None,
        )

    def infill_prompt(self, request: GenerationRequest) -> list[int]:
        """A fill-in-the-middle request's prompt tokens, laid out as llama-server's
        ``/infill`` (``_backends/_infill.py``). 400 for a model without FIM tokens."""
        assert request.infill is not None
        if self.fim is None:
            raise InvalidRequestError(
                "this model cannot fill in the middle: its vocabulary names no FIM prefix, suffix and "
                "middle tokens (tokenizer.ggml.fim_pre_token_id, …); use a code model that has them "
                "(GET /v1/models says which can: capabilities.infill)",
                param="input_prefix",
                code="infill_not_supported",
            )
        infill = request.infill
        prompt = request.prompt if isinstance(request.prompt, str) else ""
        parts = InfillParts(infill.prefix, infill.suffix, prompt, infill.extra)
        add_bos = bool(self.lib.llama_vocab_get_add_bos(self.vocab)) and self.bos >= 0

        def tokenize(text: str, parse_special: bool) -> list[int]:
            return self.tokenize(text, add_bos=False, parse_special=parse_special)

        return infill_tokens(
            parts, self.fim, tokenize, n_ctx=self.settings.n_ctx, bos=self.bos if add_bos else None
        )

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
    def load(
        cls,
        settings: LlamaSettings,
        *,
        progress: Callable[[float], None] | None = None,
        abort: threading.Event | None = None,
    ) -> Self:
        """Load the weights (blocking: :func:`._loading.load`); ``abort`` stays this
        model's :meth:`check_abort` flag for the rest of the load (contexts, warm-up)."""
        return load(cls, settings, progress=progress, abort=abort)

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
        if not self.generates:
            raise InvalidRequestError(
                f"the model {self.settings.model_id!r} is an encoder ({self.architecture}): it embeds"
                + (" and reranks" if self.rerank_kind else "")
                + " but cannot generate text; send this request to a generative model",
                param="model",
                code="generation_not_supported",
            )
        if request.infill is not None:
            infill = request.infill
            size = (
                sum(len(text) for _, text in infill.extra) + len(str(infill.prefix)) + len(str(infill.suffix))
            )
            if size > _INLINE_TOKENIZE_CHARS:
                tokens = await trio.to_thread.run_sync(self.infill_prompt, request)
            else:
                tokens = self.infill_prompt(request)
        elif request.images:
            return await self._prepare_images(request)
        elif isinstance(request.prompt, str):
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
        return await self._finish_prepare(request, tokens)

    def adapter_set(self, request: GenerationRequest) -> AdapterSet:
        """``request.lora`` as an adapter set of this model's adapters (400 naming
        what is wrong)."""
        if not request.lora:
            return ()
        adapters = self.adapters
        if not len(adapters):
            raise InvalidRequestError(
                f"the model {self.settings.model_id!r} has no LoRA adapters (serve it with "
                "--lora NAME=PATH, or a preset's lora table, or POST /v1/load_lora_adapter); send no lora",
                param="lora",
            )
        named = [(adapters.by_id(w) if isinstance(w, int) else w, scale) for w, scale in request.lora]
        chosen = adapters.select(named)
        if sum(1 for name, _ in chosen if adapters.invocation(name)) > 1:
            raise InvalidRequestError(MULTIPLE, param="lora")  # (llama-server's refusal)
        return chosen

    async def _finish_prepare(
        self, request: GenerationRequest, tokens: list[int], media: VisionPrompt | None = None
    ) -> PreparedPrompt:
        bias = await logit_bias(request.sampling, self.n_vocab)
        prepared = fit_to_context(request, tokens, self.settings.n_ctx)
        chosen = self.adapter_set(request)
        if chosen:
            prepared = dataclasses.replace(prepared, adapters=chosen)
        if media is not None:
            prepared = dataclasses.replace(prepared, media=media)
        if bias is not None:
            prepared = dataclasses.replace(prepared, logit_bias=bias)
        markers = request.reasoning
        if markers is not None and request.reasoning_control and request.constraint is None:
            # (a constrained answer never reasons: the wire turns reasoning off for it)
            marked = marker_tokens(self.tokenize, self.detokenize, markers.start, markers.end)
            prepared = dataclasses.replace(prepared, reasoning_tokens=marked)
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

    async def _prepare_images(self, request: GenerationRequest) -> PreparedPrompt:
        """A prompt with images: laid out by the projector (docs/vision.md)."""
        projector = self.projector
        check_media_support(projector, self.settings.model_id, request.images)
        assert projector is not None
        if not isinstance(request.prompt, str) or request.infill is not None:
            raise InvalidRequestError("images go in a chat's messages, with a text prompt", param="prompt")
        images: list[bytes | AudioClip] = []
        for i, image in enumerate(request.images):
            if isinstance(image, RemoteImage):
                raise InvalidRequestError(
                    f"image {i} is a URL ({image.url}): fetch it first (the server fetches only with "
                    "--media-fetch or --media-dir)",
                    param=image.param,
                    code="media_fetch_disabled",
                )
            images.append(image)
        pieces = split_at_markers(request.prompt)
        named = [p for p in pieces if isinstance(p, int)]
        if any(index >= len(images) for index in named):
            raise InvalidRequestError("the prompt names an image the request does not hold", param="messages")
        if not named:
            raise InvalidRequestError(
                "the chat template left this conversation's images out of the prompt", param="messages"
            )
        laid_out = await self._decode_images(projector, request, pieces, images)
        limit = self.settings.max_image_tokens
        if laid_out.image_tokens > limit:
            raise InvalidRequestError(
                f"the images of this request take {laid_out.image_tokens} tokens; this model takes at most "
                f"{limit} image tokens per request (--max-image-tokens)",
                param="messages",
                code="too_many_image_tokens",
            )
        widest = max(span.length for span in laid_out.spans)
        if widest > self.settings.n_batch:
            raise InvalidRequestError(
                f"an image of this request takes {widest} tokens, which must be evaluated in one call; "
                f"this server's batch holds {self.settings.n_batch} (raise --n-batch)",
                param="messages",
                code="image_too_large",
            )
        return await self._finish_prepare(request, laid_out.tokens, laid_out)

    async def _decode_images(
        self,
        projector: Projector,
        request: GenerationRequest,
        pieces: list[str | int],
        images: list[bytes | AudioClip],
    ) -> VisionPrompt:
        """The images decoded and laid out with the prompt, under the server's decode
        budget (docs/vision.md, "Decoding under a budget"): each image's size read from
        its header first (a worker thread; refused over the pixel limit), the request's
        share of the budget waited for (cancellable), then the decode in a worker thread
        that stops between images when the request is cancelled."""
        used = sorted({piece for piece in pieces if isinstance(piece, int)})
        pictures = [k for k in used if not isinstance(images[k], AudioClip)]
        clips = [clip for k in used if isinstance(clip := images[k], AudioClip)]
        limit = self.settings.max_audio_seconds

        def measure() -> tuple[list[int], list[float]]:
            sizes = [projector.measure(images[k], f"messages (image {k})") for k in pictures]  # type: ignore[arg-type]
            return sizes, [probe_seconds(clip, limit) for clip in clips]

        sizes, seconds = await trio.to_thread.run_sync(measure, abandon_on_cancel=True)
        pixels = dict(zip(pictures, sizes, strict=True))
        budget = self.settings.image_budget
        need = decode_bytes(sizes) + sum(decoded_bytes(s) for s in seconds)
        if need > budget.capacity:
            raise InvalidRequestError(
                f"this request's media take {need / (1 << 20):,.0f} MiB to decode ({sum(sizes):,} pixels: "
                f"{HELD_PER_PIXEL} bytes each, held together until the prompt is laid out, and "
                f"{DECODING_PER_PIXEL} a pixel of the largest while it decodes; "
                f"{sum(seconds):,.0f} seconds of audio: {DECODED_BYTES_PER_SECOND:,} bytes a second); "
                "this server decodes at most "
                f"{budget.capacity / (1 << 20):,.0f} MiB at once (--image-decode-budget): send smaller or "
                "fewer images",
                param="messages",
                code="image_too_large",
            )
        async with budget.hold(need):
            return await trio.to_thread.run_sync(
                lambda: projector.tokenize(
                    pieces,
                    images,
                    pixels,
                    add_bos=request.add_bos,
                    check=trio.from_thread.check_cancelled,
                    max_audio_seconds=limit,
                )
            )

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
