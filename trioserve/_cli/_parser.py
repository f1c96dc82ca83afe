"""``trioserve serve``'s flags, one function per group (the order ``--help`` shows),
the groups of a kind one module each: ``_model_flags`` (what is served), ``_serving_flags``
(how), ``_stream_flags``, ``_speech_flags``; logging and tracing here."""

from __future__ import annotations

import argparse
import os

from ._cluster import add_cluster_command
from ._model_flags import add_model_flags
from ._serving_flags import add_serving_flags
from ._speech_flags import add_speech_flags
from ._stream_flags import add_detach_flags

__all__ = ["parser"]


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="trioserve", description="A streaming LLM server where stop really stops."
    )
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve GGUF models over the OpenAI and Anthropic APIs")
    add_model_flags(serve)
    add_serving_flags(serve)
    add_detach_flags(serve)
    add_speech_flags(serve)
    _logging(serve)
    add_cluster_command(commands)
    return root


def _logging(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("logging and tracing")
    group.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        metavar="URL",
        help="export a span per generation request (its phases as children, parented to the "
        "client's traceparent) to this OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; needs the otel extra)",
    )
    group.add_argument(
        "--service-name",
        default=os.environ.get("OTEL_SERVICE_NAME", "trioserve"),
        help="the spans' service.name (default: $OTEL_SERVICE_NAME or trioserve)",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    group.add_argument("--log-format", default="human", choices=["human", "json"])
