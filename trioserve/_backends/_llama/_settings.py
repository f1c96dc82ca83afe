"""How to load a llama.cpp model and run it: :class:`LlamaSettings`, checked when made."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from ..._core._media import ImageBudget, default_image_budget

__all__ = ["KV_CACHE_TYPES", "LlamaSettings", "check_adapter_name"]

_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: the KV cache types llama-server's ``--cache-type-k/-v`` accept (common/arg.cpp's
#: ``kv_cache_types``), and their ``ggml_type`` ids (ggml.h)
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "iq4_nl": 20,
    "q5_0": 6,
    "q5_1": 7,
}


class LlamaSettings:
    """How to load the model and run it. Defaults suit a CPU machine.

    Args:
        model_path: path to a GGUF file.
        n_ctx: context length per sequence (tokens).
        cache_type_k: the KV cache's data type for K (``--cache-type-k``: one of
            :data:`KV_CACHE_TYPES`, llama-server's names; default ``f16``): ``q8_0``
            halves the cache's memory. Generation contexts only (docs/models.md, "KV
            cache types").
        cache_type_v: the same for V (``--cache-type-v``); a quantized V needs flash
            attention, which llama.cpp then turns on.
        swa_full: a sliding-window model's window layers keep every cell: any cached
            prefix is reusable from the cells alone, at the cost of every cell's memory
            and of attention over all of them. ``False`` (``--no-swa-full``,
            llama-server's default): they keep a ring of about the window and a batch —
            a 32k context's KV memory is a fraction and long prompts run faster; a
            cached prefix is reusable where those cells still reach, or from a
            checkpoint of them (``ctx_checkpoints``). Both exact for a plain sliding
            window (Gemma 2/3; the ring is laid out as a fresh evaluation leaves it:
            docs/prompt-cache.md, "The window's ring, exact"). ``None`` (the
            default): every cell while ``n_ctx`` is at most four times the window and
            a batch (4,096 for Gemma 3 with 512-token batches), the ring past that
            (:meth:`resolve_window`, at load).
        ctx_checkpoints: with the window layers kept to their window, the checkpoints of
            their cells each sequence id keeps (``--ctx-checkpoints``, llama-server's
            name; 0: none): a prefix whose window cells are gone is given back from the
            nearest one below it (docs/prompt-cache.md, "Window checkpoints").
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
            shares) or ``"aligned"`` (every ``prefill_chunk`` tokens from position 0,
            every ``deep_chunk`` past ``deep_from``);
            ``docs/prompt-cache.md``, "The cut".
        deep_chunk / deep_from: a piece that starts ``deep_from`` tokens or more into
            a prompt ends only at a turn header or after ``deep_chunk`` tokens (default:
            ``max(prefill_chunk, min(512, n_batch))``; 0: no deep pieces): long prompts in calls the CPU's
            kernels run at full rate (``docs/prompt-cache.md``, "Deep pieces").
        prompt_cache: keep the KV cells of finished prompts' whole pieces and reuse the
            longest cached prefix (``docs/prompt-cache.md``).
        cache_ram_bytes: host memory for cached prefixes evicted from KV cells (their
            sequence states), least recently used out first; 0: none.
        cache_dir: a directory for the prompt cache's disk tier (docs/prompt-cache.md,
            "On disk"): every state saved is written there too, restored from there
            after a restart or an unload, and shared by the processes that use the same
            directory; ``None`` (the library's default): no disk tier.
        cache_disk_bytes: the disk tier's budget for the whole directory, least
            recently used out first.
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
            text never changes), ``"exact"`` (as auto at any context: a lone step past
            256 cells with no guess carries a pad row, so steps and verify rows take one
            attention path; the pad costs a step about 16 % on the CPU measured),
            ``"fast"`` (wide verify calls at any context, as
            llama-server's n-gram modes: faster, and a temperature-0 text may change) or
            ``"off"``.
        pooling: how ``/v1/embeddings`` pools a model's token vectors: ``None`` (the
            GGUF's; mean for a model that has none), ``"mean"``, ``"cls"``, ``"last"``
            (docs/embeddings.md).
        rerank: ``"yes-no"``: a generative model reranks by its "yes" probability
            (docs/rerank.md); a cross-encoder GGUF reranks without it.
        rerank_template: that reranker's prompt (``{instruction}``, ``{query}``,
            ``{document}``); default: ``_backends/_retrieval/_rerank.py``'s ``DEFAULT_TEMPLATE``.
        mmproj: the model's projector (a GGUF libmtmd loads: ``--mmproj``): the model
            then takes images (docs/vision.md) or audio (docs/audio.md), as it encodes.
        max_image_tokens: the most image tokens one request's prompt may hold.
        max_audio_seconds: the longest audio clip a request may hold (docs/audio.md).
        lora: LoRA adapters loaded after the weights, ``(name, path, scale)`` each
            (``--lora NAME=PATH[:SCALE]``: docs/lora.md); ``scale``: a request's when it
            names the adapter without one.
        lora_max: the most adapters the model may list at once (``--lora-max``): a
            run-time load past it is refused (docs/lora.md).
        image_budget: the bytes of decoded images held at once (``--image-decode-budget``:
            one :class:`~trioserve._core._media.ImageBudget` shared by a server's models);
            default: one per process, of 1 GiB.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        n_ctx: int = 4096,
        cache_type_k: str = "f16",
        swa_full: bool | None = None,
        ctx_checkpoints: int = 8,
        cache_type_v: str = "f16",
        n_threads: int | None = None,
        n_batch: int = 512,
        slots: int = 8,
        prefill_chunk: int = 128,
        piece_rule: Literal["text", "aligned"] = "text",
        deep_chunk: int | None = None,
        deep_from: int = 1024,
        prompt_cache: bool = True,
        cache_ram_bytes: int = 1 << 30,
        cache_dir: str | Path | None = None,
        cache_disk_bytes: int = 8 << 30,
        idle_recompute: bool = True,
        cache_mode: Literal["exact", "fast"] = "exact",
        batch_invariant: bool = False,
        model_id: str | None = None,
        repack: bool | None = None,
        warm_up: bool = True,
        pooling: Literal["mean", "cls", "last"] | None = None,
        speculate: Literal["off", "auto", "exact", "fast"] = "auto",
        rerank: Literal["yes-no"] | None = None,
        rerank_template: str | None = None,
        mmproj: str | Path | None = None,
        max_image_tokens: int = 4096,
        max_audio_seconds: int = 600,
        image_budget: ImageBudget | None = None,
        lora: Sequence[tuple[str, str | Path, float]] = (),
        lora_max: int = 16,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        if slots > n_batch:
            # every step decodes one token of each sequence in one batch of n_batch rows
            raise ValueError(f"slots ({slots}) may be at most n_batch ({n_batch}): raise the batch size")
        if not 1 <= prefill_chunk <= n_batch:
            raise ValueError(f"prefill_chunk must be in [1, n_batch={n_batch}], got {prefill_chunk}")
        if deep_chunk is None:
            deep_chunk = max(prefill_chunk, min(512, n_batch))
        elif deep_chunk and not prefill_chunk <= deep_chunk <= n_batch:
            raise ValueError(
                f"deep_chunk must be 0 or in [prefill_chunk={prefill_chunk}, n_batch={n_batch}], "
                f"got {deep_chunk}"
            )
        if deep_from < 0:
            raise ValueError(f"deep_from must be at least 0, got {deep_from}")
        self.model_path = Path(model_path)
        self.batch_invariant = batch_invariant
        self.repack = repack
        self.warm_up = warm_up
        self.n_ctx = n_ctx
        for flag, value in (("cache_type_k", cache_type_k), ("cache_type_v", cache_type_v)):
            if value not in KV_CACHE_TYPES:
                raise ValueError(f"{flag} must be one of {', '.join(KV_CACHE_TYPES)}, got {value!r}")
        self.cache_type_k = cache_type_k
        #: as asked (``None``: chosen at load by :meth:`resolve_window`), and in force
        self.swa_full_asked = swa_full
        self.swa_full = True if swa_full is None else swa_full
        if ctx_checkpoints < 0:
            raise ValueError(f"ctx_checkpoints must be at least 0, got {ctx_checkpoints}")
        self.ctx_checkpoints = ctx_checkpoints
        self.cache_type_v = cache_type_v
        # llama.cpp's threads spin while they wait for each other: more threads than
        # cores makes every decode slower, so one context gets exactly the cores.
        self.n_threads = n_threads or os.cpu_count() or 1
        self.n_batch = n_batch
        self.slots = slots
        self.prefill_chunk = prefill_chunk
        self.deep_chunk = deep_chunk
        self.deep_from = deep_from
        if piece_rule not in ("text", "aligned"):
            raise ValueError(f"piece_rule must be 'text' or 'aligned', got {piece_rule!r}")
        self.piece_rule: Literal["text", "aligned"] = piece_rule
        self.prompt_cache = prompt_cache
        if cache_ram_bytes < 0:
            raise ValueError(f"cache_ram_bytes must be at least 0, got {cache_ram_bytes}")
        self.cache_ram_bytes = cache_ram_bytes
        if cache_disk_bytes < 0:
            raise ValueError(f"cache_disk_bytes must be at least 0, got {cache_disk_bytes}")
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.cache_disk_bytes = cache_disk_bytes
        self.idle_recompute = idle_recompute
        if cache_mode not in ("exact", "fast"):
            raise ValueError(f"cache_mode must be 'exact' or 'fast', got {cache_mode!r}")
        self.cache_mode = cache_mode
        if speculate not in ("off", "auto", "exact", "fast"):
            raise ValueError(f"speculate must be 'off', 'auto', 'exact' or 'fast', got {speculate!r}")
        self.speculate: Literal["off", "auto", "exact", "fast"] = speculate
        self.model_id = model_id or self.model_path.name.removesuffix(".gguf")
        if pooling not in (None, "mean", "cls", "last"):
            raise ValueError(f"pooling must be 'mean', 'cls' or 'last', got {pooling!r}")
        self.pooling: Literal["mean", "cls", "last"] | None = pooling
        if rerank not in (None, "yes-no"):
            raise ValueError(f"rerank must be 'yes-no' or None, got {rerank!r}")
        if rerank_template is not None:
            if rerank is None:
                raise ValueError("rerank_template is for rerank = 'yes-no'; set that too")
            from .._retrieval import YesNoTemplate

            YesNoTemplate.parse(rerank_template)  # (ValueError naming the mistake)
        self.rerank: Literal["yes-no"] | None = rerank
        self.rerank_template = rerank_template
        self.mmproj = None if mmproj is None else Path(mmproj).expanduser()
        if max_image_tokens < 1:
            raise ValueError(f"max_image_tokens must be at least 1, got {max_image_tokens}")
        self.max_image_tokens = max_image_tokens
        if max_audio_seconds < 1:
            raise ValueError(f"max_audio_seconds must be at least 1, got {max_audio_seconds}")
        self.max_audio_seconds = max_audio_seconds
        self.image_budget = image_budget if image_budget is not None else default_image_budget()
        names = [check_adapter_name(name) for name, _, _ in lora]
        if len(set(names)) != len(names):
            raise ValueError(f"two LoRA adapters share a name: {sorted(names)}")
        self.lora = tuple((name, Path(path).expanduser(), float(scale)) for name, path, scale in lora)
        if lora_max < len(self.lora) or lora_max < 0:
            raise ValueError(f"lora_max ({lora_max}) must be at least the adapters given ({len(self.lora)})")
        self.lora_max = lora_max

    def resolve_window(self, window: int) -> None:
        """At load (``window``: the model's sliding window where its ring is laid out
        exactly, 0: none or not): the default ``swa_full`` — every cell while the
        context per sequence is at most four times the window and a batch, where
        keeping every cell costs little memory or attention and spares checkpoints;
        the ring past that, where both grow with the context (measured:
        docs/long-context.md)."""
        if self.swa_full_asked is None:
            self.swa_full = not window or self.n_ctx <= 4 * (window + self.n_batch)

    @property
    def kv_types(self) -> str:
        """``"K/V"``: the KV cache's types (``"f16/f16"``), which a cached state's cells
        are made of (a host tier of other types is not reused: ``_tiers.host_tier``)."""
        return f"{self.cache_type_k}/{self.cache_type_v}" + ("" if self.swa_full else "/window")


def check_adapter_name(name: str) -> str:
    """``name``, if it can name an adapter (letters, digits, ``.``, ``_``, ``-``; no
    ``:``, which separates a base model from its adapter in ``model``)."""
    if not _ADAPTER_NAME.fullmatch(name):
        raise ValueError(
            f"an adapter's name is letters, digits, '.', '_' and '-' (at most 128), got {name!r}"
        )
    return name
