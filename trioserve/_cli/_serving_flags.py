"""``trioserve serve``'s flags for how it serves: the network, admission and the limits
of one request, flow control, API keys and CORS, media, and the dialects (the order
``--help`` shows)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._core._media import DEFAULT_IMAGE_BUDGET_BYTES
from .._wire._limits import RequestLimits
from ._flag_types import add_repeatable, positive_float, positive_int
from ._stream_flags import add_stream_interval_flag

__all__ = ["add_serving_flags"]


def add_serving_flags(serve: argparse.ArgumentParser) -> None:
    """The groups of flags for how the server serves, in ``--help``'s order."""
    _network(serve)
    _admission(serve)
    _flow(serve)
    _access(serve)
    _media(serve)
    _dialects(serve)


def _network(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("network")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")


def _admission(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("admission and limits")
    group.add_argument(
        "--slots",
        type=int,
        default=None,
        help="generations at once (per model): sequences decoded together (default: 8); with "
        "--upstream, per upstream (default: 8)",
    )
    group.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests waiting for a slot, paused ones included (default: 16)",
    )
    group.add_argument(
        "--pause-ram",
        type=int,
        default=1024,
        metavar="MIB",
        help="host memory for the saved states of requests paused for a better priority, all "
        "models together; when it is spent a pause is not asked and the better-ranked request "
        "waits in the queue (default: 1024; 0: never pause; docs/scheduling.md)",
    )
    group.add_argument(
        "--default-timeout",
        type=positive_float,
        default=None,
        help="seconds a request may take (a model load, queue, prefill, decode) when it sends no "
        "X-Request-Timeout (default: none)",
    )
    group.add_argument(
        "--max-timeout", type=positive_float, default=600.0, help="cap on X-Request-Timeout (default: 600)"
    )
    group.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="request body limit (default: 4 MiB)"
    )
    group.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight streams get to finish on SIGTERM before they are cancelled (default: 10)",
    )
    group.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt accepted (default: the context)"
    )
    group.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens accepted (default: the context)",
    )
    group.add_argument(
        "--truncation",
        choices=("disabled", "auto"),
        default="disabled",
        help="a conversation longer than the context, when its request does not say (truncation): "
        "disabled, a 400 context_length_exceeded with the counts; auto, its oldest whole turns "
        "dropped until it fits, never the system prompt, tools or last user turn, and the count "
        "said (default: disabled; docs/dialects.md, Truncation)",
    )
    group.add_argument(
        "--max-header-bytes", type=int, default=16 * 1024, help="request head limit (default: 16 KiB)"
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may take to arrive in full; then 408 (default: 30; 0: no limit)",
    )
    group.add_argument(
        "--max-embedding-tokens",
        type=int,
        default=65536,
        help="most tokens one /v1/embeddings request may hold, all inputs together (default: 65536; 0: none)",
    )
    _request_limits(group)


#: what one request may ask for (RequestLimits; docs/api.md, "Limits"): (flag, help)
_REQUEST_LIMITS = (
    ("--max-stop-sequences", "stop sequences per request (OpenAI's stop keeps OpenAI's 4)"),
    ("--max-stop-bytes", "bytes of all of a request's stop sequences together"),
    ("--max-logit-bias", "logit_bias entries per request"),
    ("--max-tools", "tools per request"),
    ("--max-schema-bytes", "size of one JSON Schema: a tool's parameters, a response format"),
    ("--max-messages", "messages (or Responses input items) per request"),
    ("--max-content-parts", "content parts (blocks) of all of a request's messages"),
    ("--max-batch-choices", "/v1/completions: prompts x n per request"),
    ("--max-images", "images per request (docs/vision.md)"),
    ("--max-audio-parts", "audio parts (input_audio) per request (docs/audio.md)"),
)


def _request_limits(group: argparse._ArgumentGroup) -> None:
    defaults = RequestLimits()
    for flag, what in _REQUEST_LIMITS:
        default = getattr(defaults, flag[2:].replace("-", "_"))
        group.add_argument(flag, type=positive_int, default=default, help=f"{what} (default: {default})")


def _flow(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("flow control")
    group.add_argument(
        "--stall-timeout",
        type=float,
        default=30.0,
        help="disconnect a client that accepts no data for this many seconds (default: 30; 0: never)",
    )
    group.add_argument(
        "--send-buffer-bytes",
        type=int,
        default=16 * 1024,
        help="bytes a connection may queue in the kernel unsent (TCP_NOTSENT_LOWAT; default: 16384)",
    )
    group.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues for accept (listen's backlog, capped by "
        "net.core.somaxconn; default: 2048)",
    )
    add_stream_interval_flag(group)
    group.add_argument(
        "--heartbeat-interval",
        type=float,
        default=15.0,
        help="SSE comment after this many silent seconds (queued, long prefill; default: 15; 0: off)",
    )


def _media(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("images (docs/vision.md)")
    group.add_argument(
        "--media-fetch",
        action="store_true",
        help="fetch http(s) image URLs (off by default: send images as data URLs); every address "
        "and redirect hop is checked against loopback, private and link-local ranges",
    )
    add_repeatable(
        group,
        "--media-fetch-allow",
        metavar="HOST[:PORT]",
        help="with --media-fetch: fetch only from these hosts (repeatable; default: any public host)",
    )
    group.add_argument(
        "--media-fetch-timeout",
        type=positive_float,
        default=10.0,
        metavar="SECONDS",
        help="the most one image fetch may take (default: 10)",
    )
    group.add_argument(
        "--max-image-bytes",
        type=positive_int,
        default=20 << 20,
        metavar="BYTES",
        help="the largest image, decoded from a data URL or fetched (default: 20 MiB; a data URL "
        "also counts toward --max-body-bytes)",
    )
    group.add_argument(
        "--max-audio-bytes",
        type=positive_int,
        default=25 << 20,
        metavar="BYTES",
        help="the largest audio clip, base64-decoded or uploaded (docs/audio.md; default: 25 MiB, "
        "OpenAI's; a clip sent inline also counts toward --max-body-bytes)",
    )
    group.add_argument(
        "--image-decode-budget",
        type=positive_int,
        default=DEFAULT_IMAGE_BUDGET_BYTES >> 20,
        metavar="MIB",
        help="memory for decoded images, all requests and models together: a request waits "
        "for its images' share (3 bytes a pixel each, 16 more a pixel of its largest while it "
        f"decodes); one that alone needs more gets 400 (default: {DEFAULT_IMAGE_BUDGET_BYTES >> 20})",
    )
    group.add_argument(
        "--media-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="read file:// image URLs, only under DIR (default: never)",
    )


def _access(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("access")
    add_repeatable(
        group,
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health, /openapi.json and the page "
        "(docs/operations.md, 'Who may call what'; repeatable; also TRIOSERVE_API_KEYS=key1,key2)",
    )
    group.add_argument("--api-key-file", type=Path, help="a file with one API key per line")
    group.add_argument(
        "--keys-file",
        type=Path,
        metavar="TOML",
        help="API keys with their priority, fair-share weight and limits (concurrency, tokens and "
        "requests per minute), and [defaults] for the others; read again on SIGHUP; given, keys "
        "are always required, even while it holds none (docs/operations.md, 'Keys, priorities "
        "and limits')",
    )
    group.add_argument(
        "--allow-empty-keys-reload",
        action="store_true",
        help="let a SIGHUP reload of --keys-file leave no key where there are keys (every keyed "
        "request then gets 401); by default such a reload is refused and the keys in force stay",
    )
    add_repeatable(
        group,
        "--admin-key",
        metavar="KEY",
        help="an API key that may also load and unload models (POST /models/load, /models/unload) "
        "and send X-Keep-Alive; with keys configured, other keys get 403 there (repeatable; also "
        "TRIOSERVE_ADMIN_KEYS=key1,key2)",
    )
    add_repeatable(
        group,
        "--cors-origin",
        metavar="ORIGIN",
        help="allow browsers on this origin to call the API (repeatable; '*' for any; default: off)",
    )


def _dialects(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("API dialects (docs/dialects.md)")
    group.add_argument(
        "--keep-billing-header",
        action="store_true",
        help="keep Claude Code's x-anthropic-billing-header system block in the prompt (by default "
        "it is removed: it changes every request and would defeat the prompt cache)",
    )
    group.add_argument(
        "--responses-db",
        default="memory",
        metavar="PATH",
        help="where stored Responses (store, previous_response_id, background) are kept: a SQLite "
        "file that survives restarts; 'auto': $XDG_DATA_HOME/trioserve/responses.sqlite3; 'memory' "
        "(the default): lost at exit, nothing written to disk; 'off': none stored (store: true, "
        "previous_response_id and background are refused)",
    )
    group.add_argument(
        "--responses-max-age",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="days a stored response is kept (default: 30)",
    )
    group.add_argument(
        "--responses-max-mb",
        type=float,
        default=512.0,
        metavar="MIB",
        help="the stored responses' size at most, all keys together: a write past it removes the "
        "writing key's oldest, never another key's (default: 512)",
    )
    group.add_argument(
        "--responses-max-mb-per-key",
        type=float,
        default=64.0,
        metavar="MIB",
        help="the stored responses one API key may keep, its oldest out first (default: 64; a server "
        "without keys: --responses-max-mb alone)",
    )
