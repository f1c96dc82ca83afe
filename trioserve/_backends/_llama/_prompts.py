"""A request's prompt for the loaded model (:class:`Prompts`, which
:class:`~._model.LlamaModel` owns as ``prompts``): ``prepare`` — a request's tokens
(text, ids, a fill-in-the-middle layout, images and audio laid out by the projector),
checked against the model, with its logit bias, adapters, reasoning markers and
compiled constraint — and the vocabulary's answers to requests (``/tokenize``,
``/detokenize``, token counts), each off the event loop when it is large.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import trio

from ..._core._backend import PreparedPrompt, check_token_ids, fit_to_context
from ..._core._exceptions import InvalidRequestError
from ..._core._media import AudioClip, RemoteImage, split_at_markers
from ..._core._types import GenerationRequest
from .._decoding import GrammarCompiler, marker_tokens
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
from .._side_work import run_side_work
from ._adapters import AdapterSet, LoraAdapters
from ._alora import MULTIPLE
from ._sampler import logit_bias
from ._settings import LlamaSettings

__all__ = ["PromptModel", "Prompts", "fim_tokens"]

#: prompts shorter than this (characters) are tokenized on the Trio thread: cheaper than
#: a thread hop. Longer ones go to a worker thread so the event loop never stalls.
_INLINE_TOKENIZE_CHARS = 4096
#: constraint compiles running at once (each holds a worker thread until it ends)
_COMPILE_THREADS = 2
#: the same for turning token ids into their pieces (``/detokenize``, ``/tokenize``'s
#: ``with_pieces``): more ids than this go to a worker thread
_INLINE_PIECES = 1024


class PromptModel(Protocol):
    """What :class:`Prompts` reads of the model (``LlamaModel``: a protocol, so that
    this module imports nothing of the one that owns it)."""

    settings: LlamaSettings
    lib: Any
    vocab: Any
    n_vocab: int
    bos: int
    fim: FimTokens | None
    architecture: str
    generates: bool
    adapters: LoraAdapters
    projector: Projector | None
    grammars: GrammarCompiler

    @property
    def rerank_kind(self) -> object: ...

    def tokenize(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> list[int]: ...

    def count_tokens(self, text: str, *, add_bos: bool = True, parse_special: bool = True) -> int: ...

    def detokenize(self, tokens: Sequence[int]) -> bytes: ...

    def special_piece(self, token: int) -> bytes: ...


class Prompts:
    """A request → the model's :class:`PreparedPrompt`, and ``/tokenize``'s and
    ``/detokenize``'s work: what the model's vocabulary, adapters and projector do for
    one request, before any context runs it."""

    def __init__(self, model: PromptModel) -> None:
        #: the model it prepares for
        self.model = model
        #: worker threads for compiles: a compile a cancel abandoned keeps its thread
        #: until it ends, so compiles get threads of their own (two at a time) and never
        #: take those of tokenization, template rendering or a model load
        self.compile_threads = trio.CapacityLimiter(_COMPILE_THREADS)

    def infill_prompt(self, request: GenerationRequest) -> list[int]:
        """A fill-in-the-middle request's prompt tokens, laid out as llama-server's
        ``/infill`` (``_backends/_infill.py``). 400 for a model without FIM tokens."""
        assert request.infill is not None
        model = self.model
        if model.fim is None:
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
        add_bos = bool(model.lib.llama_vocab_get_add_bos(model.vocab)) and model.bos >= 0

        def tokenize(text: str, parse_special: bool) -> list[int]:
            return model.tokenize(text, add_bos=False, parse_special=parse_special)

        return infill_tokens(
            parts, model.fim, tokenize, n_ctx=model.settings.n_ctx, bos=model.bos if add_bos else None
        )

    async def tokenize_text(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> list[int]:
        if len(text) > _INLINE_TOKENIZE_CHARS:  # the same rule as prompts: see prepare
            # (/tokenize, not a generation's own work: niced, _side_work.py)
            return await run_side_work(
                lambda: self.model.tokenize(text, add_bos=add_special, parse_special=parse_special)
            )
        return self.model.tokenize(text, add_bos=add_special, parse_special=parse_special)

    async def count_text_tokens(
        self, text: str, *, add_special: bool = False, parse_special: bool = True
    ) -> int:
        if len(text) > _INLINE_TOKENIZE_CHARS:  # (token counting: niced, _side_work.py)
            return await run_side_work(
                lambda: self.model.count_tokens(text, add_bos=add_special, parse_special=parse_special)
            )
        return self.model.count_tokens(text, add_bos=add_special, parse_special=parse_special)

    async def token_pieces(self, tokens: Sequence[int]) -> list[bytes]:
        check_token_ids(tokens, self.model.n_vocab)  # an id out of range would crash llama.cpp
        if len(tokens) > _INLINE_PIECES:
            return await run_side_work(lambda: [self.model.special_piece(t) for t in tokens])
        return [self.model.special_piece(t) for t in tokens]

    async def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        model = self.model
        if not model.generates:
            raise InvalidRequestError(
                f"the model {model.settings.model_id!r} is an encoder ({model.architecture}): it embeds"
                + (" and reranks" if model.rerank_kind else "")
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
                    lambda: model.tokenize(request.prompt, add_bos=request.add_bos)  # type: ignore[arg-type]
                )
            else:
                tokens = model.tokenize(request.prompt, add_bos=request.add_bos)
        else:
            tokens = list(request.prompt)
            bad = [t for t in tokens if not 0 <= t < model.n_vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {model.n_vocab}); got {bad[0]}", param="prompt"
                )
        return await self._finish_prepare(request, tokens)

    def adapter_set(self, request: GenerationRequest) -> AdapterSet:
        """``request.lora`` as an adapter set of this model's adapters (400 naming
        what is wrong)."""
        if not request.lora:
            return ()
        adapters = self.model.adapters
        if not len(adapters):
            raise InvalidRequestError(
                f"the model {self.model.settings.model_id!r} has no LoRA adapters (serve it with "
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
        bias = await logit_bias(request.sampling, self.model.n_vocab)
        prepared = fit_to_context(request, tokens, self.model.settings.n_ctx)
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
            marked = marker_tokens(self.model.tokenize, self.model.detokenize, markers.start, markers.end)
            prepared = dataclasses.replace(prepared, reasoning_tokens=marked)
        if request.constraint is not None:
            # compiling (and, the first time, building the grammar engine's view of the
            # vocabulary) can take a while: off the event loop. A cancel returns at
            # once; the thread finishes its bounded compile and the result is dropped.
            constraint = request.constraint
            mask = await trio.to_thread.run_sync(
                lambda: self.model.grammars.compile(constraint),
                abandon_on_cancel=True,
                limiter=self.compile_threads,
            )
            prepared = dataclasses.replace(prepared, compiled=mask)
        return prepared

    async def _prepare_images(self, request: GenerationRequest) -> PreparedPrompt:
        """A prompt with images: laid out by the projector (docs/vision.md)."""
        projector = self.model.projector
        check_media_support(projector, self.model.settings.model_id, request.images)
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
        limit = self.model.settings.max_image_tokens
        if laid_out.image_tokens > limit:
            raise InvalidRequestError(
                f"the images of this request take {laid_out.image_tokens} tokens; this model takes at most "
                f"{limit} image tokens per request (--max-image-tokens)",
                param="messages",
                code="too_many_image_tokens",
            )
        widest = max(span.length for span in laid_out.spans)
        if widest > self.model.settings.n_batch:
            raise InvalidRequestError(
                f"an image of this request takes {widest} tokens, which must be evaluated in one call; "
                f"this server's batch holds {self.model.settings.n_batch} (raise --n-batch)",
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
        limit = self.model.settings.max_audio_seconds

        def measure() -> tuple[list[int], list[float]]:
            sizes = [projector.measure(images[k], f"messages (image {k})") for k in pictures]  # type: ignore[arg-type]
            return sizes, [probe_seconds(clip, limit) for clip in clips]

        sizes, seconds = await trio.to_thread.run_sync(measure, abandon_on_cancel=True)
        pixels = dict(zip(pictures, sizes, strict=True))
        budget = self.model.settings.image_budget
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


def fim_tokens(lib: Any, vocab: Any) -> FimTokens | None:
    """The vocabulary's fill-in-the-middle tokens (``None``: it has none: no ``/infill``)."""
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
