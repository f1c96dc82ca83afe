"""``trioserve serve``: the command line. The flags: ``_parser.py`` (one function per
group); what they serve: ``_models.py`` (one backend, or a model registry)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import trio

from .._backends import Backend
from .._core._registry import ModelRegistry
from .._http import HTTPSettings
from .._http._detach import DetachSettings
from .._http._fetch import FetchPolicy, parse_allow
from .._http._server import Server, ServerSettings, serve_until_signalled
from .._http._settings import ModelFileSettings
from .._wire._limits import RequestLimits
from . import _models, _paths
from ._cluster import run_cluster
from ._parser import parser as _parser
from ._speech_flags import speech_source

__all__ = ["main"]

logger = logging.getLogger("trioserve")


def _loader(args: argparse.Namespace) -> tuple[str, Callable[[], Awaitable[Backend]]]:
    return _models.loader(args)


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


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get("TRIOSERVE_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file is not None:
        keys += [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
    return tuple(keys)


def _admin_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.admin_key)
    keys += [k.strip() for k in os.environ.get("TRIOSERVE_ADMIN_KEYS", "").split(",") if k.strip()]
    return tuple(keys)


def main(argv: Sequence[str] | None = None) -> int:
    # a native crash (in llama.cpp, say) leaves every thread's Python stack in the log
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (AttributeError, ValueError, OSError):  # pragma: no cover - stderr has no file
            logger.warning("faulthandler could not be enabled: stderr is not a file")
    args = _parser().parse_args(argv)
    if args.command == "cluster":
        _configure_logging("info", "text")
        return run_cluster(args)
    _configure_logging(args.log_level, args.log_format)
    models: Callable[[], Awaitable[Backend]] | ModelRegistry
    try:
        if args.max_blob_bytes < 1:
            raise RuntimeError(f"--max-blob-bytes must be at least 1, got {args.max_blob_bytes}")
        if args.pause_ram < 0:
            raise RuntimeError(f"--pause-ram must be 0 or more MiB, got {args.pause_ram}")
        if args.backlog < 1:
            raise RuntimeError(f"--backlog must be at least 1, got {args.backlog}")
        if not args.responses_max_mb_per_key > 0:
            raise RuntimeError(
                f"--responses-max-mb-per-key must be more than 0 MiB, got {args.responses_max_mb_per_key}"
            )
        if _models.is_registry(args):
            description, models = _models.registry(args, max_queue=args.max_queue)
        else:
            description, models = _loader(args)
        speech = speech_source(args)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        pause_ram_bytes=args.pause_ram * 1024 * 1024,
        shutdown_grace=args.shutdown_grace,
        stall_timeout=args.stall_timeout or None,
        api_keys=_api_keys(args),
        admin_keys=_admin_keys(args),
        cors_origins=tuple(args.cors_origin),
        keys_file=args.keys_file,
        allow_empty_keys_reload=args.allow_empty_keys_reload,
        send_buffer_bytes=args.send_buffer_bytes,
        backlog=args.backlog,
        detach=None
        if args.detach_max == 0
        else DetachSettings(
            log_events=args.detach_log_events,
            log_bytes=args.detach_log_kib * 1024,
            park_after=max(0.0, args.detach_park_after),
            timeout=args.detach_timeout,
            max_streams=args.detach_max,
            per_key=args.detach_per_key,
        ),
        http=HTTPSettings(
            heartbeat_interval=args.heartbeat_interval or None,
            stream_interval=args.stream_interval_ms / 1000.0,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            body_timeout=args.body_timeout or None,
            max_embedding_tokens=args.max_embedding_tokens or None,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens_limit=args.max_tokens_limit,
            truncation=args.truncation,
            default_timeout=args.default_timeout,
            max_timeout=args.max_timeout,
            model_aliases=tuple(args.model_alias),
            keep_billing_header=args.keep_billing_header,
            model_files=ModelFileSettings(
                blobs_dir=_paths.blobs_dir(args.blobs_dir),
                max_blob_bytes=args.max_blob_bytes,
                delete_files=args.delete_model_files,
                model_dirs=tuple(args.models_dir),
            ),
            responses_db=_paths.responses_db(args.responses_db),
            otlp_endpoint=args.otlp_endpoint or None,
            service_name=args.service_name,
            responses_max_age=args.responses_max_age * 86400.0,
            responses_max_bytes=int(args.responses_max_mb * (1 << 20)),
            responses_max_key_bytes=int(args.responses_max_mb_per_key * (1 << 20)),
            media=FetchPolicy(
                enabled=args.media_fetch,
                allow=parse_allow(args.media_fetch_allow),
                max_bytes=args.max_image_bytes,
                timeout=args.media_fetch_timeout,
                root=args.media_dir,
            ),
            request_limits=RequestLimits(
                max_stop_sequences=args.max_stop_sequences,
                max_stop_bytes=args.max_stop_bytes,
                max_logit_bias=args.max_logit_bias,
                max_tools=args.max_tools,
                max_schema_bytes=args.max_schema_bytes,
                max_messages=args.max_messages,
                max_content_parts=args.max_content_parts,
                max_batch_choices=args.max_batch_choices,
                max_images=args.max_images,
                max_image_bytes=args.max_image_bytes,
                max_audio_parts=args.max_audio_parts,
                max_audio_bytes=args.max_audio_bytes,
            ),
        ),
    )
    try:
        maker = None if args.scripted or args.upstream else _models.model_maker(args)
        server = Server(models, settings, model_maker=maker, speech=speech)
    except RuntimeError as exc:  # e.g. --otlp-endpoint without the otel extra
        logger.error("%s", exc)
        return 2
    except (OSError, ValueError) as exc:  # the keys file
        logger.error("--keys-file %s: %s", args.keys_file, exc)
        return 2
    if speech is not None:
        description += f", and the {speech.description} as {speech.name!r}"
    logger.info("trioserve %s (pid %d): loading %s", _version(), os.getpid(), description)
    keys = server.state.accounts.file.accounts
    if keys:
        logger.info("keys file %s: %d key(s)", settings.keys_file, len(keys))
    elif settings.keys_file is not None and not server.access.key_count:
        logger.warning(
            "keys file %s holds no key: every request but /health, /openapi.json and the page gets 401 "
            "until a reload (SIGHUP) adds one",
            settings.keys_file,
        )
    if settings.api_keys or settings.admin_keys:
        logger.info(
            "API keys required on every route but /health, /openapi.json and the page "
            "(%d key(s), %d admin key(s))",
            len(settings.api_keys) + len(settings.admin_keys),
            len(settings.admin_keys),
        )
    started = time.perf_counter()

    freeze = trio.CancelScope()

    async def freeze_startup() -> None:
        # What startup made (modules, the app, the models' wrappers) lives as long as
        # the process: into the permanent generation with it, so that a full collection
        # — which holds the GIL throughout, on the loop or in any thread — walks only
        # what requests make (≈ 45 ms with it on a loaded server: a /health answer held
        # that long; docs/benchmarks.md, "The cost of a streamed event").
        with freeze:
            await server.ready.wait()
            gc.collect()
            gc.freeze()

    async def serve(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await serve_until_signalled(server, task_status=task_status)
        finally:
            freeze.cancel()  # (served out before ready: nothing to freeze)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(freeze_startup)
            binds = await nursery.start(serve)
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
