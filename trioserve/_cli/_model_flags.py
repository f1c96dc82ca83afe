"""``trioserve serve``'s flags for what is served: the model and each model's defaults,
several models (``--model NAME=PATH``, ``--models-dir``, a preset file), the prompt cache,
and an upstream server in place of a model (the order ``--help`` shows)."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from .._backends._llama._settings import KV_CACHE_TYPES
from ._flag_types import add_repeatable, positive_float, positive_int

__all__ = ["add_model_flags"]


def add_model_flags(serve: argparse.ArgumentParser) -> None:
    """The groups of flags for what is served, in ``--help``'s order."""
    _model(serve)
    _models(serve)
    _prompt_cache(serve)
    _upstream(serve)


def _ctx_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {value}")
    return value


def _lora(text: str) -> tuple[str, str, float]:
    name, equals, rest = text.partition("=")
    if not equals or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[:SCALE], got {text!r}")
    path, scale = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon and head:
        with contextlib.suppress(ValueError):  # (else a path with a colon in it)
            path, scale = head, float(tail)
    return name, path, scale


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"repeat_penalty\": 1.0}'")
    return value


def _model(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("model (each model's defaults; a preset file overrides them per model)")
    add_repeatable(
        group,
        "--model",
        metavar="[NAME=]PATH",
        help="a GGUF file to serve (default: Gemma 3 270M, from PyPI); repeatable as NAME=PATH to "
        "serve several, each loaded on demand (docs/models.md)",
    )
    group.add_argument("--model-id", help="the model name clients use (default: the file name)")
    add_repeatable(
        group,
        "--model-alias",
        metavar="NAME",
        help="another name clients may use for the (default) model (repeatable; e.g. the names Claude "
        "Code sends: --model-alias claude-sonnet-4-5)",
    )
    group.add_argument(
        "--ctx-size",
        type=_ctx_size,
        default="auto",
        help="context length per sequence, or auto: the model's training length when its KV cache "
        "for every slot fits a quarter of the memory available at start, else the most that fits "
        "(at least 4096); the choice is said at start (default: auto)",
    )
    for kv in ("k", "v"):
        group.add_argument(
            f"--cache-type-{kv}",
            f"-ct{kv}",
            choices=tuple(KV_CACHE_TYPES),
            default="f16",
            metavar="TYPE",
            help=f"the KV cache's data type for {kv.upper()}, as llama-server's: "
            f"{', '.join(KV_CACHE_TYPES)}; q8_0 halves the cache's memory"
            + (" (a quantized V turns flash attention on)" if kv == "v" else "")
            + " (default: f16; docs/models.md, 'KV cache types')",
        )
    group.add_argument(
        "--swa-full",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a sliding-window model's window layers keep every cell (any cached prefix "
        "reusable from the cells alone, at every cell's memory and attention cost); "
        "--no-swa-full (llama-server's default) keeps about the window and a batch: a "
        "fraction of the KV memory, faster long prompts, reuse where the window cells "
        "reach or from a checkpoint of them (--ctx-checkpoints); both exact for Gemma 2/3 (default: "
        "every cell while the context per sequence is at most 4 times the window and a "
        "batch — 4,096 for Gemma 3 —, the window past it; docs/prompt-cache.md, 'Window layers')",
    )
    group.add_argument(
        "--ctx-checkpoints",
        type=int,
        default=8,
        metavar="N",
        help="with --no-swa-full, the checkpoints of the window cells each sequence keeps "
        "(llama-server's flag): a shared head is reused after a long conversation ran past "
        "it (default: 8; 0: none; docs/prompt-cache.md, 'Window checkpoints')",
    )
    group.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    group.add_argument("--batch-size", type=int, default=512, help="llama.cpp's batch size (default: 512)")
    group.add_argument(
        "--batch",
        action="store_true",
        help=argparse.SUPPRESS,  # batched decoding is the default now; kept for old scripts
    )
    group.add_argument(
        "--batch-invariant",
        action="store_true",
        help="make each request's numerics independent of the others, so a temperature-0 "
        "text equals the request's text alone (costs throughput at high concurrency)",
    )
    group.add_argument(
        "--repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="let llama.cpp repack weights for this CPU's kernels (its extra buffer types); "
        "auto: on, unless the installed llama.cpp has AMX kernels, which crash on AMX CPUs "
        "(ggml-org/llama.cpp #20824; docs/platforms.md) (default: auto)",
    )
    group.add_argument(
        "--pooling",
        choices=("mean", "cls", "last"),
        default=None,
        help="how /v1/embeddings pools token vectors (default: the model's own; mean for a model "
        "that has none; docs/embeddings.md)",
    )
    group.add_argument(
        "--rerank",
        choices=("yes-no", "off"),
        default=None,
        help="yes-no: a generative model reranks (/v1/rerank) by the probability of 'yes' after "
        "its rerank prompt; a cross-encoder GGUF (rank pooling) reranks without this (docs/rerank.md)",
    )
    group.add_argument(
        "--rerank-template",
        default=None,
        metavar="TEXT",
        help="the yes-no reranker's prompt, with {instruction}, {query} and {document} "
        "(default: a generic one; Qwen3-Reranker's own in docs/rerank.md)",
    )
    add_repeatable(
        group,
        "--lora",
        type=_lora,
        metavar="NAME=PATH[:SCALE]",
        help="a LoRA adapter of the model (repeatable): requests choose it by model: NAME or "
        "BASE:NAME, or llama-server's lora: [{id, scale}]; SCALE (default 1.0) is its scale when a "
        "request names it without one (docs/lora.md); with several models, a preset's lora table",
    )
    group.add_argument(
        "--lora-max",
        type=int,
        default=16,
        metavar="N",
        help="the most LoRA adapters a model may hold, loaded at start or at run time "
        "(POST /v1/load_lora_adapter; default: 16)",
    )
    group.add_argument(
        "--mmproj",
        default=None,
        metavar="FILE",
        help="the model's vision projector (a GGUF libmtmd loads, as llama-server's --mmproj): the "
        "model takes images (docs/vision.md); with several models, a preset's mmproj key or a "
        "projector beside the model in --models-dir",
    )
    group.add_argument(
        "--max-image-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="the most image tokens one request's prompt may hold (default: 4096)",
    )
    group.add_argument(
        "--max-audio-seconds",
        type=positive_int,
        default=600,
        metavar="SECONDS",
        help="the longest audio clip a request may hold (docs/audio.md; default: 600)",
    )
    group.add_argument(
        "--scripted",
        action="store_true",
        help="serve the scripted test backend instead of a model (for benchmarking the stack)",
    )
    group.add_argument(
        "--scripted-interval", type=float, default=0.01, help="seconds per scripted token (default: 0.01)"
    )


def _models(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("many models (docs/models.md)")
    add_repeatable(
        group,
        "--models-dir",
        type=Path,
        metavar="DIR",
        help="serve every .gguf in DIR (named by its file name; a subfolder is one multi-file "
        "model, named by the folder), each loaded on demand (repeatable)",
    )
    group.add_argument(
        "--models-preset",
        type=Path,
        metavar="FILE.toml",
        help="per-model settings (context, slots, cache, pinned, keep_alive, aliases, paths): "
        "docs/models.md, 'Presets'",
    )
    group.add_argument(
        "--models-max",
        type=int,
        default=None,
        metavar="N",
        help="at most N models loaded at once; the least recently used idle one is unloaded to "
        "make room, and a request waits while every loaded model streams (default: no bound)",
    )
    group.add_argument(
        "--models-memory",
        type=int,
        default=None,
        metavar="MIB",
        help="memory the loaded models may take together (each measured at its load; before, "
        "its file size) (default: no bound)",
    )
    group.add_argument(
        "--keep-alive",
        default=None,
        metavar="DURATION",
        help="how long an idle model stays loaded: seconds or 5m / 1h; 0 unloads it after each "
        "request; -1 keeps it (default: -1, until evicted). A request's X-Keep-Alive overrides it",
    )
    group.add_argument(
        "--unload-grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds POST /models/unload gives running streams before it ends them with cause "
        "'unload' (default: 10)",
    )
    group.add_argument(
        "--blobs-dir",
        default="auto",
        metavar="DIR",
        help="where Ollama's POST /api/blobs/:digest stores uploads for /api/create (auto: "
        "$XDG_DATA_HOME/trioserve/blobs; off: uploads refused)",
    )
    group.add_argument(
        "--max-blob-bytes",
        type=int,
        default=64 << 30,
        metavar="N",
        help="the largest blob an upload may be (413 beyond) (default: 64 GiB)",
    )
    group.add_argument(
        "--delete-model-files",
        action="store_true",
        help="Ollama's DELETE /api/delete of a model's last name also deletes its file, if it lies "
        "in a --models-dir or --blobs-dir (default: files are never deleted; the model is "
        "forgotten until the server restarts)",
    )


def _prompt_cache(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("prompt cache (docs/prompt-cache.md)")
    group.add_argument(
        "--prefill-chunk",
        type=int,
        default=128,
        help="the most prompt tokens per llama_decode call; a prompt is cut into pieces by a "
        "rule of its tokens alone, whatever the load, so a cached prefix is exact (default: 128)",
    )
    group.add_argument(
        "--piece-rule",
        choices=("text", "aligned"),
        default="text",
        help="where prompts are cut into llama_decode calls: text (after turn headers, lines "
        "and sentences: a conversation's next turn reuses all of the last prompt) or aligned "
        "(every --prefill-chunk tokens from the start; every --deep-chunk past --deep-from) (default: text)",
    )
    group.add_argument(
        "--deep-chunk",
        type=int,
        default=None,
        help="a piece that starts --deep-from tokens or more into a prompt ends only at a "
        "turn header or after this many tokens: long prompts in calls the CPU runs at full "
        "rate (0: off; default: min(512, --batch-size), at least --prefill-chunk)",
    )
    group.add_argument(
        "--deep-from",
        type=int,
        default=1024,
        help="where in a prompt deep pieces start (default: 1024)",
    )
    group.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="clear every request's KV cells when it ends instead of keeping its prompt's "
        "whole pieces for later requests (the cache never changes a text: docs/prompt-cache.md)",
    )
    group.add_argument(
        "--cache-mode",
        choices=("exact", "fast"),
        default="exact",
        help="exact: reuse only whole prompt pieces, so a cached answer equals a fresh "
        "server's; fast: reuse every matching cell, the reply's too, as llama-server does "
        "(answers may differ: docs/prompt-cache.md) (default: exact)",
    )
    group.add_argument(
        "--speculate",
        choices=("off", "auto", "exact", "fast"),
        default="auto",
        help="prompt-lookup speculative decoding of a stream that decodes alone. auto: only "
        "where it cannot change a text (verify calls as wide as measured exact at load, "
        "contexts up to 256 tokens); exact: as auto at any length (a lone step past 256 tokens "
        "with no guess carries a pad row: slower plain steps there, same text with and without "
        "guesses); fast: wide verify calls at any length, as llama-server's "
        "n-gram modes (a temperature-0 text may change); off (default: auto; docs/speculation.md)",
    )
    group.add_argument(
        "--cache-ram",
        type=int,
        default=1024,
        metavar="MIB",
        help="host memory for cached prompt prefixes evicted from KV cells, least recently used "
        "out first: one budget for all the server's models (a preset's cache_ram caps one "
        "model's share), unloaded models' prefixes out first; it outlives a model's unload "
        "(default: 1024; 0: none)",
    )
    group.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="the prompt cache's disk tier: every cached prefix saved is written to DIR too, "
        "restored after a restart, a crash or an unload, exactly (an entry is used only by a "
        "model with the same file content, cell settings and llama.cpp build); several "
        "servers may share DIR. 'auto': $XDG_CACHE_HOME/trioserve/prompt-cache. Off by "
        "default: the states hold the prompts (docs/prompt-cache.md, 'On disk')",
    )
    group.add_argument(
        "--cache-disk",
        type=float,
        default=8.0,
        metavar="GIB",
        help="the disk tier's budget for all of --cache-dir (every model's, every process's), "
        "least recently used out first (default: 8)",
    )


def _upstream(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("upstream (serve a model that runs on other servers)")
    add_repeatable(
        group,
        "--upstream",
        metavar="URL",
        help="forward generation to this OpenAI-compatible server (vLLM, llama-server, "
        "llama-cpp-python, trioserve) instead of loading a model; repeatable: requests go to "
        "the least busy one, and one that fails is skipped for a while. --slots is then the "
        "capacity per upstream (default: 8); TRIOSERVE_UPSTREAM_API_KEY is sent as its bearer key",
    )
    group.add_argument(
        "--upstream-cooldown",
        type=positive_float,
        default=5.0,
        help="seconds a failed upstream is skipped before a request probes it again (default: 5)",
    )
    group.add_argument(
        "--upstream-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="fields merged into every upstream request, e.g. '{\"repeat_penalty\": 1.0}' for "
        "llama-cpp-python (whose default is 1.1); llama-server is sent return_progress on its own",
    )
