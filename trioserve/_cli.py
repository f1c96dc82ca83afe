"""``trioserve serve``: the command line."""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from ._backends import (
    Backend,
    LlamaBackend,
    LlamaSettings,
    ScriptedBackend,
    UpstreamBackend,
)
from ._http import HTTPSettings
from ._http._server import Server, ServerSettings, serve_until_signalled

__all__ = ["main"]

logger = logging.getLogger("trioserve")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trioserve", description="A streaming LLM server where stop really stops."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a GGUF model over an OpenAI-compatible API")
    model = serve.add_argument_group("model")
    model.add_argument("--model", type=Path, help="path to a GGUF file (default: Gemma 3 270M, from PyPI)")
    model.add_argument("--model-id", help="the model name clients use (default: the file name)")
    model.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients may use for the model (repeatable; e.g. the names Claude Code "
        "sends: --model-alias claude-sonnet-4-5)",
    )
    model.add_argument(
        "--ctx-size", type=int, default=4096, help="context length per sequence (default: 4096)"
    )
    model.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    model.add_argument("--batch-size", type=int, default=512, help="llama.cpp's batch size (default: 512)")
    model.add_argument(
        "--batch",
        action="store_true",
        help=argparse.SUPPRESS,  # batched decoding is the default now; kept for old scripts
    )
    model.add_argument(
        "--prefill-chunk",
        type=int,
        default=128,
        help="prompt tokens per llama_decode call, in chunks aligned to absolute positions "
        "whatever the load, so a cached prefix is exact (default: 128)",
    )
    model.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="clear every request's KV cells when it ends instead of keeping its prompt's "
        "whole chunks for later requests (the cache never changes a text: docs/prompt-cache.md)",
    )
    model.add_argument(
        "--cache-mode",
        choices=("exact", "fast"),
        default="exact",
        help="exact: reuse only whole aligned prompt chunks, so a cached answer equals a fresh "
        "server's; fast: reuse every matching cell, the reply's too, as llama-server does "
        "(answers may differ: docs/prompt-cache.md) (default: exact)",
    )
    model.add_argument(
        "--cache-ram",
        type=int,
        default=1024,
        metavar="MIB",
        help="host memory for cached prompt prefixes evicted from KV cells, least recently "
        "used out first (default: 1024; 0: none)",
    )
    model.add_argument(
        "--batch-invariant",
        action="store_true",
        help="make each request's numerics independent of the others, so a temperature-0 "
        "text equals the request's text alone (costs throughput at high concurrency)",
    )
    model.add_argument(
        "--repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="let llama.cpp repack weights for this CPU's kernels (its extra buffer types); "
        "auto: on, unless the installed llama.cpp has AMX kernels, which crash on AMX CPUs "
        "(ggml-org/llama.cpp #20824; docs/platforms.md) (default: auto)",
    )
    model.add_argument(
        "--pooling",
        choices=("mean", "cls", "last"),
        default=None,
        help="how /v1/embeddings pools token vectors (default: the model's own; mean for a model "
        "that has none; docs/embeddings.md)",
    )
    model.add_argument(
        "--scripted",
        action="store_true",
        help="serve the scripted test backend instead of a model (for benchmarking the stack)",
    )
    model.add_argument(
        "--scripted-interval", type=float, default=0.01, help="seconds per scripted token (default: 0.01)"
    )
    upstream = serve.add_argument_group("upstream (serve a model that runs on other servers)")
    upstream.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="forward generation to this OpenAI-compatible server (vLLM, llama-server, "
        "llama-cpp-python, trioserve) instead of loading a model; repeatable: requests go to "
        "the least busy one, and one that fails is skipped for a while. --slots is then the "
        "capacity per upstream (default: 8); TRIOSERVE_UPSTREAM_API_KEY is sent as its bearer key",
    )
    upstream.add_argument(
        "--upstream-cooldown",
        type=_positive_float,
        default=5.0,
        help="seconds a failed upstream is skipped before a request probes it again (default: 5)",
    )
    upstream.add_argument(
        "--upstream-body",
        type=_json_object,
        default={},
        metavar="JSON",
        help="fields merged into every upstream request, e.g. '{\"repeat_penalty\": 1.0}' for "
        "llama-cpp-python (whose default is 1.1); llama-server is sent return_progress on its own",
    )
    net = serve.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    admission = serve.add_argument_group("admission and limits")
    admission.add_argument(
        "--slots",
        type=int,
        default=None,
        help="generations at once: sequences decoded together (default: 8); with --upstream, "
        "per upstream (default: 8)",
    )
    admission.add_argument(
        "--max-queue", type=int, default=16, help="requests waiting for a slot (default: 16)"
    )
    admission.add_argument(
        "--default-timeout",
        type=_positive_float,
        default=None,
        help="seconds a request may take when it sends no X-Request-Timeout (default: none)",
    )
    admission.add_argument(
        "--max-timeout", type=_positive_float, default=600.0, help="cap on X-Request-Timeout (default: 600)"
    )
    admission.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="request body limit (default: 4 MiB)"
    )
    flow = serve.add_argument_group("flow control")
    flow.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="disconnect a client that accepts no data for this many seconds (default: 30; 0: never)",
    )
    flow.add_argument(
        "--send-buffer-bytes",
        type=int,
        default=16 * 1024,
        help="bytes a connection may queue in the kernel unsent (TCP_NOTSENT_LOWAT; default: 16384)",
    )
    flow.add_argument(
        "--heartbeat-interval",
        type=float,
        default=15.0,
        help="SSE comment after this many silent seconds (queued, long prefill; default: 15; 0: off)",
    )
    admission.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get to finish on SIGTERM before they are cancelled (default: 10)",
    )
    access = serve.add_argument_group("access")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (repeatable; also "
        "TRIOSERVE_API_KEYS=key1,key2)",
    )
    access.add_argument("--api-key-file", type=Path, help="a file with one API key per line")
    access.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browsers on this origin to call the API (repeatable; '*' for any; default: off)",
    )
    admission.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default: the context)"
    )
    admission.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens accepted (default: the context)",
    )
    admission.add_argument(
        "--max-header-bytes", type=int, default=16 * 1024, help="request head limit (default: 16 KiB)"
    )
    dialects = serve.add_argument_group("API dialects (docs/dialects.md)")
    dialects.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's x-anthropic-billing-header system block in the prompt (by default "
        "it is removed: it changes every request and would defeat the prompt cache)",
    )
    logs = serve.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    logs.add_argument("--log-format", default="human", choices=["human", "json"])
    return parser


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": self.formatTime(record),
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": record.getMessage(),
            }
        )


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("trioserve").setLevel(level.upper())


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"repeat_penalty\": 1.0}'")
    return value


def _loader(args: argparse.Namespace) -> tuple[str, Callable[[], Awaitable[Backend]]]:
    if args.upstream:
        if args.scripted or args.model is not None:
            raise RuntimeError("--upstream serves a model that runs elsewhere: drop --model / --scripted")
        slots = args.slots or 8
        load = functools.partial(
            UpstreamBackend.aload,
            args.upstream,
            model_id=args.model_id,
            slots_per_upstream=slots,
            cooldown=args.upstream_cooldown,
            extra_body=args.upstream_body,
            api_key=os.environ.get("TRIOSERVE_UPSTREAM_API_KEY") or None,
        )
        return f"upstream(s) {', '.join(args.upstream)} ({slots} slot(s) each)", load
    if args.batch:
        logger.warning("--batch is the default now (and the only llama backend); the flag does nothing")
    if args.slots is None:
        args.slots = 8
    if args.slots < 1:
        raise RuntimeError(f"--slots must be at least 1, got {args.slots}")
    if args.scripted:
        backend = ScriptedBackend(
            token_interval=args.scripted_interval, slots=args.slots, context_length=args.ctx_size
        )

        async def scripted() -> Backend:
            return backend

        return "scripted backend", functools.partial(scripted)
    if args.model is None:
        from ._backends._models import default_model_path

        path = default_model_path(progress=sys.stderr.isatty())
    else:
        path = args.model
    settings = LlamaSettings(
        path,
        n_ctx=args.ctx_size,
        n_threads=args.threads,
        n_batch=args.batch_size,
        slots=args.slots,
        prefill_chunk=args.prefill_chunk,
        prompt_cache=not args.no_prompt_cache,
        cache_ram_bytes=args.cache_ram * 1024 * 1024,
        cache_mode=args.cache_mode,
        batch_invariant=args.batch_invariant,
        model_id=args.model_id,
        repack={"auto": None, "on": True, "off": False}[args.repack],
        pooling=args.pooling,
    )
    description = (
        f"model {path} ({settings.slots} sequences of {settings.n_ctx} tokens, "
        f"{settings.n_threads} threads{', batch-invariant' if settings.batch_invariant else ''})"
    )
    return description, functools.partial(LlamaBackend.aload, settings)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get("TRIOSERVE_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file is not None:
        keys += [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
    return tuple(keys)


def main(argv: Sequence[str] | None = None) -> int:
    # a native crash (in llama.cpp, say) leaves every thread's Python stack in the log
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # pragma: no cover - stderr has no file
            logger.warning("faulthandler could not be enabled: stderr is not a file")
    args = _parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format)
    try:
        description, load = _loader(args)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    if args.model is not None and not args.scripted and not Path(args.model).is_file():
        logger.error("model file not found: %s", args.model)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        shutdown_grace=args.shutdown_grace,
        stall_timeout=args.stall_timeout or None,
        api_keys=_api_keys(args),
        cors_origins=tuple(args.cors_origin),
        send_buffer_bytes=args.send_buffer_bytes,
        http=HTTPSettings(
            heartbeat_interval=args.heartbeat_interval or None,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens_limit=args.max_tokens_limit,
            default_timeout=args.default_timeout,
            max_timeout=args.max_timeout,
            model_aliases=tuple(args.model_alias),
            keep_billing_header=args.keep_billing_header,
        ),
    )
    server = Server(load, settings)
    logger.info("trioserve %s (pid %d): loading %s", _version(), os.getpid(), description)
    if settings.api_keys:
        logger.info("API keys required on /v1/* and /metrics (%d key(s))", len(settings.api_keys))
    started = time.perf_counter()

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_until_signalled, server)
            logger.info("listening on %s", ", ".join(binds))

    trio.run(run)
    logger.info("exited after %.1f s", time.perf_counter() - started)
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trioserve")
    except PackageNotFoundError:
        return "dev"


if __name__ == "__main__":
    raise SystemExit(main())
